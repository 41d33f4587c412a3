"""Hugging Face parity of dense families from transformers' catalogue: Granite 3 (IBM's
multipliers), GLM-4 and GLM-4-0414 (q/k/v biases, interleaved RoPE on part of each head, a
fused gate_up_proj; post-sublayer norms in the second), EXAONE 4.0 (OLMo 2's output norms,
QK norm, NoPE global layers), VaultGemma (Gemma 2 without its post norms), Granite SWA
(sliding windows, attention sinks, a RoPE base per layer and NoPE layers), MiniCPM3
(latent attention with MiniCPM's scalings and LongRoPE) and Apertus (xIELU in an ungated MLP,
its learned scalars converted and its constant buffers written back).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', export -> convert bitwise; and here logits to 1e-4 with N(0, 0.3^2) weights,
the export loading cleanly in transformers, config.json as transformers writes it, and each
published preset's parameter count equal to transformers'.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    Case,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""The classes' default token ids lie past the tiny vocabulary (GLM's pad id is an embedding row)."""
LLAMA3 = {  # (copied where used: transformers adds keys to the dict it is given)
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
MULTIPLIERS = dict(embedding_multiplier=1.7, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5)


def hf_config(name: str):
    t = transformers
    return {
        "granite": lambda: t.GraniteConfig(**COMMON, **MULTIPLIERS, rope_theta=500.0, **NO_TOKENS),
        # 6 of the 8 dimensions of each head rotate (GLM's default is half), q/k/v biases
        "glm": lambda: t.GlmConfig(**COMMON, partial_rotary_factor=0.75, rope_theta=500.0, **NO_TOKENS),
        # 12-wide heads, the default half rotating, Llama 3 scaling
        "glm4": lambda: t.Glm4Config(**{**COMMON, "head_dim": 12}, rope_parameters={**LLAMA3}, **NO_TOKENS),
        # local, local, global, local: RoPE (Llama 3 scaled) on the local layers, the global one NoPE
        "exaone4": lambda: t.Exaone4Config(
            **{**COMMON, "num_hidden_layers": 4},
            sliding_window=test_hf_parity.WINDOW,
            sliding_window_pattern=3,
            rope_parameters={**LLAMA3},
            **NO_TOKENS,
        ),
        "vaultgemma": lambda: t.VaultGemmaConfig(
            **{**COMMON, "num_hidden_layers": 4},
            **test_hf_parity.GEMMA2,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0,
            **NO_TOKENS,
        ),
        # global, local, local, global, local; RoPE bases 1000 (global) and 500 (local), two NoPE layers
        "granite_swa": lambda: t.GraniteSWAConfig(
            **{**COMMON, "num_hidden_layers": 5},
            **MULTIPLIERS,
            sliding_window=test_hf_parity.WINDOW,
            layer_types=[f"{kind}_attention" for kind in ("full", "sliding", "sliding", "full", "sliding")],
            layer_rope_theta=[1000.0, 500.0, 0, 0, 500.0],
            rope_theta=1000.0,  # the global layers' (a base no layer uses has no ModelConfig field)
            tie_word_embeddings=False,
            **NO_TOKENS,
        ),
        # compressed queries, a 10-wide latent, 6 + 4 key dims, 7-wide values; LongRoPE as published
        "minicpm3": lambda: t.MiniCPM3Config(
            **{**COMMON, "num_key_value_heads": 6},
            q_lora_rank=12,
            kv_lora_rank=10,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=7,
            scale_emb=2.5,
            scale_depth=1.3,
            dim_model_base=12,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.5, 2.0],
                "long_factor": [3.0, 4.0],
                "original_max_position_embeddings": 64,
            },
            **NO_TOKENS,
        ),
        # xIELU in an ungated MLP of 26, QK norm, Llama 3 scaling (as its default)
        "apertus": lambda: t.ApertusConfig(**COMMON, rope_parameters={**LLAMA3}, **NO_TOKENS),
    }[name]()


