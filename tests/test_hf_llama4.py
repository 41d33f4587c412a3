"""Hugging Face parity of Llama 4 text (Llama4ForCausalLM), and the multimodal checkpoints it
is published in (Llama4ForConditionalGeneration).

Two tiny models on odd shapes (6 query heads over 2 KV heads, head_dim 8, 5 layers): dense
and expert layers interleaved (interleave_moe_layer_step 2) or experts everywhere, NoPE
layers every third or second layer with query temperature tuning (floor_scale 4, so it
changes within the 20-token rows), chunked attention on the RoPE layers (chunks of 3, so
several per row; 3 divides the left-padded row's padding, where transformers starts the
chunks), top-1 and top-2 sigmoid routing that scales the experts' input, a shared expert,
the L2 QK norm (one case) and llama3 RoPE scaling.

Each case gets the checks tests/test_hf_parity.py makes of every family (collected here over
this module's `case`): greedy tokens and the KV-cache sampler equal transformers', export
loads cleanly with the same logits, config.json as transformers writes it, export ->
convert bitwise; and here: logits to 1e-5 at transformers' init scale and with weights
scaled so routing matters, a training step, LoRA's targets, the multimodal checkpoint.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
peft = need("peft")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.interop.hf.peft import adapter_to_peft  # noqa: E402
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig  # noqa: E402
from engine.models.lora import split_adapter  # noqa: E402
from engine.models.params import abstract_model_params, graphdef_of, param_shardings  # noqa: E402
from engine.ops.partitioning import use_mesh  # noqa: E402
from engine.parallel.config import MeshConfig  # noqa: E402
from engine.parallel.mesh import batch_sharding, global_array, make_mesh  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    Case,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_loads_in_transformers_cleanly_with_the_same_logits,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)
from tests.test_moe import random_params  # noqa: E402

TEXT = {
    **COMMON,
    "num_hidden_layers": 5,
    "intermediate_size": 14,  # an expert's width (and the shared expert's)
    "intermediate_size_mlp": 26,  # the dense layers'
    "num_local_experts": 5,
    "attention_chunk_size": 3,
    "floor_scale": 4,
    "attn_scale": 0.5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "pad_token_id": None,
}
CONFIGS = {
    # Maverick's layout: dense, expert, dense, ...; NoPE every third layer; L2 QK norm; top-1
    "llama4_interleaved": dict(interleave_moe_layer_step=2, no_rope_layer_interval=3, use_qk_norm=True),
    # Scout's: experts in every layer; NoPE every second layer; no QK norm; top-2
    "llama4_every_layer": dict(no_rope_layer_interval=2, use_qk_norm=False, num_experts_per_tok=2),
}


def hf_config(name: str):
    return transformers.Llama4TextConfig(**TEXT, **CONFIGS[name])


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), attn_implementation="eager")
    return converted_case(name, model, root, stand_in_tokenizer=True)


def max_delta(cfg, compute, params, model) -> tuple[float, float]:
    """(max |dlogit| over the valid positions of test_hf_parity's batch, max |logit|)."""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ref = hf_logits(model, tokens, mask)
    return float(np.abs(engine_logits(cfg, compute, params, tokens, mask) - ref)[valid].max()), float(
        np.abs(ref[valid]).max()
    )


def test_logits_match_transformers_to_1e4_with_weights_that_make_routing_matter(case):
    delta, largest = max_delta(case.cfg, case.compute, case.params, case.hf_model)
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {largest:.1f})")
    assert delta <= 1e-4 and largest > 0.5
    # Routing matters at this scale: the tokens spread over the experts, and a router moved by
    # 5% of its spread sends some elsewhere (so a wrong choice of expert would show).
    layer = next(i for i, x in enumerate(case.cfg.layer_pattern()) if x.ffn == "moe")
    router = case.hf_model.model.layers[layer].feed_forward.router
    inputs = []
    hook = router.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    try:
        hf_logits(case.hf_model, *batch())
    finally:
        hook.remove()
    with torch.no_grad():
        w = router.weight
        noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
        chosen = torch.topk(inputs[0] @ w.T, router.top_k, dim=1).indices
        nudged = torch.topk(inputs[0] @ (w + 0.05 * w.std() * noise).T, router.top_k, dim=1).indices
    assert len(torch.unique(chosen)) >= 3 and (chosen != nudged).any()


