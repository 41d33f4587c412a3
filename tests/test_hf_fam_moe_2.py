"""Hugging Face parity of mixture-of-experts families of transformers' catalogue: dots.llm1
(Qwen3's attention over DeepSeek-V3's router), ERNIE 4.5 MoE (a softmax router with a
choosing bias), Hunyuan MoE (QK norm after RoPE), GLM-4.7-Flash (glm4_moe_lite: latent
attention over DeepSeek-V3's router), K-EXAONE (NoPE global layers), Solar Open (q/k/v
biases, partial RoPE) and AFMoE.

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-4 with N(0, 0.3^2) weights and a random choosing bias, where the routing is near
its margins, and export loading cleanly. The presets are the published models: their
parameter count is transformers' (meta device).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.train.checkpoint import load_params  # noqa: E402
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

# Expert widths unlike the dense one (26), odd where the family allows.
EXPERTS = dict(moe_intermediate_size=13, num_experts_per_tok=2)


def hf_config(name: str):
    t = transformers
    return {
        # 6 experts in 2 groups, each token's 2 from its best group; 2 shared experts, a dense
        # first layer, a window from layer 1 on, renormalised and scaled weights
        "dots1": lambda: t.Dots1Config(
            **COMMON,
            **EXPERTS,
            n_routed_experts=6,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            sliding_window=5,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        # 6 experts in 3 groups, each token's 2 from its 2 best; a window on layers 0 and 2
        # (RoPE there, NoPE on the global layer 1), the dense layer between two expert layers
        "exaone_moe": lambda: t.ExaoneMoeConfig(
            **COMMON,
            **EXPERTS,
            num_experts=6,
            n_group=3,
            topk_group=2,
            first_k_dense_replace=0,
            mlp_layer_types=["sparse", "dense", "sparse"],
            sliding_window=5,
            sliding_window_pattern=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            bos_token_id=None,
            eos_token_id=None,
        ),
        # 7 experts, 3 per token, 2 shared; q/k/v biases, no dense layer
        "solar_open": lambda: t.SolarOpenConfig(
            **{k: v for k, v in COMMON.items() if k != "intermediate_size"},
            moe_intermediate_size=13,
            num_experts_per_tok=3,
            n_routed_experts=7,
            n_shared_experts=2,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        # 6 experts, 2 per token, 2 shared, in layers 0 and 1 (moe_layer_end_index 1), layer 2
        # dense; tied embeddings (its default), RoPE on adjacent pairs
        "ernie4_5_moe": lambda: t.Ernie4_5_MoeConfig(
            **COMMON,
            moe_intermediate_size=13,
            moe_num_experts=6,
            moe_k=2,
            moe_num_shared_experts=2,
            moe_layer_start_index=0,
            moe_layer_end_index=1,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        # 5 experts (per-layer lists, as published), 2 per token, a shared MLP; QK norm after
        # RoPE; Hunyuan's NTK-alpha RoPE (the base stretched to 500 * 1000 ** (8 / 6))
        "hunyuan_v1_moe": lambda: t.HunYuanMoEV1Config(
            **COMMON,
            num_experts=5,
            moe_topk=[2, 2, 2],
            rope_parameters=HUNYUAN_ROPE,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            eod_token_id=None,
            sep_token_id=None,
        ),
        # latent attention (compressed queries, odd widths) over 8 experts in 2 groups, each
        # token's 3 from its best group, a shared expert, a dense first layer
        "glm4_moe_lite": lambda: t.Glm4MoeLiteConfig(
            # latent attention: as many key-value heads as heads; head_dim is the rotary width
            **{**COMMON, "num_key_value_heads": 6, "head_dim": 4},
            moe_intermediate_size=13,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            kv_lora_rank=10,
            q_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=6,
            v_head_dim=7,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            bos_token_id=None,
            eos_token_id=None,
        ),
        # a dense first layer, then 6 experts (2 per token, scaled by 1.7) and 2 shared; a window
        # with RoPE on layers 0 and 2, NoPE on the global layer 1; the attention's output gate,
        # pre- and post-norms, muP's scaled embeddings
        "afmoe": lambda: t.AfmoeConfig(
            **COMMON,
            **EXPERTS,
            num_experts=6,
            num_shared_experts=2,
            route_scale=1.7,
            num_dense_layers=1,
            sliding_window=5,
            global_attn_every_n_layers=2,
            mup_enabled=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    }[name]()


HUNYUAN_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 500.0}
CASES = ["dots1", "ernie4_5_moe", "hunyuan_v1_moe", "glm4_moe_lite", "exaone_moe", "solar_open", "afmoe"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""
BIASES = ("e_score_correction_bias", "expert_bias")
"""The choosing biases' names: buffers (DeepSeek-V3's) or frozen parameters (ERNIE's, AFMoE's)."""


def randomise_routing_bias(model, seed: int = 0) -> None:
    """The choosing bias (random_causal_lm draws parameters only, N(0, 0.3^2)): N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(BIASES):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))


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


