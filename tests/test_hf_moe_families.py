"""Hugging Face parity of the mixture-of-experts families added by issue 50: MiniMax-M2 (QK
norm over all heads, RoPE on part of each head, a sigmoid router with a choosing bias),
DeepSeek-V2 (latent attention, a softmax router, group-limited top-k whose groups are scored
by their best expert) and V2-Lite (plain top-k, direct queries), and Kimi K2 (DeepSeek-V3's
architecture at its own hyper-parameters: one expert group, routed_scaling_factor 2.827,
YaRN with beta 1/1).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-5 at transformers' initialisation and to 1e-4 with N(0, 0.3^2) weights (and a
random routing bias) where the routing is near its margins, export loading cleanly, and a
training step whose loss is transformers'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.models.params import graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

# DeepSeek's latent attention: as many key-value heads as query heads, odd widths.
MLA = dict(
    num_key_value_heads=6,
    head_dim=4,  # transformers' MLA configs: the rotary width
    kv_lora_rank=10,
    qk_rope_head_dim=4,
    qk_nope_head_dim=6,
    v_head_dim=7,
    moe_intermediate_size=14,
    first_k_dense_replace=1,
)
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(name: str):
    t = transformers
    return {
        # 5 experts, top-2, as wide as intermediate_size; RoPE on half of each 8-wide head
        "minimax_m2": lambda: t.MiniMaxM2Config(
            **COMMON,
            num_local_experts=5,
            num_experts_per_tok=2,
            rotary_dim=4,
            rope_theta=500.0,
            bos_token_id=None,
            eos_token_id=None,
        ),
        # 6 experts in 3 groups, each token's 2 from its 2 groups of best single expert;
        # compressed queries, 2 shared experts, scaled weights, YaRN with mscale_all_dim
        "deepseek_v2": lambda: t.DeepseekV2Config(
            **{**COMMON, **MLA},
            q_lora_rank=12,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=3,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
            bos_token_id=None,
            eos_token_id=None,
        ),
        # V2-Lite's shape: direct queries, plain top-k over 7 experts, no groups
        "deepseek_v2_lite": lambda: t.DeepseekV2Config(
            **{**COMMON, **MLA},
            q_lora_rank=None,
            n_routed_experts=7,
            num_experts_per_tok=3,
            n_shared_experts=1,
            rope_theta=500.0,
            bos_token_id=None,
            eos_token_id=None,
        ),
        # Kimi K2 scaled down: 384 experts / 8 per token -> 12 / 4 in one group, one shared
        # expert, a dense first layer, routed_scaling_factor 2.827, YaRN beta_fast 1, mscale 1/1
        "kimi_k2": lambda: t.DeepseekV3Config(
            **{**COMMON, **MLA},
            q_lora_rank=12,
            n_routed_experts=12,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            num_nextn_predict_layers=0,  # K2 publishes none
            rope_interleave=True,
            # (K2's beta_slow 1.0 is transformers' default, which export leaves out)
            rope_parameters={**YARN, "beta_fast": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            bos_token_id=None,
            eos_token_id=None,
        ),
    }[name]()


CASES = ["minimax_m2", "deepseek_v2", "deepseek_v2_lite", "kimi_k2"]
FAMILY = {"minimax_m2": "minimax_m2", "deepseek_v2": "deepseek_v2", "deepseek_v2_lite": "deepseek_v2"}
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""


def randomise_routing_bias(model, seed: int = 0) -> None:
    """The choosing bias is a buffer (random_causal_lm draws parameters only): N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def random_hf_model(name: str, seed: int = 0):
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    randomise_routing_bias(model, seed)
    return model


def converted(model, root) -> tuple:
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return cfg, compute, params


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    cfg, compute, params = converted(model, root)
    return Case(name, model, root / "hf", root / "converted", cfg, compute, params)


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


