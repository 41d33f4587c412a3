"""Hugging Face parity of Qwen2-MoE (softmax experts and a gated shared expert, q/k/v biases,
dense and windowed layers), OLMoE and FlexOlmo (QK norm over all heads; FlexOlmo with OLMo 2's
output norms), and Granite 3.0's experts: GraniteMoe, GraniteMoeShared (a shared MLP) and
GraniteMoeSWA (sinks, sliding windows, a RoPE base per layer and NoPE layers).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-4 with N(0, 0.3^2) weights and the routers x3 (every expert used, no top-k near
a tie that float32 rounding could flip), the export loading cleanly in transformers, and each
published preset of transformers' parameter count.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.families import get_family  # noqa: E402
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
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5)
"""Granite's multipliers, none at its 1.0 default."""


def hf_config(name: str):
    t = transformers
    return {
        # 5 experts of 14, top-2 unrenormalised, a shared expert of 18; layer 1 dense (26),
        # layer 0 sliding (transformers' rule: even layers below max_window_layers 1)
        "qwen2_moe": lambda: t.Qwen2MoeConfig(
            **COMMON,
            **NO_TOKENS,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=14,
            shared_expert_intermediate_size=18,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=test_hf_parity.WINDOW,
            max_window_layers=1,
            rope_theta=500.0,
        ),
        # head_dim is hidden_size / heads (its q_norm is hidden_size wide): 36 / 6; 5 experts of 14, top 3
        "olmoe": lambda: t.OlmoeConfig(
            **{**COMMON, "hidden_size": 36, "head_dim": 6, "intermediate_size": 14},
            **NO_TOKENS,
            num_experts=5,
            num_experts_per_tok=3,
            rope_theta=500.0,
        ),
        # 5 experts of 26, top 2 renormalised
        "flex_olmo": lambda: t.FlexOlmoConfig(
            **COMMON, **NO_TOKENS, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=500.0
        ),
        "granitemoe": lambda: t.GraniteMoeConfig(
            **COMMON, **NO_TOKENS, **GRANITE, num_local_experts=5, num_experts_per_tok=2, tie_word_embeddings=True
        ),
        "granitemoeshared": lambda: t.GraniteMoeSharedConfig(
            **COMMON, **NO_TOKENS, **GRANITE, num_local_experts=5, num_experts_per_tok=3, shared_intermediate_size=18
        ),
        # layers global, local, local, local (transformers' default); layer 1 NoPE, the local
        # layers' base 2000, the global one's 500
        "granitemoe_swa": lambda: t.GraniteMoeSWAConfig(
            **{**COMMON, "num_hidden_layers": 4},
            **NO_TOKENS,
            **GRANITE,
            num_local_experts=5,
            num_experts_per_tok=2,
            shared_intermediate_size=18,
            sliding_window=test_hf_parity.WINDOW,
            rope_theta=500.0,
            layer_rope_theta=[500.0, 0, 2000.0, 2000.0],
        ),
    }[name]()


