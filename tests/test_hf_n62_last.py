"""Hugging Face parity of Zamba2 (transformers' zamba2): Mamba2 layers, some of which first call
one of two shared attention + MLP blocks in turn, on the stream joined with the embeddings, each
call with adapters of its own on the shared q, k, v and the MLP's gate and up projection.

The case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4, greedy tokens and the cached sampler
equal transformers' generate (the sampler decodes with each hybrid layer's shared-attention keys
beside its Mamba2 state, a group's prompt shared), the export loading cleanly in transformers
with the same logits, config.json as transformers writes it, export -> convert bitwise. Plus:
the checkpoint's layout (each shared block saved once, each call's adapters under it), each
shared block one set of parameters that training reaches, the refusals, and the preset's
parameter count against transformers' (meta device). A tiny model with odd widths: hidden 30,
5 attention heads of 12 over the 60-wide join, an MLP of 26, adapters of rank 5, Mamba2 of 6
heads of 10 in 2 groups, state 7, 3 taps, chunks of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.interop.hf.safetensors_io import SafetensorsFile  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.params import graphdef_of  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    converted_case,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
LAYERS = ["mamba", "hybrid", "mamba", "hybrid", "hybrid"]


def hf_config(**changes):
    return transformers.Zamba2Config(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 30,
            "intermediate_size": 26,
            "num_hidden_layers": len(LAYERS),
            "layers_block_type": LAYERS,
            "num_attention_heads": 5,
            "n_mamba_heads": 6,
            "mamba_d_state": 7,
            "mamba_d_conv": 3,
            "mamba_expand": 2,
            "mamba_ngroups": 2,
            "chunk_size": 8,
            "num_mem_blocks": 2,
            "adapter_rank": 5,
            "use_shared_attention_adapter": True,
            "use_mem_rope": True,
            "max_position_embeddings": 64,
            **TOKENS,
            **changes,
        }
    )


IMPLEMENTATIONS = {"attn_implementation": "eager"}


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("zamba2")
    model = random_causal_lm(hf_config(), 0, **IMPLEMENTATIONS)
    # The shared blocks at 0.6x (their matrices N(0, 0.18^2)): at 0.3 their 60-wide join sets
    # transformers' own float32 logits 2e-4 from its float64 ones, past the bound; so they are 1e-5.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "shared_transformer" in name:
                p.mul_(0.6)
    return converted_case("zamba2", model, root, stand_in_tokenizer=True)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)
    # transformers' layout: each shared block once, under the first layer calling it (1 and 3),
    # with the adapters of every call of it (calls 0 and 2 of block 0, call 1 of block 1)
    with SafetensorsFile(tmp_path / "export" / "model.safetensors") as ours:
        names = set(ours.names())
    adapters = {n for n in names if "adapter_list" in n}
    assert {n.split(".shared_transformer")[0] for n in names if "shared_transformer" in n} == {
        "model.layers.1",
        "model.layers.3",
    }
    assert len(adapters) == 3 * 8  # 3 calls x (q, k, v, gate_up) x (down, up)
    assert "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.1.weight" in adapters
    assert "model.layers.3.shared_transformer.self_attn.linear_v_adapter_list.1.0.weight" in adapters
    with SafetensorsFile(case.hf_dir / "model.safetensors") as theirs:
        assert set(theirs.names()) == names


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    assert cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())
    assert [layer.mixer for layer in cfg.layer_pattern()] == ["mamba2", "zamba2_hybrid", "mamba2"] + [
        "zamba2_hybrid"
    ] * 2
    assert dict(cfg.layer_stacks()) == {
        "mamba2_only_blocks": (0, 2),
        "zamba2_hybrid_0_blocks": (1,),
        "zamba2_hybrid_1_blocks": (3,),
        "zamba2_hybrid_2_blocks": (4,),
    }
    hybrid = cfg.layer_specs()[4].mixer
    assert (hybrid.block, hybrid.adapter_rank, hybrid.attention_adapters) == (0, 5, True)
    assert (hybrid.attention.head_dim, hybrid.attention.score_scale) == (12, 6**-0.5)
    assert hybrid.mamba2.dt_limit == (0.001, float("inf")) and hybrid.mamba2.n_groups == 2
    assert not cfg.layer_specs()[1].pre_norms and cfg.layer_specs()[0].pre_norms
    tiny = dict(resolve_model_preset({"model": "tiny-zamba2"}, "tiny-zamba2")["model"])
    tiny.pop("compute", None)
    assert ModelConfig.model_validate(tiny) == cfg.model_copy(update={"vocab_size": 512})  # the tiny preset


def test_a_shared_block_is_one_set_of_parameters_that_learns(case):
    """Each shared block's weights are one array (not a copy per calling layer, which training
    would let drift apart), and the loss's gradient reaches them through the hybrid layers."""
    graphdef, state = nnx.split(nnx.merge(graphdef_of(case.cfg, case.compute), case.params))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (1, 5)), jnp.int32)

    def loss(state):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens))[..., 0])

    grads = dict(nnx.to_flat_state(jax.jit(jax.grad(loss))(state)))
    owners = sorted(key[0] for key in grads if key[-1] == "wq_xf")
    assert owners == ["zamba2_shared_0", "zamba2_shared_1"]
    for b in (0, 1):
        assert float(jnp.abs(grads[(f"zamba2_shared_{b}", "wq_xf")][...]).max()) > 0


def test_what_the_family_does_not_run_is_refused_in_one_sentence():
    zamba = {**hf_config().to_dict(), "architectures": ["Zamba2ForCausalLM"]}
    for config, message in (
        ({**zamba, "add_bias_linear": True}, r"add_bias_linear=true is not supported"),
        ({**zamba, "use_long_context": True}, r"use_long_context=true is not supported"),
        ({**zamba, "rms_norm_eps": 1e-6}, r"rms_norm_eps 1e-06 is not supported \(1e-5"),
        ({**zamba, "num_key_value_heads": 1}, r"use_shared_attention_adapter needs num_key_value_heads = "),
        ({**zamba, "layers_block_type": ["mamba"] * 5}, r"layers_block_type has no hybrid layer"),
        ({**zamba, "hidden_act": "relu"}, r"hidden_act 'relu' is not supported"),
        ({**zamba, "num_mem_blocks": 4}, r"num_mem_blocks 4 exceeds the 3 hybrid layers"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            model_config_from_hf(config)
        assert "\n" not in str(refused.value)


def test_one_block_without_attention_adapters_counts_as_transformers():
    """num_mem_blocks 1, adapters on the MLP only, no RoPE, grouped keys: the family reads it,
    counts transformers' parameters and writes the config back as itself."""
    hf = hf_config(num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False, num_key_value_heads=1)
    cfg, _ = model_config_from_hf({**hf.to_dict(), "architectures": ["Zamba2ForCausalLM"]})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    hybrids = [s.mixer for s in cfg.layer_specs() if s.mixer.kind == "zamba2_hybrid"]
    assert {(h.block, h.attention.rope, h.attention.num_kv_heads) for h in hybrids} == {(0, None, 1)}
    again, _ = model_config_from_hf({**model_config_to_hf(cfg), "architectures": ["Zamba2ForCausalLM"]})
    assert again == cfg


def test_the_preset_is_the_published_model():
    """zamba2-7b builds as the transformers model of the same parameter count (on the meta
    device), the published 7.36B, and its config.json reads back as itself."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "zamba2-7b"}, "zamba2-7b")["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert round(cfg.num_params() / 1e9, 2) == 7.36
    again, _ = model_config_from_hf({**hf.to_dict(), "architectures": [hf.architectures[0]]})
    assert again == cfg