def test_converted_model_matches_transformers_and_the_routing_is_near_its_margins(case):
    """Logits to 1e-4 with weights large enough that routing matters: every expert is used,
    unevenly, and a 5% change of the routers moves some choices (so matching logits means
    matching routing)."""
    assert case.cfg.family == FAMILY.get(case.family, "deepseek_v3")
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    chosen = chosen_experts(case.hf_model, tokens, mask)
    loads = torch.bincount(chosen[0].flatten(), minlength=case.cfg.moe.num_experts)
    assert loads.min() > 0 and loads.max() > loads.min()
    routers = [p for n, p in case.hf_model.named_parameters() if n.endswith(".gate.weight")]
    saved = [w.detach().clone() for w in routers]
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in routers:
            w.mul_(1 + 0.05 * torch.randn(w.shape, generator=generator))
    try:
        moved = chosen_experts(case.hf_model, tokens, mask)
    finally:
        with torch.no_grad():
            for w, s in zip(routers, saved, strict=True):
                w.copy_(s)
    assert sum(int((a != b).any(-1).sum()) for a, b in zip(chosen, moved, strict=True)) > 0


@pytest.mark.parametrize("name", CASES)
def test_converted_model_at_initialisation_scale_matches_transformers_to_1e5(name, tmp_path):
    """transformers' own initialisation (std initializer_range), no weight scaled."""
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), **IMPLEMENTATIONS).float().eval()
    cfg, compute, params = converted(model, tmp_path)
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(cfg, compute, params, tokens, mask)
    ref = hf_logits(model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{name} at init scale: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.3f})")
    assert delta <= 1e-5 and np.abs(ref[valid]).max() > 1e-3


def test_the_family_reads_what_the_config_says(case):
    cfg, layers = case.cfg, case.cfg.layer_pattern()
    if case.family == "minimax_m2":
        assert (
            cfg.rope.rotary_dim == 4
            and cfg.attention.qk_norm_across_heads
            and cfg.moe.router_bias
            and cfg.moe.router_renormalize
        )
        assert case.params["blocks"]["attn"]["q_norm"]["scale"].shape == (3, 6, 8)  # HF's (48,) per layer
        assert case.params["blocks"]["attn"]["k_norm"]["scale"].shape == (3, 2, 8)
    elif case.family.startswith("deepseek_v2"):
        assert cfg.moe.router_score == "softmax" and not cfg.moe.router_bias and not cfg.moe.router_renormalize
        assert cfg.rope.interleave and [x.ffn for x in layers] == ["mlp", "moe", "moe"]
        assert "b_router_e" not in case.params["blocks"]["mlp"]
        grouped = case.family == "deepseek_v2"
        assert (cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale) == (
            (3, 2, 1.5) if grouped else (1, 1, 1.0)
        )
        assert (cfg.mla.q_lora_rank is None) == (not grouped) and cfg.moe.router_group_score == "max"
    else:  # kimi_k2
        assert (cfg.moe.router_groups, cfg.moe.router_scale, cfg.moe.num_experts, cfg.moe.experts_per_token) == (
            1,
            2.827,
            12,
            4,
        )
        assert (
            cfg.rope.scaling.beta_fast == cfg.rope.scaling.beta_slow == 1.0
            and cfg.attention.num_heads == cfg.attention.num_kv_heads
        )