def test_logits_match_transformers_to_1e5_at_its_init_scale(case, tmp_path):
    """transformers' own initialisation (std 0.02, unit norms): small logits, held to 1e-5."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(case.family), attn_implementation="eager")
    model = model.float().eval()
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    delta, largest = max_delta(cfg, stored_configs(tmp_path / "converted" / "checkpoint")[1], params, model)
    print(f"\n{case.family} at init scale: max |delta logit| = {delta:.2e} (logits up to {largest:.3f})")
    assert delta <= 1e-5 and largest > 1e-3


def test_each_llama4_difference_shows_in_the_logits(case):
    """The test can fail: turning off any one of the family's settings moves the logits far
    more than the tolerance (expert input vs output scaling, interleaved RoPE, chunks, the
    NoPE layers' temperature, the L2 QK norm where the case has it)."""
    changes = [
        {"router_scales_input": False},
        {"rope_interleave": False},
        {"attention_pattern": ["global"], "attention_chunk_size": None},
        {"attn_temperature_floor": None},
    ] + ([{"qk_l2_norm": False}] if case.cfg.attention.qk_l2_norm else [])
    for change in changes:
        cfg = case.cfg.model_copy(update=change)
        delta, _ = max_delta(cfg, case.compute, case.params, case.hf_model)
        assert delta > 1e-3, change


def test_the_pattern_is_what_the_config_says(case):
    """Which layers have experts, RoPE (and with it chunks and the QK norm) is transformers'."""
    hf_layers = case.hf_model.model.layers
    layers = case.cfg.layer_pattern()
    assert [x.ffn == "moe" for x in layers] == [layer.is_moe_layer for layer in hf_layers]
    assert [x.rope for x in layers] == [bool(layer.self_attn.use_rope) for layer in hf_layers]
    assert [x.chunked for x in layers] == [t == "chunked_attention" for t in case.hf_model.config.layer_types]
    assert not all(x.rope for x in layers) and any(x.chunked for x in layers)
    if case.family == "llama4_interleaved":
        assert [x.stack for x in layers] == ["dense_blocks", "blocks"] * 2 + ["dense_blocks"]
        assert case.params["dense_blocks"]["mlp"]["w_gate_df"].shape == (3, 30, 26)
    experts = case.params["blocks"]["mlp"]
    assert experts["w_gate_edf"].shape[1:] == (5, 30, 14) and experts["w_shared_gate_dg"].shape[1:] == (30, 14)
    # gate_up_proj (E, d, 2f): gate then up along its last axis
    layer = next(i for i, x in enumerate(layers) if x.ffn == "moe")
    gate_up = case.hf_model.model.layers[layer].feed_forward.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(experts["w_up_edf"][0]), gate_up[..., 14:])


def test_unrolled_layers_match_the_scanned_stacks(case):
    """scan_layers: false runs each layer as the scanned schedule does (the dense and expert
    stacks interleaved); float32 summation order apart (a few 1e-6 of logits up to 6)."""
    unrolled = case.compute.model_copy(update={"scan_layers": False})
    params = dict(case.params)
    for name, layers in case.cfg.layer_stacks():
        params[name] = {i: jax.tree.map(lambda x, i=i: x[i], case.params[name]) for i in range(len(layers))}
    tokens, mask = batch()
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        engine_logits(case.cfg, unrolled, params, tokens, mask)[valid],
        engine_logits(case.cfg, case.compute, case.params, tokens, mask)[valid],
        atol=5e-5,
    )


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_a_training_step_runs_and_moves_every_parameter(case):
    """One SGD step of next-token loss on the converted model: the loss is finite, every
    parameter (router, experts, shared expert, dense MLP, attention) gets a gradient and
    changes, and the loss goes down."""
    tokens, mask = batch()
    data = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape),
        "segment_ids": mask.astype(np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": (mask * np.roll(mask, -1, 1)).astype(np.float32),
    }
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(case.cfg, case.compute)), has_aux=True))
    (loss, _), grads = step(case.params, data, float(data["loss_mask"].sum()))
    assert np.isfinite(float(loss))
    moved = jax.tree.map(lambda p, g: p - 0.05 * g, case.params, grads)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(g)) and np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)
    (again, _), _ = step(moved, data, float(data["loss_mask"].sum()))
    assert float(again) < float(loss)


def test_lora_targets_are_the_attention_projections_as_peft_names_them(case):
    """LoRA adapts q/k/v/o of every layer (both stacks), named as PEFT names them on
    Llama4ForCausalLM; the MLP modules (experts, shared expert, dense MLP) are refused in one
    sentence, and all-linear leaves them out."""
    lora = LoraConfig(rank=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert LoraConfig(target_modules="all-linear").targets(case.cfg) == ("q_proj", "k_proj", "v_proj", "o_proj")
    refused = r"^family 'llama4' (is a mixture of experts: LoRA on its experts|stores gate_proj in a layout)"
    with pytest.raises(ValueError, match=refused):
        LoraConfig(target_modules=["q_proj", "gate_proj"]).targets(case.cfg)
    shapes = split_adapter(abstract_model_params(case.cfg, ComputeConfig(), None, lora))[0]
    adapter = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    ours = adapter_to_peft(case.cfg, lora, adapter, scan_layers=True)
    hf = peft.get_peft_model(
        random_causal_lm(hf_config(case.family)), peft.LoraConfig(r=2, target_modules=list(lora.target_modules))
    )
    theirs = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(hf).items()}
    assert {k: v.shape for k, v in ours.items()} == theirs