CASES = ["qwen2_moe", "olmoe", "flex_olmo", "granitemoe", "granitemoeshared", "granitemoe_swa"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""


def random_hf_model(name: str, seed: int = 0):
    """random_causal_lm's weights, the routers x3 (their logits spread, so no top-k is a near
    tie) and the sinks N(0, 1) (zero at transformers' initialisation)."""
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith(("mlp.gate.weight", "router.weight", "router.layer.weight")):
                p.mul_(3.0)
            elif param_name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    return converted_case(name, model, root)


def chosen_experts(model, tokens, mask) -> list[torch.Tensor]:
    """Each expert layer's chosen experts per token, as transformers routes them."""
    chosen, hooks = [], []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            hooks.append(module.register_forward_hook(lambda m, args, out: chosen.append(args[1])))
    try:
        hf_logits(model, tokens, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


def test_converted_model_matches_transformers_logits_with_every_expert_used(case):
    assert case.cfg.family == case.family
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    for chosen in chosen_experts(case.hf_model, tokens, mask):
        loads = torch.bincount(chosen.flatten(), minlength=case.cfg.moe.num_experts)
        assert loads.min() > 0 and loads.max() > loads.min()


def test_the_family_reads_what_the_config_says(case):
    cfg, layers = case.cfg, case.cfg.layer_pattern()
    if case.family == "qwen2_moe":
        assert [x.ffn for x in layers] == ["moe", "mlp", "moe"] and cfg.layer_is_local() == [True, False, False]
        assert (cfg.attention.qkv_bias, cfg.moe.shared_gate, cfg.moe.router_renormalize) == (True, True, False)
        assert (cfg.moe_mlp_dim, cfg.shared_mlp_dim, cfg.mlp.dim) == (14, 18, 26)
    elif case.family in ("olmoe", "flex_olmo"):
        flex = case.family == "flex_olmo"
        assert cfg.attention.qk_norm_across_heads and cfg.moe.router_renormalize == flex and cfg.block.pre_norms != flex
        # one scale per head and dimension: HF's (heads * head_dim,)
        assert case.params["blocks"]["attn"]["q_norm"]["scale"].shape == (3, 6, cfg.attention.head_dim)
    else:
        assert (cfg.embedding.multiplier, cfg.block.residual_multiplier, cfg.head.divisor) == (3.0, 0.6, 2.5)
        assert cfg.attention.scale == 0.2 and cfg.moe.router_renormalize and not cfg.moe.shared_gate
        assert cfg.moe.num_shared_experts == (case.family != "granitemoe") and cfg.tie_embeddings == (
            case.family == "granitemoe"
        )
        if case.family == "granitemoe_swa":
            assert cfg.attention.sinks and cfg.layer_is_local() == [False, True, True, True]
            assert [x.rope for x in layers] == [True, False, True, True]
            assert (cfg.rope.theta, cfg.rope.local_theta) == (500.0, 2000.0)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    def refused(name: str, **changes) -> str:
        hf = {**hf_config(name).to_dict(), "architectures": [get_family(name).architecture], **changes}
        with pytest.raises(ConfigError) as error:
            model_config_from_hf(hf)
        message = str(error.value)
        assert "\n" not in message, message
        return message

    assert "clip_qkv=8.0 is not supported" in refused("olmoe", clip_qkv=8.0)
    assert "head_dim 8 x num_attention_heads must be hidden_size (36)" in refused("olmoe", head_dim=8)
    assert "no layer has experts" in refused("qwen2_moe", mlp_only_layers=[0, 1, 2])
    assert "shared_expert_intermediate_size must be > 0" in refused("qwen2_moe", shared_expert_intermediate_size=0)
    mixed = refused("granitemoe_swa", layer_rope_theta=[500.0, 1000.0, 2000.0, 2000.0])
    assert "layer_rope_theta [500.0, 1000.0, 2000.0, 2000.0] is not supported" in mixed
    assert "must give 4 RoPE bases" in refused("granitemoe_swa", layer_rope_theta=[500.0])
    assert "must give 4 RoPE bases" in refused("granitemoe_swa", layer_rope_theta=500.0)


PUBLISHED = {  # the model cards' totals (billions) and how closely ModelConfig.num_params meets them
    "qwen1.5-moe-a2.7b": (14.3, 0.005),
    "qwen2-57b-a14b": (57.4, 0.001),
    "olmoe-1b-7b": (6.9, 0.005),
    "flexolmo-7x7b-1t": (33, 0.01),  # 33.27B counted
    "granite-3.0-1b-a400m": (1.3, 0.03),  # 1.335B counted
    "granite-3.0-3b-a800m": (3.3, 0.02),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device) and of the size its model card gives."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)


PUBLISHED_CONFIGS = {  # config.json as the checkpoints publish it (transformers 4 keys, no layer_types)
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "granite-3.0-1b-a400m": {
        "architectures": ["GraniteMoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_multiplier": 0.015625,
        "embedding_multiplier": 12.0,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "logits_scaling": 6.0,
        "max_position_embeddings": 4096,
        "model_type": "granitemoe",
        "num_attention_heads": 16,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "clip_qkv": None,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 50304,
    },
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_CONFIGS))
def test_a_published_config_json_reads_as_its_preset(preset):
    tree = dict(resolve_model_preset({"model": preset}, preset)["model"])
    tree.pop("compute", None)
    cfg, _ = model_config_from_hf(PUBLISHED_CONFIGS[preset])
    assert cfg == ModelConfig.model_validate(tree)