def chosen_experts(model, tokens, mask) -> list[torch.Tensor]:
    """Each expert layer's chosen experts per token (sorted), as transformers routes them."""
    chosen, hooks = [], []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            hooks.append(module.register_forward_hook(lambda m, args, out: chosen.append(args[1].sort(-1).values)))
    try:
        hf_logits(model, tokens, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


def router_weights(model) -> list[torch.Tensor]:
    """The routers' weight matrices (mlp.gate, mlp.gate.wg, mlp.router.gate)."""
    return [
        p for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", ".wg.weight", "router.gate.weight"))
    ]


def assert_routing_is_near_its_margins(model, tokens, mask, num_experts: int, routers=None) -> None:
    """Every expert of the first expert layer is chosen, unevenly, and a 5% change of the
    routers (`routers`, else router_weights) moves some choices: matching logits then means
    matching routing."""
    chosen = chosen_experts(model, tokens, mask)
    loads = torch.bincount(chosen[0].flatten(), minlength=num_experts)
    assert loads.min() > 0 and loads.max() > loads.min()
    routers = router_weights(model) if routers is None else routers
    assert routers
    saved = [w.detach().clone() for w in routers]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in routers:
            w.mul_(1 + 0.05 * torch.randn(w.shape, generator=generator))
    try:
        moved = chosen_experts(model, tokens, mask)
    finally:
        with torch.no_grad():
            for w, s in zip(routers, saved, strict=True):
                w.copy_(s)
    assert sum(int((a != b).any(-1).sum()) for a, b in zip(chosen, moved, strict=True)) > 0


def test_converted_model_matches_transformers_and_the_routing_is_near_its_margins(case):
    """Logits to 1e-4 with weights large enough that routing matters: every expert is used,
    unevenly, and a 5% change of the routers moves some choices (so matching logits means
    matching routing)."""
    assert case.cfg.family == case.hf_model.config.model_type
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    assert_routing_is_near_its_margins(case.hf_model, tokens, mask, case.cfg.moe.num_experts)


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    layers = cfg.layer_pattern()
    if case.family == "dots1":
        assert [x.ffn for x in layers] == ["mlp", "moe", "moe"] and cfg.layer_is_local() == [False, True, True]
        assert (cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale, cfg.moe.num_shared_experts) == (
            2,
            1,
            1.5,
            2,
        )
        assert cfg.attention.qk_norm and cfg.moe.router_bias and cfg.moe.router_renormalize and cfg.moe.expert_dim == 13
    elif case.family == "exaone_moe":
        assert [x.ffn for x in layers] == ["moe", "mlp", "moe"] and cfg.moe.first_dense_layers == 0
        assert [x.local for x in layers] == [x.rope for x in layers] == [True, False, True]
        assert (cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale) == (
            3,
            2,
            2.5,
        ) and cfg.attention.qk_norm
    elif case.family == "ernie4_5_moe":
        assert [x.ffn for x in layers] == ["moe", "moe", "mlp"] and cfg.ffn_pattern is not None
        assert cfg.moe.router_score == "softmax" and cfg.moe.router_bias and cfg.rope.interleave and cfg.tie_embeddings
        assert case.params["blocks"]["mlp"]["b_router_e"].shape == (2, 6)  # HF's (1, 6) per layer
    elif case.family == "hunyuan_v1_moe":
        assert (
            cfg.attention.qk_norm
            and cfg.attention.qk_norm_after_rope
            and cfg.moe.router_score == "softmax"
            and not cfg.moe.router_bias
        )
        assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.num_shared_experts, cfg.shared_mlp_dim) == (
            5,
            2,
            1,
            26,
        )
        assert cfg.rope.theta == 500.0 * 1000.0 ** (8 / 6) and cfg.rope.scaling is None
        inv_freq = case.hf_model.model.rotary_emb.inv_freq.numpy()  # transformers' ntk_alpha frequencies
        np.testing.assert_allclose(inv_freq, cfg.rope.theta ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
    elif case.family == "glm4_moe_lite":
        assert [x.ffn for x in layers] == ["mlp", "moe", "moe"] and [x.mixer for x in layers] == ["mla"] * 3
        assert (
            cfg.mla.kv_lora_rank,
            cfg.mla.q_lora_rank,
            cfg.mla.rope_head_dim,
            cfg.attention.head_dim,
            cfg.value_head_dim,
        ) == (
            10,
            12,
            4,
            10,
            7,
        )
        assert (cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale, cfg.mtp_layers) == (2, 1, 1.8, 0)
        assert cfg.rope.interleave and cfg.moe.router_bias and cfg.moe.router_score == "sigmoid"
    elif case.family == "afmoe":
        assert [x.ffn for x in layers] == ["mlp", "moe", "moe"] and [x.local for x in layers] == [True, False, True]
        assert [x.rope for x in layers] == [True, False, True] and cfg.attention.output_gate and cfg.block.post_norms
        assert (
            cfg.embedding.scale
            and cfg.moe.router_scale == 1.7
            and cfg.moe.router_bias
            and cfg.moe.router_score == "sigmoid"
        )
        assert case.params["blocks"]["attn"]["wq_dnh"].shape == (2, 30, 6, 16)  # each head's query and gate
    else:  # solar_open
        assert [x.ffn for x in layers] == ["moe"] * 3 and cfg.attention.qkv_bias and not cfg.attention.qk_norm
        assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.num_shared_experts, cfg.mlp.dim) == (
            7,
            3,
            2,
            13,
        )


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    """test_hf_parity's check; Hunyuan's NTK-alpha RoPE is written as the plain RoPE of the
    stretched base (the same frequencies, checked above), the one key that differs."""
    if case.family == "hunyuan_v1_moe":
        source = json.loads((case.hf_dir / "config.json").read_text())
        assert source["rope_parameters"] == HUNYUAN_ROPE
        plain = {"rope_type": "default", "rope_theta": case.cfg.rope.theta}
        (tmp_path / "source").mkdir()
        (tmp_path / "source" / "config.json").write_text(json.dumps({**source, "rope_parameters": plain}))
        case = dataclasses.replace(case, hf_dir=tmp_path / "source")
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