def test_group_limited_routing_scores_a_group_by_its_best_expert():
    """DeepSeek-V2's group_limited_greedy: with groups {0, 1} and {2, 3}, a token whose best
    expert is in the first group but whose second group has the larger top-2 sum is routed
    into the first (DeepSeek-V3's rule would pick the second)."""
    from engine.models.moe import route

    scores = np.log(np.array([[0.4, 0.01, 0.3, 0.29]], np.float32))  # softmax gives these back
    _, by_max = route(jnp.asarray(scores), None, 1, "softmax", False, groups=2, group_top=1, group_score="max")
    _, by_sum = route(jnp.asarray(scores), None, 1, "softmax", False, groups=2, group_top=1)
    assert int(by_max[0, 0]) == 0 and int(by_sum[0, 0]) in (2, 3)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path, monkeypatch):
    """test_hf_parity's check; MiniMax-M2's export also writes the published `rotary_dim`,
    `scoring_func` and `use_routing_bias` (vLLM's MiniMax-M2 reads the last two)."""
    older = test_hf_parity.OLDER_KEYS | {"rotary_dim", "scoring_func", "use_routing_bias"}
    monkeypatch.setattr(test_hf_parity, "OLDER_KEYS", older)
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_a_training_step_has_transformers_loss_and_moves_every_parameter(case):
    """The training loss (next-token cross entropy, its router losses apart) is transformers'
    loss on the same rows; every parameter gets a finite gradient, none all zero (the
    choosing bias's is its layer's load imbalance), and one SGD step lowers the loss."""
    test_hf_parity.assert_training_step_matches(case, 0.05)


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    v2 = {**hf_config("deepseek_v2").to_dict(), "architectures": ["DeepseekV2ForCausalLM"]}
    for key, value, message in (
        ("topk_method", "noaux_tc", r"topk_method 'noaux_tc' is not supported"),
        ("norm_topk_prob", True, r"norm_topk_prob=True is not supported \(DeepseekV2ForCausalLM runs"),
        ("moe_layer_freq", 2, r"moe_layer_freq=2 is not supported"),
        ("attention_bias", True, r"attention_bias=true is not supported"),
    ):
        with pytest.raises(ConfigError, match=message):
            model_config_from_hf({**v2, key: value})
    # more experts per token than the chosen groups hold: one line naming both keys (was pydantic's dump)
    with pytest.raises(ConfigError) as refused:
        model_config_from_hf({**v2, "num_experts_per_tok": 3, "topk_group": 1})
    assert "\n" not in str(refused.value) and "num_experts_per_tok" in str(refused.value), str(refused.value)
    assert "topk_group" in str(refused.value) and "pydantic" not in str(refused.value)
    m2 = {**hf_config("minimax_m2").to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}
    for key, value in (("scoring_func", "softmax"), ("use_qk_norm", False), ("shared_intermediate_size", 64)):
        with pytest.raises(ConfigError, match=rf"{key}={value!r} is not supported \(MiniMaxM2ForCausalLM runs"):
            model_config_from_hf({**m2, key: value})
    # the published file's keys: rotary_dim at the top level, no rope_parameters
    published = {k: v for k, v in m2.items() if k != "rope_parameters"} | {"rotary_dim": 4, "rope_theta": 5e6}
    cfg, _ = model_config_from_hf({**published, "use_qk_norm": True, "scoring_func": "sigmoid"})
    assert cfg.rope.rotary_dim == 4 and cfg.rope.theta == 5e6


