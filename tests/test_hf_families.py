"""The family registry: a misspelt family is refused with a suggestion, and every registered
family's config mapping round-trips and its tensor table names exactly the model's
parameters (what conversion and export rely on). No transformers needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, validate
from engine.interop.hf.mapping import check_table_covers, model_config_from_hf, model_config_to_hf
from engine.models.config import ModelConfig
from engine.models.families import family_names, get_family
from engine.models.params import abstract_model_params

SHAPE = dict(vocab_size=17, d_model=12, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=6, mlp_dim=7)

GRANITE = {
    "num_local_experts": 0,
    "shared_intermediate_size": 7,
    "mamba_n_heads": 2,
    "layer_types": ["mamba", "attention", "mamba"],
    "num_attention_heads": 2,  # head_dim = hidden_size / heads, even
}


CLASSIC = {"gpt_neox", "phi", "gptj", "stablelm", "codegen", "falcon", "nemotron"}


GPT2_NAMES = {"gpt2", "gpt_bigcode", "bloom"}


def tiny(family: str, tie: bool) -> tuple:
    """A tiny config.json of `family`, odd sizes, through the family's own mapping."""
    fam = get_family(family)
    hf = {
        "model_type": fam.model_type,
        "architectures": [fam.architecture],
        "vocab_size": 17,
        "hidden_size": 12,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,  # GLM-4.5 rotates half of each head: an even half
        "intermediate_size": 7,
        "sliding_window": 5,
        "tie_word_embeddings": tie,
        "hidden_size_per_layer_input": 0,  # Gemma 4: none of its per-layer embeddings (default 256)
        "num_kv_shared_layers": 0,  # Gemma 3n: its default (15 layers sharing) needs more layers
        # GPT-2's own names (GPT-BigCode's, BLOOM's too): 4 heads of 3, an MLP of 7; OPT's MLP
        **({"n_embd": 12, "n_layer": 3, "n_head": 4, "n_inner": 7, "n_positions": 64} if family in GPT2_NAMES else {}),
        "ffn_dim": 7,
        # DBRX's and MPT's own names: 4 heads of 4, 3 experts of 7
        **{"d_model": 16, "n_heads": 4, "n_layers": 3, "ffn_config": {"ffn_hidden_size": 7, "moe_num_experts": 3}},
        # Nemotron-H: a Mamba2, an MLP and an attention layer, Mamba2 of 2 heads of 3, state 4
        "layers_block_type": ["linear_attention", "mlp", "full_attention"],
        "mamba_num_heads": 2,
        "mamba_head_dim": 3,
        "ssm_state_size": 4,
        "n_groups": 1,
        # LFM2: a short convolution, an attention and a convolution layer
        "full_attn_idxs": [1],
        # RecurrentGemma: head_dim is hidden_size / heads, 4, half of it rotary
        **({"num_attention_heads": 3, "num_key_value_heads": 1} if family == "recurrent_gemma" else {}),
        # Granite 4 hybrid: dense (no experts), Mamba2 of 2 heads, a Mamba2, an attention and a Mamba2 layer
        **(GRANITE if family == "granite_hybrid" else {}),
        # Falcon-H1: Mamba2 of 2 heads of 3 (its width mamba_d_ssm), state 4
        **(
            {"mamba_d_ssm": 6, "mamba_n_heads": 2, "mamba_d_head": 3, "mamba_d_state": 4, "mamba_n_groups": 1}
            if family == "falcon_h1"
            else {}
        ),
        # Mamba2: 3 heads of head_dim 8, 2 x hidden_size as transformers requires, state 4
        **({"num_heads": 3, "state_size": 4} if family == "mamba2" else {}),
        # Bamba: a Mamba2 (2 heads of 12), an attention and a Mamba2 layer
        **({"mamba_n_heads": 2, "attn_layer_indices": [1]} if family == "bamba" else {}),
        # Helium: o_proj is (hidden_size, hidden_size), so heads * head_dim = hidden_size
        **({"num_attention_heads": 2, "head_dim": 6} if family == "helium" else {}),
        # DeepSeek Sparse Attention: the indexer reads the compressed query
        **({"q_lora_rank": 6} if family in ("deepseek_v32", "glm_moe_dsa") else {}),
        # DeepSeek-V4: half of each head rotary (its default, an eighth, would be one dimension of 8)
        **({"partial_rotary_factor": 0.5} if family == "deepseek_v4" else {}),
        # OLMoE: head_dim is hidden_size / heads (its q_norm is hidden_size wide)
        **({"hidden_size": 32} if family == "olmoe" else {}),
        # GPT-era families whose head_dim is hidden_size / heads: 8, a quarter of it rotary
        **({"hidden_size": 16, "num_attention_heads": 2, "rotary_dim": 4} if family in CLASSIC else {}),
        # OLMo Hybrid: head_dim is hidden_size / heads, 6 (even, for RoPE)
        **({"num_attention_heads": 2} if family == "olmo_hybrid" else {}),
        # MiMo-V2-Flash: values no wider than the keys (its default v_head_dim is 128)
        **({"v_head_dim": 6} if family == "mimo_v2_flash" else {}),
        # Zamba2: a Mamba2 (2 heads of 12) and two hybrid layers calling the shared block (heads of 6)
        **({"layers_block_type": ["mamba", "hybrid", "hybrid"], "n_mamba_heads": 2} if family == "zamba2" else {}),
    }
    return model_config_from_hf(hf)


def test_an_unknown_family_is_refused_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown family 'lama'; did you mean 'llama'\?"):
        ModelConfig(family="lama", **SHAPE)
    refused = r"model.yaml: key 'family': .*unknown family 'bert'; valid families: [a-z0-9_, ]*\bllama\b"
    with pytest.raises(ConfigError, match=refused):
        validate(ModelConfig, {"family": "bert", **SHAPE}, "model.yaml")
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"} <= set(family_names())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", family_names())
def test_every_family_tensor_table_covers_exactly_the_model_parameters(family, tie):
    cfg, compute = tiny(family, tie)
    assert cfg.family == family and cfg.tie_embeddings == tie
    check_table_covers(cfg, abstract_model_params(cfg, compute, None))


@pytest.mark.parametrize("family", family_names())
def test_every_family_config_round_trips_through_config_json(family):
    cfg, _ = tiny(family, tie=False)
    hf = model_config_to_hf(cfg, {"eos_token_id": 3}, param_dtype="bfloat16")
    assert hf["architectures"] == [get_family(family).architecture] and hf["dtype"] == "bfloat16"
    again, compute = model_config_from_hf(hf, param_dtype="bfloat16")
    assert again == cfg and compute.param_dtype == compute.dtype == "bfloat16"
    # and config.json -> ModelConfig -> config.json writes the same file
    assert model_config_to_hf(again, {"eos_token_id": 3}, param_dtype="bfloat16") == hf


def test_reading_a_config_json_imports_no_jax():
    """Pipeline validation reads config.json and fingerprints a source without JAX."""
    code = (
        "import sys, engine.interop.hf.files, engine.interop.hf.mapping, engine.models.families; "
        "sys.exit('jax' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0