def test_the_multimodal_checkpoint_converts_to_the_text_model(case, tmp_path):
    """A Llama4ForConditionalGeneration (vision tower, projector, the same text decoder) saved by
    transformers converts to exactly the text model's params, and the log says what was skipped."""
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vision_output_dim=16,
        image_size=28,
        patch_size=14,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    text = case.hf_model.config.to_dict()
    multimodal = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision)
    )
    missing, unexpected = multimodal.language_model.load_state_dict(case.hf_model.state_dict(), strict=False)
    assert not missing and not unexpected
    multimodal.save_pretrained(tmp_path / "mm")
    messages: list[str] = []
    summary = convert_hf(tmp_path / "mm", tmp_path / "converted", log=messages.append)
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg and summary["architecture"] == "Llama4ForCausalLM"
    flat_a, tree_a = jax.tree.flatten(case.params)
    flat_b, tree_b = jax.tree.flatten(params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    skipped = [m for m in messages if "outside the text decoder" in m]
    print("\n" + "\n".join(messages))
    assert len(skipped) == 1 and "vision tower" in skipped[0] and "vision_model." in skipped[0]
    assert summary["skipped_tensors"] == sum(
        1 for n, _ in multimodal.named_parameters() if not n.startswith("language_model.")
    )
    # ... and the decoder goes back into that layout beside the source's vision tower: transformers
    # loads it as the same Llama4ForConditionalGeneration, every tensor bitwise.
    result = export_hf(tmp_path / "converted" / "checkpoint", tmp_path / "back", multimodal_source=tmp_path / "mm")
    assert result["architecture"] == "Llama4ForConditionalGeneration"
    reloaded, info = transformers.Llama4ForConditionalGeneration.from_pretrained(
        tmp_path / "back", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs, ours = multimodal.state_dict(), reloaded.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_parallel_step_equals_one_device(dispatch):
    """tiny-llama4 (top-2 here, chunks of 3) on expert=2 x fsdp=2 x data=2 simulated devices:
    the loss, router statistics and every gradient of a step equal one device's, the experts'
    input-scaled rows reaching their devices by all-to-all (tests/test_moe.py's check; the
    gradients to 1e-5 of each one's largest entry, float32 sums in another order)."""
    preset = resolve_model_preset({"model": "tiny-llama4"}, "tiny-llama4")["model"]
    cfg = ModelConfig.model_validate({**preset, "experts_per_token": 2, "attention_chunk_size": 3})
    compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=2.0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 8))
    segments = np.ones((8, 8), np.int32)
    segments[3, 5:] = 0
    batch_ = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(8), (8, 8)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": segments.astype(np.float32),
    }
    host_params = random_params(cfg, compute)
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    results = {}
    one = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    for name, mesh in (("one", one), ("mesh", make_mesh(MeshConfig(data=2, expert=2, fsdp=2)))):
        params = jax.device_put(host_params, param_shardings(cfg, compute, mesh)[1])
        sharded = {k: global_array(v, batch_sharding(mesh)) for k, v in batch_.items()}
        with use_mesh(mesh):
            compiled = step.lower(params, sharded, 61.0).compile()
        (loss, aux), grads = compiled(params, sharded, 61.0)
        results[name] = float(loss), float(aux["moe_balance_loss"]), jax.tree.map(np.asarray, grads)
        if name == "mesh":
            assert params["blocks"]["mlp"]["w_gate_edf"].sharding.spec[:2] == (None, "expert")
            assert "all-to-all" in compiled.as_text()
    (loss_1, balance_1, grads_1), (loss_8, balance_8, grads_8) = results["one"], results["mesh"]
    assert np.isfinite(loss_1) and loss_8 == pytest.approx(loss_1, rel=1e-6)
    assert balance_8 == pytest.approx(balance_1, rel=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_1), jax.tree.leaves(grads_8), strict=True):
        np.testing.assert_allclose(
            b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()), err_msg=jax.tree_util.keystr(path)
        )


def test_what_the_engine_cannot_run_is_refused_in_one_sentence():
    """Router jitter (training noise the engine does not add) and a layer kind it lacks."""
    hf = {**hf_config("llama4_interleaved").to_dict(), "architectures": ["Llama4ForCausalLM"]}
    assert model_config_from_hf(hf)[0].attention.pattern == ["chunked", "chunked", "global"]  # RoPE layers chunked
    with pytest.raises(ConfigError, match=r"router_jitter_noise=0.1 is not supported \(only 0\)$"):
        model_config_from_hf({**hf, "router_jitter_noise": 0.1})
    with pytest.raises(ConfigError, match=r"layer type 'sliding_attention' is not supported \(chunked_attention, full"):
        model_config_from_hf({**hf, "layer_types": ["sliding_attention"] * 5})
