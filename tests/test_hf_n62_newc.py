"""Hugging Face parity of the newest architectures of transformers 5.25, group C: Laguna
(sliding and full layers with a RoPE base and rotary width each, a softplus gate per head,
DeepSeek-V3's sigmoid router with tanh-capped logits beside one shared expert) and Hy4 (GLM-5's
sparse latent attention with sinks, an output gate and its indexer's RoPE on the last
dimensions, over independent hyper-connections and experts with a clamped SwiGLU) and
LongCat-Flash (pairs of latent-attention layers whose experts, zero-computation ones among
them, join the stream a layer later).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-4 with N(0, 0.3^2) weights and a random choosing bias (every expert used, and a
5% change of the routers moving some choices), the export loading cleanly, and the presets'
parameter counts equal to transformers' (meta device).
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
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_fam_moe_2 import (  # noqa: E402
    IMPLEMENTATIONS,
    assert_routing_is_near_its_margins,
    randomise_routing_bias,
    router_weights,
)
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
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

TINY = dict(vocab_size=37, hidden_size=30, intermediate_size=26, max_position_embeddings=64)


def hf_config(name: str):
    t = transformers
    return {
        # sliding, full, sliding layers (the first dense); 6 query heads over 2 key/value heads
        # 12 wide, the full layers rotating 6 of them at base 500, the sliding ones all at 50;
        # 5 experts 13 wide (2 per token, scaled by 1.3, logits capped at 2) and a shared one 11 wide
        "laguna": lambda: t.LagunaConfig(
            **TINY,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=5,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 1.0},
            },
            moe_intermediate_size=13,
            shared_expert_intermediate_size=11,
            num_experts=5,
            num_experts_per_tok=2,
            moe_routed_scaling_factor=1.3,
            moe_router_logit_softcapping=2.0,
        ),
        # a dense layer, then two with 5 experts (2 per token, scaled by 1.3; SwiGLU clamped at
        # 1.5, low enough to clamp) and a shared one; latent attention (6 heads, keys 6 + 4
        # rotary wide, values 7) with sinks and a gate, its indexer (8 heads 8 wide: few ties) choosing 5
        # keys, the last layer reusing the second's choice; 3 residual streams
        "hy_v4": lambda: t.HYV4Config(
            **{**TINY, "intermediate_size": 26},
            moe_intermediate_size=13,
            num_hidden_layers=3,
            num_attention_heads=6,
            q_lora_rank=14,
            kv_lora_rank=10,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=7,
            n_routed_experts=5,
            num_experts_per_tok=2,
            routed_scaling_factor=1.3,
            swiglu_limit=1.5,
            index_topk=5,
            index_head_dim=8,
            index_n_heads=8,
            hc_mult=3,
            hc_magnitude=1.7,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # two pairs of latent-attention layers (6 heads, keys 6 + 4 rotary wide, values 7) with
        # dense MLPs 26 wide; 5 experts 13 wide and 2 zero experts, 2 per token, scaled by 1.3
        "longcat_flash": lambda: t.LongcatFlashConfig(
            vocab_size=37,
            hidden_size=30,
            max_position_embeddings=64,
            num_layers=2,
            num_attention_heads=6,
            ffn_hidden_size=26,
            q_lora_rank=14,
            kv_lora_rank=10,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            head_dim=4,
            v_head_dim=7,
            moe_topk=2,
            n_routed_experts=5,
            zero_expert_num=2,
            expert_ffn_hidden_size=13,
            routed_scaling_factor=1.3,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
    }[name]()


NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""The classes' default token ids lie past the tiny vocabulary."""

CASES = ["laguna", "hy_v4", "longcat_flash"]