CASES = ["granite", "glm", "glm4", "exaone4", "vaultgemma", "granite_swa", "minicpm3", "apertus"]


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:

    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, attn_implementation="eager")
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits(case):
    assert case.cfg.family == case.family
    tokens, mask = batch()
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_family_reads_what_the_config_says(case):
    cfg, layers = case.cfg, case.cfg.layer_pattern()
    if case.family in ("granite", "granite_swa"):
        assert (cfg.embedding.multiplier, cfg.block.residual_multiplier, cfg.attention.scale, cfg.head.divisor) == (
            1.7,
            0.6,
            0.2,
            2.5,
        )
    if case.family == "glm":
        assert cfg.rope.rotary_dim == 6 and cfg.rope.interleave and cfg.attention.qkv_bias and not cfg.block.post_norms
    elif case.family == "glm4":
        assert (
            cfg.rope.rotary_dim == 6
            and cfg.attention.head_dim == 12
            and cfg.block.post_norms
            and cfg.rope.scaling.kind == "llama3"
        )
    elif case.family == "exaone4":
        assert [x.local for x in layers] == [True, True, False, True] == [x.rope for x in layers]
        assert (
            not cfg.block.pre_norms
            and cfg.block.post_norms
            and cfg.attention.qk_norm
            and not cfg.attention.qk_norm_across_heads
        )
    elif case.family == "vaultgemma":
        assert not cfg.block.post_norms and cfg.norm.zero_centered and cfg.attention.softcap == 1.5
        assert "post_attn_norm" not in case.params["blocks"]
    elif case.family == "granite_swa":
        assert [x.local for x in layers] == [False, True, True, False, True] and cfg.attention.sinks
        assert [x.rope for x in layers] == [True, True, False, False, True]
        assert (cfg.rope.theta, cfg.rope.local_theta) == (1000.0, 500.0)
    elif case.family == "minicpm3":
        assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.mla.rope_head_dim, cfg.mla.v_head_dim) == (10, 12, 4, 7)
        assert cfg.attention.head_dim == 10  # qk_nope_head_dim + qk_rope_head_dim
        assert cfg.embedding.multiplier == 2.5 and cfg.head.divisor == 2.5 and not cfg.rope.interleave
        assert cfg.block.residual_multiplier == pytest.approx(1.3 / 3**0.5, rel=1e-15)
    elif case.family == "apertus":
        assert (
            cfg.mlp.activation == "xielu"
            and not cfg.mlp.gated
            and cfg.attention.qk_norm
            and cfg.rope.scaling.kind == "llama3"
        )
        mlp = case.params["blocks"]["mlp"]
        assert mlp["xielu_alpha_p"].shape == mlp["xielu_alpha_n"].shape == (3, 1) and "w_gate_df" not in mlp


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", attn_implementation="eager")


def test_exported_config_json_is_what_transformers_writes(case, tmp_path, monkeypatch):
    """test_hf_parity's check; GLM's export also writes the top-level `partial_rotary_factor`
    its published configs carry (transformers 4 reads it there)."""
    monkeypatch.setattr(test_hf_parity, "OLDER_KEYS", test_hf_parity.OLDER_KEYS | {"partial_rotary_factor"})
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def _hf_dict(name: str, **changes) -> dict:
    return {**hf_config(name).to_dict(), **changes}


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    architectures = {
        "granite_swa": "GraniteSWAForCausalLM",
        "exaone4": "Exaone4ForCausalLM",
        "minicpm3": "MiniCPM3ForCausalLM",
        "glm": "GlmForCausalLM",
    }
    refused = (
        ("granite_swa", {"layer_rope_theta": [1000.0, 500.0, 0, 2000.0, 500.0]}, r"more than one RoPE base"),
        ("exaone4", {"sliding_window_pattern": "LLXG", "layer_types": None}, r"must be L and G letters"),
        ("exaone4", {"layer_types": ["full_attention"] * 4}, r"every layer NoPE, which is not supported"),
        ("minicpm3", {"max_position_embeddings": 128}, r"LongRoPE with original_max_position_embeddings \(64\)"),
        ("glm", {"partial_rotary_factor": 0.2, "rope_parameters": None}, r"gives 1 rotary dimensions"),
    )
    for name, changes, message in refused:
        hf = {**_hf_dict(name, **changes), "architectures": [architectures[name]]}
        with pytest.raises(ConfigError, match=message) as error:
            model_config_from_hf(hf)
        assert "\n" not in str(error.value)


def test_lora_takes_the_projections_peft_names_and_fused_ones_whole():
    """GLM's gate and up are one gate_up_proj: one module (gate's A, a B each), as PEFT's."""
    from engine.models.config import LoraConfig

    glm, _ = model_config_from_hf({**_hf_dict("glm4"), "architectures": ["Glm4ForCausalLM"]})
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "gate_up_proj")
    assert LoraConfig(target_modules="all-linear").targets(glm) == all_linear
    assert LoraConfig(target_modules=["gate_up_proj"]).weights(glm) == {
        "w_gate_df": "w_gate_df",
        "w_up_df": "w_gate_df",
    }
    with pytest.raises(ValueError, match=r"family 'glm4' has no module gate_proj to adapt"):
        LoraConfig(target_modules=["gate_proj"]).targets(glm)
    granite, _ = model_config_from_hf({**_hf_dict("granite_swa"), "architectures": ["GraniteSWAForCausalLM"]})
    assert len(LoraConfig(target_modules="all-linear").targets(granite)) == 7
    apertus, _ = model_config_from_hf({**_hf_dict("apertus"), "architectures": ["ApertusForCausalLM"]})
    assert LoraConfig(target_modules="all-linear").targets(apertus)[-2:] == ("up_proj", "down_proj")


PUBLISHED = {  # the model cards' sizes (billions) and how closely ModelConfig.num_params meets them
    "granite-3.3-8b": (8.17, 0.01),
    "glm-4-9b": (9.40, 0.01),
    "glm4-9b-0414": (9.40, 0.01),
    "exaone-4.0-32b": (32.0, 0.01),
    "vaultgemma-1b": (1.04, 0.02),
    "minicpm3-4b": (4.07, 0.01),
    "apertus-8b": (8.05, 0.01),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device) and of the size its model card gives."""
    from engine.config import resolve_model_preset
    from engine.interop.hf.mapping import model_config_to_hf
    from engine.models.config import ModelConfig

    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)