PUBLISHED = {  # the model cards' totals (billions) and how closely ModelConfig.num_params meets them
    "minimax-m2": (230, 0.01),
    "deepseek-v2": (236, 0.002),
    "deepseek-v2-lite": (15.7, 0.001),
    "kimi-k2": (1000, 0.03),  # "1T"; 1,026.4B counted
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
    tiny = "tiny-" + ("deepseek-v2" if preset.startswith("deepseek") else preset)
    small = ModelConfig.model_validate(resolve_model_preset({"model": tiny}, tiny)["model"])
    assert small.family == cfg.family and small.layer_stacks()[0][0] == cfg.layer_stacks()[0][0]


# --------------------------------------------------------------------------- multi-token prediction


def mtp_hf_config(name: str, layers: int = 3, mtp: int = 1):
    """DeepSeek-V3 (Kimi K2's shape above) and GLM-4.5 (test_hf_patterns' tiny case) with one
    multi-token-prediction layer, or `layers` decoder layers."""
    if name == "deepseek_v3":
        config = hf_config("kimi_k2")
        config.num_nextn_predict_layers = mtp
    else:
        config = transformers.Glm4MoeConfig(
            **{**COMMON, "num_hidden_layers": layers},
            n_routed_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=14,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            attention_bias=True,
            use_qk_norm=True,
            num_mtp_layers=mtp,
            rope_theta=500.0,
            bos_token_id=None,
            eos_token_id=None,
        )
    config.num_hidden_layers = layers
    return config


def with_mtp_layer(name: str, root):
    """A checkpoint as DeepSeek-V3 and GLM-4.5 publish them: the model's tensors (what
    transformers saves) plus, as `model.layers.{L}.`, a multi-token-prediction layer (a
    decoder layer with experts, random; its enorm, hnorm, eh_proj and shared_head.norm; copies
    of the embedding and head). Returns (the main model, transformers' MtpModel loaded from it
    by its own weight mapping)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    main = random_causal_lm(mtp_hf_config(name), 0, **IMPLEMENTATIONS)
    randomise_routing_bias(main)
    main.save_pretrained(root)
    donor = random_causal_lm(mtp_hf_config(name, layers=4, mtp=0), 1, **IMPLEMENTATIONS)
    randomise_routing_bias(donor, 1)
    donor.save_pretrained(root / "donor")
    tensors = load_file(root / "model.safetensors")
    layer = "model.layers.3."
    tensors |= {k: v for k, v in load_file(root / "donor" / "model.safetensors").items() if k.startswith(layer)}
    generator = torch.Generator().manual_seed(2)
    d = main.config.hidden_size
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{layer}{norm}.weight"] = 1 + 0.3 * torch.randn(d, generator=generator)
    tensors[f"{layer}eh_proj.weight"] = 0.3 * torch.randn(d, 2 * d, generator=generator)
    tensors[f"{layer}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{layer}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    main.config._name_or_path = str(root)
    main.config.dtype = torch.float32  # save_pretrained left its name, which MtpModel cannot take
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3.*"]  # the class names layer 61 (46, 92)
    return main, MtpModel.from_pretrained(main).float().eval()


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def mtp_case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}_mtp")
    main, mtp = with_mtp_layer(request.param, root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(name=request.param, main=main, mtp=mtp, root=root, cfg=cfg, compute=compute, params=params)


def test_the_multi_token_prediction_layer_converts_and_predicts_as_transformers_mtp_model(mtp_case):
    """The converted MTP layer's logits (token i + 2 from the final hidden state at i and token
    i + 1) are transformers' MtpModel's; the main model's are unchanged by it."""
    from flax import nnx

    from engine.models.mtp import mtp_logits

    cfg, main, mtp = mtp_case["cfg"], mtp_case["main"], mtp_case["mtp"]
    assert (
        cfg.mtp_layers == 1
        and "mtp_blocks" in mtp_case["params"]
        and "w_router_de" in str(jax.tree_util.tree_structure(mtp_case["params"]["mtp_blocks"]))
    )
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
    positions = torch.arange(20)[None].expand(2, 20)
    with torch.no_grad():
        out = main(torch.tensor(tokens), output_hidden_states=True)
        hidden = out.hidden_states[-1]
        ref = mtp._project_to_logits(
            mtp.forward_layer(0, hidden[:, :-1], positions[:, 1:], None, input_ids=torch.tensor(tokens[:, 1:]))
        ).numpy()
    model = nnx.merge(graphdef_of(cfg, mtp_case["compute"]), mtp_case["params"])
    ours_hidden, _ = model.hidden_states(jnp.asarray(tokens))
    ours, stats = mtp_logits(model, ours_hidden, jnp.asarray(tokens))
    delta = float(np.abs(np.asarray(ours)[:, :-1] - ref).max())
    print(f"\n{mtp_case['name']} MTP: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref).max() > 0.5 and stats is not None
    main_delta = np.abs(np.asarray(model(jnp.asarray(tokens))) - out.logits.numpy()).max()
    assert main_delta <= 1e-4


def test_a_checkpoint_with_its_mtp_layer_exports_bitwise(mtp_case, tmp_path):
    """HF -> checkpoint -> HF: every tensor of the source, the MTP layer's included, comes back
    with the same bytes (and nothing else), config.json says the layer is there, and export ->
    convert is bitwise; a checkpoint whose config names the layer but whose weights lack it
    (transformers' save_pretrained) converts without it."""
    import json

    from safetensors.numpy import load_file

    export_hf(mtp_case["root"] / "converted" / "checkpoint", tmp_path / "export")
    source = load_file(mtp_case["root"] / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(source) and any(".layers.3.eh_proj" in k for k in exported)
    for name, array in source.items():
        assert exported[name].dtype == array.dtype and exported[name].tobytes() == array.tobytes(), name
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    convert_hf(tmp_path / "export", tmp_path / "again")
    cfg, params, _ = load_params(tmp_path / "again" / "checkpoint")
    assert cfg == mtp_case["cfg"]
    for a, b in zip(jax.tree.leaves(mtp_case["params"]), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mtp_case["main"].save_pretrained(tmp_path / "plain")  # config num_nextn_predict_layers 1, no such weights
    convert_hf(tmp_path / "plain", tmp_path / "plain_converted")
    plain, plain_params, _ = load_params(tmp_path / "plain_converted" / "checkpoint")
    assert plain.mtp_layers == 0 and "mtp" not in plain_params


def test_the_mtp_loss_is_transformers_cross_entropy_and_trains_the_layer_only_when_asked(mtp_case):
    """compute.mtp_loss 0.3: the training loss gains 0.3 x the mean cross entropy of the MTP
    layer's predictions of token i + 2 (from transformers' MtpModel logits here), and the
    layer's parameters get gradients; at 0 (the default) it is not run and gets none."""

    cfg, main, mtp = mtp_case["cfg"], mtp_case["main"], mtp_case["mtp"]
    data = test_hf_parity.train_batch(cfg.vocab_size, seed=7)
    tokens = data["tokens"]
    results = {}
    for weight in (0.0, 0.3):
        compute = mtp_case["compute"].model_copy(update={"mtp_loss": weight})
        step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
        results[weight] = step(mtp_case["params"], data, 22.0)
    (loss_off, aux_off), grads_off = results[0.0]
    (loss_on, aux_on), grads_on = results[0.3]
    with torch.no_grad():
        hidden = main(torch.tensor(tokens), output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(12)[None].expand(2, 12)
        logits = mtp._project_to_logits(
            mtp.forward_layer(0, hidden[:, :-1], positions[:, 1:], None, input_ids=torch.tensor(tokens[:, 1:]))
        )
        ref = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size), torch.tensor(tokens[:, 2:]).reshape(-1)
        )
    assert "mtp_loss" not in aux_off and float(aux_on["mtp_loss"]) == pytest.approx(ref.item(), rel=1e-5)
    assert float(loss_on) == pytest.approx(float(loss_off) + 0.3 * ref.item(), rel=1e-5)
    assert float(aux_on["loss"]) == pytest.approx(float(aux_off["loss"]), rel=1e-6)  # the main loss as before
    for name in ("mtp", "mtp_blocks"):
        assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads_off[name]))
    moved = [np.isfinite(g).all() and np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads_on["mtp"])]
    assert (
        all(moved)
        and np.abs(np.asarray(grads_on["mtp_blocks"]["attn"]["wo_nwd" if cfg.is_mla else "wo_nhd"])).max() > 0
    )


def test_lora_targets_are_what_peft_names_and_the_rest_is_refused_in_one_sentence():
    """MiniMax-M2: LoRA on q/k/v/o_proj (its experts, w1/w2/w3, are not PEFT's names);
    DeepSeek-V2: its latent attention's projections as PEFT names them, its experts refused."""
    from engine.models.config import LoraConfig

    minimax, _ = model_config_from_hf({**hf_config("minimax_m2").to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]})
    assert LoraConfig(target_modules="all-linear").targets(minimax) == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match=r"^family 'minimax_m2' has no module gate_proj to adapt"):
        LoraConfig(target_modules=["gate_proj"]).targets(minimax)
    v2, _ = model_config_from_hf({**hf_config("deepseek_v2").to_dict(), "architectures": ["DeepseekV2ForCausalLM"]})
    latent = ("o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    assert LoraConfig(target_modules="all-linear").targets(v2) == latent
    with pytest.raises(ValueError, match=r"^family 'deepseek_v2' is a mixture of experts: LoRA on its experts"):
        LoraConfig(target_modules=["gate_proj"]).targets(v2)