def random_hf_model(name: str, seed: int = 0):
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    randomise_routing_bias(model, seed)
    return model


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits(case):
    """Logits to 1e-4; with experts, weights large enough that routing matters: every expert
    is used, unevenly, and a 5% change of the routers moves some choices."""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    if not case.cfg.moe.num_experts:
        return
    routers = router_weights(case.hf_model) + [  # and LongCat-Flash's
        p for n, p in case.hf_model.named_parameters() if n.endswith("router.classifier.weight")
    ]
    assert_routing_is_near_its_margins(case.hf_model, tokens, mask, case.cfg.moe.num_experts, routers)


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    assert cfg.family == case.hf_model.config.model_type
    if case.family == "laguna":
        specs = cfg.layer_specs()
        assert [s.mixer.window for s in specs] == [5, None, 5] and [s.ffn.kind for s in specs] == ["mlp", "moe", "moe"]
        assert [(s.mixer.rope.theta, s.mixer.rope.rotary_dim) for s in specs] == [(50.0, 12), (500.0, 6), (50.0, 12)]
        assert {(s.mixer.head_gate, s.mixer.head_gate_activation, s.mixer.qk_norm) for s in specs} == {
            (True, "softplus", "head")
        }
        moe = specs[1].ffn
        assert (moe.router_softcap, moe.router_scale, moe.shared_dim, moe.router_score) == (2.0, 1.3, 11, "sigmoid")
        # the cap matters: without it the logits move
        tokens, mask = batch()
        capped = hf_logits(case.hf_model, tokens, mask)
        routers = [m for m in case.hf_model.modules() if type(m).__name__ == "LagunaTopKRouter"]
        try:
            for router in routers:
                router.router_logit_softcapping = 0.0
            uncapped = hf_logits(case.hf_model, tokens, mask)
        finally:
            for router in routers:
                router.router_logit_softcapping = 2.0
        assert np.abs(capped - uncapped)[mask.astype(bool)].max() > 0.1
    elif case.family == "hy_v4":
        specs = cfg.layer_specs()
        assert [s.mixer.indexer.shared for s in specs] == [False, False, True]
        assert {(s.mixer.sinks, s.mixer.output_gate, s.mixer.indexer.rope_last) for s in specs} == {(True, True, True)}
        assert {(s.hyper.streams, s.hyper.independent, s.hyper.magnitude) for s in specs} == {(3, True, 1.7)}
        assert specs[0].ffn.swiglu_limit is None and specs[1].ffn.swiglu_limit == 1.5 and not specs[1].ffn.clamp_shared
        assert case.params["blocks"]["attn_hc"]["w_mix_xm"].shape[1:] == (90, 6)  # pre and post of 3 streams
        # the clamp matters: without it the logits move
        tokens, mask = batch()
        clamped = hf_logits(case.hf_model, tokens, mask)
        experts = [m for m in case.hf_model.modules() if type(m).__name__ == "HYV4Experts"]
        try:
            for module in experts:
                module.swiglu_limit = 1e6
            unclamped = hf_logits(case.hf_model, tokens, mask)
        finally:
            for module in experts:
                module.swiglu_limit = 1.5
        assert np.abs(clamped - unclamped)[mask.astype(bool)].max() > 0.1
    elif case.family == "longcat_flash":
        specs = cfg.layer_specs()
        assert cfg.num_layers == 4 and [s.stack for s in specs] == ["blocks", "dense_blocks"] * 2
        assert [s.shortcut_moe is not None for s in specs] == [True, False] * 2
        assert [s.shortcut_close for s in specs] == [False, True] * 2
        moe = specs[0].shortcut_moe
        assert (moe.num_experts, moe.zero_experts, moe.router_scale, moe.router_renormalize) == (5, 2, 1.3, False)
        assert {s.mixer.lora_scale for s in specs} == {True} and specs[0].ffn.dim == 26
        # the zero experts are chosen: some tokens' chosen experts are zero ones
        tokens, mask = batch()
        chosen = []
        routers = [m for m in case.hf_model.modules() if type(m).__name__ == "LongcatFlashTopkRouter"]
        hooks = [r.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for r in routers]
        try:
            hf_logits(case.hf_model, tokens, mask)
        finally:
            for hook in hooks:
                hook.remove()
        assert all(bool((c >= 5).any()) and bool((c < 5).any()) for c in chosen)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def hf_dict(name: str) -> dict:
    """config.json of the case `name` as transformers writes it."""
    config = hf_config(name)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    return {**config.to_dict(), "architectures": [model_class.__name__]}


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    laguna = hf_dict("laguna")
    with pytest.raises(ConfigError, match=r"num_attention_heads_per_layer must give every layer"):
        model_config_from_hf({**laguna, "num_attention_heads_per_layer": [6, 3, 6]})
    with pytest.raises(ConfigError, match=r"gating 'per-element' is not supported"):
        model_config_from_hf({**laguna, "gating": "per-element"})
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
    with pytest.raises(ConfigError, match=r"rope_parameters.sliding_attention: only the default RoPE"):
        model_config_from_hf({**laguna, "rope_parameters": {**laguna["rope_parameters"], "sliding_attention": linear}})


PUBLISHED = {  # preset: the model card's total (billions) and how closely ModelConfig.num_params meets it
    "laguna-xs.2": None,  # transformers' LagunaConfig defaults; no total in its docs
    "hy4-preview": None,  # transformers' HYV4Config defaults; no total in its docs
    "longcat-flash": (560, 0.01),  # LongCat-Flash-Chat's model card: 560B in total
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same trainable parameter count
    (meta device; the choosing biases are frozen parameters there, and not counted)."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == cfg.num_params()
    if PUBLISHED[preset] is not None:
        billions, tolerance = PUBLISHED[preset]
        assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)