MTP_WEIGHTS = {  # a tensor of the multi-token-prediction module published checkpoints carry
    "ernie4_5_moe": "model.mtp_block.0.input_layernorm.weight",
    "glm4_moe_lite": "model.layers.3.eh_proj.weight",  # the layer after the last
    "exaone_moe": "mtp.fc.weight",
}


def test_the_checkpoints_multi_token_prediction_weights_are_skipped(case, tmp_path):
    """transformers skips them (_keys_to_ignore_on_load_unexpected); conversion does too, and
    the model it writes is the one without them."""
    if case.family not in MTP_WEIGHTS:
        pytest.skip("no multi-token-prediction weights in this family's checkpoints")
    from safetensors.numpy import load_file, save_file

    shutil.copytree(case.hf_dir, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors[MTP_WEIGHTS[case.family]] = np.ones((case.cfg.d_model, 2 * case.cfg.d_model), np.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg
    for a, b in zip(jax.tree.leaves(case.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    dots = {**hf_config("dots1").to_dict(), "architectures": ["Dots1ForCausalLM"]}
    with pytest.raises(ConfigError, match=r"attention_bias=true is not supported"):
        model_config_from_hf({**dots, "attention_bias": True})
    with pytest.raises(ConfigError, match=r"layer_types must be full_attention layers then sliding_attention"):
        model_config_from_hf({**dots, "layer_types": ["sliding_attention", "full_attention", "full_attention"]})
    ernie = {**hf_config("ernie4_5_moe").to_dict(), "architectures": ["Ernie4_5_MoeForCausalLM"]}
    with pytest.raises(ConfigError, match=r"use_bias=true is not supported"):
        model_config_from_hf({**ernie, "use_bias": True})
    hunyuan = {**hf_config("hunyuan_v1_moe").to_dict(), "architectures": ["HunYuanMoEV1ForCausalLM"]}
    with pytest.raises(ConfigError, match=r"moe_topk must be the same for every layer, got \[2, 3, 2\]"):
        model_config_from_hf({**hunyuan, "moe_topk": [2, 3, 2]})
    afmoe = {**hf_config("afmoe").to_dict(), "architectures": ["AfmoeForCausalLM"]}
    with pytest.raises(ConfigError, match=r"attention_bias=true is not supported"):
        model_config_from_hf({**afmoe, "attention_bias": True})
    solar = {**hf_config("solar_open").to_dict(), "architectures": ["SolarOpenForCausalLM"]}
    half = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}  # transformers fails on it
    with pytest.raises(ConfigError, match=r"partial_rotary_factor is not supported"):
        model_config_from_hf({**solar, "rope_parameters": half})


def test_lora_targets_what_the_engine_holds_as_peft_names_it():
    """AFMoE's q_proj is half of the engine's query-and-gate weight: LoRA refuses it in one
    sentence (all-linear leaves it out); the other attention projections are PEFT's."""
    from engine.models.config import LoraConfig

    afmoe, _ = model_config_from_hf({**hf_config("afmoe").to_dict(), "architectures": ["AfmoeForCausalLM"]})
    assert LoraConfig(target_modules="all-linear").targets(afmoe) == ("k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match=r"family 'afmoe' stores q_proj in a layout LoRA does not adapt"):
        LoraConfig(target_modules=["q_proj"]).targets(afmoe)


PUBLISHED = {  # preset: the model card's total (billions) and how closely ModelConfig.num_params meets it
    "dots-llm1": (142, 0.01),
    "trinity-mini": (26, 0.01),
    "glm-4.7-flash": (30, 0.01),
    "hunyuan-a13b": (80, 0.01),
    "ernie-4.5-21b-a3b": (21.8, 0.01),
    "k-exaone-236b-a23b": (236, 0.01),
    "solar-open-100b": (102.6, 0.01),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same trainable parameter count (on
    the meta device; ERNIE's and AFMoE's choosing biases are frozen parameters there, buffers
    elsewhere, never counted) and of the size its model card gives."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)
