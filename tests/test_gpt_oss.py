"""GPT-OSS (family gpt_oss): attention sinks in every attention implementation, and the
family converted from a tiny random transformers GptOssForCausalLM with logits, greedy
tokens (the engine's sampler), export and round trip checked as for the other families.

The tiny model: odd sizes, 5 experts with top-2, alternating sliding-window (5) and full
layers, YaRN, weights N(0, 0.3^2) so routing is decided by margins a perturbation of the
router changes (checked), a swiglu_limit of 2 so the experts' clamps bite (checked), sinks
large enough to matter (checked), padding in the batch. One converted model per module.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from engine.config import ConfigError
from engine.interop.hf.convert import convert_hf
from engine.interop.hf.mapping import model_config_from_hf
from engine.models.params import apply_model, graphdef_of
from engine.ops import attention as attention_module
from engine.ops.attention import attention, choose_implementation
from engine.ops.attention_blocked import blocked_attention
from engine.ops.attention_reference import attention_mask, dot_product_attention, reference_attention
from engine.ops.partitioning import MESH_AXES, use_mesh
from engine.train.checkpoint import load_params, stored_configs
from tests.deps import need
from tests.test_hf_parity import batch, hf_logits
from tests.test_moe import assert_greedy_tokens_equal_transformers, export_loads_cleanly

torch = need("torch")
transformers = need("transformers")

VOCAB = 37

# --------------------------------------------------------------------------- attention sinks

B, T, N, K, H = 2, 23, 6, 2, 5
SEGMENTS = jnp.asarray([[1] * 9 + [2] * 11 + [0] * 3, [3] * T])


def _qkv_sinks(seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return draw(B, T, N, H), draw(B, T, K, H), draw(B, T, K, H), 2.0 * draw(N), draw(B, T, N, H)


@pytest.mark.parametrize("window,block", [(None, 8), (4, 8)], ids=["global", "window"])
def test_blocked_attention_with_sinks_equals_the_reference_in_values_and_gradients(window, block):
    q, k, v, sinks, probe = _qkv_sinks()
    valid = (SEGMENTS != 0)[:, :, None, None]

    def run(fn):
        """Outputs and d(sum(out * probe))/d(q, k, v, sinks): one program, the forward once."""

        def values_and_grads(q, k, v, sinks):
            out, vjp = jax.vjp(fn, q, k, v, sinks)
            return out * valid, vjp(probe * valid)

        return jax.jit(values_and_grads)(q, k, v, sinks)

    blocked = run(
        lambda q, k, v, s: blocked_attention(q, k, v, SEGMENTS, scale=0.4, window=window, block=block, sinks_n=s)
    )
    reference = run(lambda q, k, v, s: reference_attention(q, k, v, SEGMENTS, scale=0.4, window=window, sinks_n=s))
    np.testing.assert_allclose(blocked[0], reference[0], atol=5e-6)
    for name, got, want in zip(["q", "k", "v", "sinks"], blocked[1], reference[1]):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d{name}")
    assert float(jnp.abs(reference[1][3]).min()) > 1e-3  # every head's sink has a gradient
    # the sinks take probability mass: without them the output is another one
    plain = jax.jit(lambda q, k, v: reference_attention(q, k, v, SEGMENTS, scale=0.4, window=window))(q, k, v)
    assert float(jnp.abs((plain - reference[0]) * valid).max()) > 1e-2


def test_a_decode_step_with_sinks_equals_the_last_row_of_the_full_attention():
    """The sampler's one-query path (a KV cache's mask over the keys) against the (t, t) one."""
    q, k, v, sinks, _ = _qkv_sinks(seed=1)
    segments = jnp.ones((B, T), jnp.int32)
    full = reference_attention(q, k, v, segments, scale=0.4, window=6, sinks_n=sinks)
    mask = attention_mask(segments[:, -1:], segments, window=6)
    step = dot_product_attention(q[:, -1:], k, v, mask, scale=0.4, sinks_n=sinks)
    np.testing.assert_allclose(step, full[:, -1:], atol=1e-6)


def test_splash_with_sinks_under_a_mesh_equals_the_reference_in_values_and_gradients():
    """The Pallas kernel's own sinks, run in the interpreter inside the shard_map of a
    (data 2, tensor 2) mesh: each device holds one example and one kv head group, and its
    share of the sinks."""
    rng = np.random.default_rng(3)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v, probe = draw(2, 128, 4, 8), draw(2, 128, 2, 8), draw(2, 128, 2, 8), draw(2, 128, 4, 8)
    sinks = 2.0 * draw(4)
    segments = jnp.asarray([[1] * 45 + [2] * 70 + [0] * 13, [3] * 128])
    valid = (segments != 0)[:, :, None, None]

    def run(impl):
        def fn(q, k, v, s):
            return attention(q, k, v, segments, impl=impl, scale=0.3, window=7, local=True, sinks_n=s)

        def values_and_grads(q, k, v, s):  # one program: the forward once, its vjp with probe * valid
            out, vjp = jax.vjp(fn, q, k, v, s)
            return out * valid, vjp(probe * valid)

        return jax.jit(values_and_grads)(q, k, v, sinks)

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 1, 1, 1, 2), MESH_AXES)
    with use_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # splash off TPU says it runs in the interpreter
        out, grads = run("splash")
    ref_out, ref_grads = run("reference")
    np.testing.assert_allclose(out, ref_out, atol=5e-6)
    for name, got, want in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d{name}")


def test_auto_falls_back_from_cudnn_for_sinks_and_says_so_once(monkeypatch):
    monkeypatch.setattr(attention_module, "_told", set())
    case = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=256, softcap=None)
    assert choose_implementation("auto", platform="gpu", **case) == "cudnn"  # it fits without sinks
    with pytest.warns(UserWarning, match="cuDNN attention here takes no attention sinks"):
        assert choose_implementation("auto", platform="gpu", sinks=True, **case) == "blocked"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_implementation("auto", platform="gpu", sinks=True, **case) == "blocked"
        assert choose_implementation("auto", platform="tpu", sinks=True, **case) == "splash"  # it has sinks
    with pytest.raises(ConfigError, match="compute.attention_impl: cudnn cannot run this model: .*sinks"):
        choose_implementation("cudnn", platform="gpu", sinks=True, **case)


# --------------------------------------------------------------------------- a sharded step


def test_a_training_step_on_data_expert_and_tensor_axes_equals_one_device():
    """The tiny-gpt-oss preset (sinks, a window on every other layer, attention and expert
    biases, the clamped SwiGLU, a router bias) with 4 experts on data=2 x expert=2 x tensor=2:
    the experts over `expert`, their width and the attention heads over `tensor`. The loss,
    the router's balance loss and every gradient equal one device's."""
    from engine.config import load_preset
    from engine.models.config import ComputeConfig, ModelConfig
    from engine.parallel.config import MeshConfig
    from tests.test_moe import assert_mesh_step_equals_one_device, random_params

    cfg = ModelConfig(
        **{**load_preset("tiny-gpt-oss", "test"), "num_experts": 4, "sliding_window": 5, "max_seq_len": 16}
    )
    compute = ComputeConfig()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (4, 16))
    segments = np.ones((4, 16), np.int32)
    segments[1, 11:] = 0  # padding
    segments[2, 7:] = 2  # two documents
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(16), (4, 16)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": (segments > 0).astype(np.float32),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto attention names its fallback (sinks) once
        assert_mesh_step_equals_one_device(
            cfg,
            compute,
            random_params(cfg, compute, std=0.2),
            batch,
            MeshConfig(data=2, expert=2, tensor=2),
            denominator=50.0,
        )


# --------------------------------------------------------------------------- Hugging Face parity

LIMIT = 2.0


def hf_config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=30,
        intermediate_size=13,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=64,
        swiglu_limit=LIMIT,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    )


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(), attn_implementation="eager", experts_implementation="eager"
    ).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
            else:
                p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
    model.eval().save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(
        model=model,
        hf_dir=root / "hf",
        out=root / "converted",
        cfg=cfg,
        compute=compute,
        params=params,
        forward=engine_forward(cfg, compute),
    )


def padded_batch():
    """Three rows of 20 tokens: full, right-padded, left-padded (test_hf_parity's batch)."""
    return batch(VOCAB)


def engine_forward(cfg, compute):
    """logits(params, tokens, mask) of the engine's model, jitted: one compilation, not op by op."""
    graphdef = graphdef_of(cfg, compute)
    forward = jax.jit(lambda p, t, m: apply_model(graphdef, p, t, None, m))
    return lambda params, tokens, mask: np.asarray(forward(params, jnp.asarray(tokens), jnp.asarray(mask)))


def test_converted_gpt_oss_matches_transformers_logits(case):
    cfg = case["cfg"]
    assert cfg.family == "gpt_oss" and (cfg.moe.num_experts, cfg.moe.experts_per_token) == (5, 2)
    assert (
        cfg.attention.pattern == ["local", "global"]
        and cfg.attention.sliding_window == 5
        and cfg.rope.scaling.kind == "yarn"
    )
    tokens, mask = padded_batch()
    ours = case["forward"](case["params"], tokens, mask)
    ref = hf_logits(case["model"], tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\ngpt_oss: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_sinks_the_clamps_and_the_routing_all_matter_here(case):
    """Without the sinks, or without the clamps, the logits differ; a 5% change of the router
    moves some choices, so matching logits means matching routing."""
    cfg, compute, params = case["cfg"], case["compute"], case["params"]
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    logits = case["forward"](params, tokens, mask)
    blocks = params["blocks"]
    no_sinks = {**params, "blocks": {**blocks, "attn": {**blocks["attn"], "sinks_n": blocks["attn"]["sinks_n"] - 1e4}}}
    unclamped = cfg.model_copy(update={"swiglu_limit": 1e4})
    for other in (case["forward"](no_sinks, tokens, mask), engine_forward(unclamped, compute)(params, tokens, mask)):
        assert np.abs(other - logits)[valid].max() > 1e-2
    model = case["model"]
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
        chosen = [torch.topk(r, 2).indices.sort().values for r in out.router_logits]
        loads = torch.bincount(chosen[0].flatten(), minlength=5)
        assert loads.min() > 0 and loads.max() > loads.min()  # every expert used, unevenly
        routers = [m for n, m in model.named_modules() if n.endswith(".router")]
        saved = [r.weight.clone() for r in routers]
        for r in routers:
            r.weight.mul_(1 + 0.05 * torch.randn_like(r.weight))
        moved = model(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
        for r, w in zip(routers, saved):
            r.weight.copy_(w)
    changed = sum(
        int((torch.topk(r, 2).indices.sort().values != c).any(-1).sum()) for r, c in zip(moved.router_logits, chosen)
    )
    assert changed > 0


def test_the_capacity_dispatch_with_expert_biases_equals_the_dropless_one(case):
    """Nothing dropped (capacity >= every token): the experts' biases and clamps on the
    (expert, capacity) buffers give the logits the grouped matmuls do."""
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    capacity = case["compute"].model_copy(update={"moe_dispatch": "capacity", "moe_capacity_factor": 2.5})
    np.testing.assert_allclose(
        engine_forward(case["cfg"], capacity)(case["params"], tokens, mask)[valid],
        case["forward"](case["params"], tokens, mask)[valid],
        atol=2e-5,
    )


def test_greedy_generation_with_the_engine_sampler_is_identical(case):
    """7 prompt + 16 new tokens: past the sliding window, so the cache's window and sinks count."""
    assert_greedy_tokens_equal_transformers(case, VOCAB)


def test_export_loads_cleanly_in_transformers_and_converts_back_bitwise(case, tmp_path):
    reloaded = export_loads_cleanly(case, tmp_path / "export")
    # the interleaved gate_up_proj (and its bias) as transformers wrote it
    for name, tensor in case["model"].state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    np.testing.assert_array_equal(
        hf_logits(reloaded.eval(), tokens, mask)[valid], hf_logits(case["model"], tokens, mask)[valid]
    )
    ours = json.loads((tmp_path / "export" / "config.json").read_text())
    source = json.loads((case["hf_dir"] / "config.json").read_text())
    for key, value in source.items():
        if key not in ("transformers_version", "bos_token_id", "eos_token_id"):
            assert ours.get(key, "<missing>") == value, f"{key}: {ours.get(key, '<missing>')!r} != {value!r}"
    convert_hf(tmp_path / "export", tmp_path / "again")
    cfg, params, _ = load_params(tmp_path / "again" / "checkpoint")
    assert cfg == case["cfg"]
    for a, b in zip(jax.tree.leaves(case["params"]), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mxfp4_checkpoint(root, model, rng):
    """`model`'s weights saved as GPT-OSS publishes them: the experts' projections replaced by
    random MXFP4 blocks and scales (quantization_config mxfp4), everything else as is."""
    from safetensors.numpy import save_file

    tensors = {
        k: v.detach().numpy()
        for k, v in model.state_dict().items()
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    cfg = model.config
    e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        for proj, (out, inp) in {"gate_up_proj": (2 * f, d), "down_proj": (d, f)}.items():
            prefix = f"model.layers.{i}.mlp.experts.{proj}"
            tensors[prefix + "_blocks"] = rng.integers(0, 256, (e, out, inp // 32, 16), dtype=np.uint8)
            tensors[prefix + "_scales"] = rng.integers(122, 128, (e, out, inp // 32), dtype=np.uint8)
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (root / "config.json").write_text(json.dumps(config))
    return tensors


def test_an_mxfp4_checkpoint_converts_to_the_weights_transformers_dequantizes(tmp_path):
    """GPT-OSS as published: MXFP4 experts. Converted, its logits equal those of the same
    checkpoint loaded by transformers with dequantize=True, and its expert weights equal
    transformers' own dequantization bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = hf_config()
    config.hidden_size, config.intermediate_size = 64, 32  # MXFP4 blocks hold 32 inputs
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).float()
    tensors = _mxfp4_checkpoint(tmp_path / "hf", model, np.random.default_rng(0))
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert params["blocks"]["mlp"]["w_down_efd"].dtype == np.float32  # the float tensors' dtype, not uint8's
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        torch_dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts.down_proj"
        down = convert_moe_packed_tensors(
            torch.from_numpy(tensors[prefix + "_blocks"]),
            torch.from_numpy(tensors[prefix + "_scales"]),
            dtype=torch.float32,
        )
        np.testing.assert_array_equal(np.asarray(params["blocks"]["mlp"]["w_down_efd"][i]), down.numpy())
        np.testing.assert_array_equal(reference.model.layers[i].mlp.experts.down_proj.detach().numpy(), down.numpy())
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    forward = engine_forward(cfg, stored_configs(tmp_path / "converted" / "checkpoint")[1])
    ref = hf_logits(reference, tokens, mask)
    delta = float(np.abs(forward(params, tokens, mask) - ref)[valid].max())
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5, delta
    # The experts matter: the model with its MXFP4 experts' output zeroed predicts otherwise.
    mlp = params["blocks"]["mlp"]
    zeroed = {**params, "blocks": {**params["blocks"], "mlp": {**mlp, "w_down_efd": np.zeros_like(mlp["w_down_efd"])}}}
    assert np.abs(forward(zeroed, tokens, mask) - ref)[valid].max() > 100 * max(delta, 1e-6)


def test_a_sharded_bf16_mxfp4_checkpoint_converts_to_bf16_whatever_the_uint8_bytes(tmp_path):
    """As published: bf16 tensors beside MXFP4 payloads that outweigh them, in two shards, the
    scales apart from their blocks. The checkpoint's dtype is its float tensors' (the uint8
    bytes do not count), and the dequantized experts are exact in bf16 (a 4-bit code times a
    power of two)."""
    import ml_dtypes
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.interop.hf.safetensors_io import write_safetensors

    config = hf_config()
    config.hidden_size, config.intermediate_size, config.num_local_experts = 64, 64, 16
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    tensors = _mxfp4_checkpoint(tmp_path / "hf", model, np.random.default_rng(2))
    bf16_bytes = sum(v.nbytes for v in tensors.values() if v.dtype != np.uint8) // 2
    assert sum(v.nbytes for v in tensors.values() if v.dtype == np.uint8) > bf16_bytes
    (tmp_path / "hf" / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.endswith("_scales")},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scales")},
    }
    for file, part in shards.items():
        write_safetensors(
            tmp_path / "hf" / file,
            sorted((k, v if v.dtype == np.uint8 else v.astype(ml_dtypes.bfloat16)) for k, v in part.items()),
        )
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: file for file, part in shards.items() for k in part}})
    )
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    _, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    down = params["blocks"]["mlp"]["w_down_efd"]
    assert down.dtype == ml_dtypes.bfloat16 and params["embed_vd"].dtype == ml_dtypes.bfloat16
    prefix = "model.layers.2.mlp.experts.down_proj"
    want = convert_moe_packed_tensors(
        torch.from_numpy(tensors[prefix + "_blocks"]),
        torch.from_numpy(tensors[prefix + "_scales"]),
        dtype=torch.float32,
    )
    np.testing.assert_array_equal(np.asarray(down[2], np.float32), want.numpy())


def test_a_damaged_mxfp4_checkpoint_is_refused_by_tensor_name(tmp_path):
    config = hf_config()
    config.hidden_size, config.intermediate_size = 64, 32
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    tensors = _mxfp4_checkpoint(tmp_path / "hf", model, np.random.default_rng(0))
    from safetensors.numpy import save_file

    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.1.mlp.experts.down_proj_blocks' has no "
        r"'model.layers.1.mlp.experts.down_proj_scales' in the checkpoint",
    ):
        convert_hf(tmp_path / "hf", tmp_path / "out")
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = np.zeros((5, 64, 2), np.uint8)  # 2 blocks: 64 inputs
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.1.mlp.experts.down_proj_blocks' \[5, 64, 1, 16\] with "
        r"scales \[5, 64, 2\] does not dequantize",
    ):
        convert_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_what_the_engine_does_not_implement_is_refused_by_name():
    base = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 17,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 7,
        "head_dim": 4,
    }
    cfg, _ = model_config_from_hf(base)  # transformers' defaults: alternating windows of 128, YaRN x32
    assert cfg.attention.pattern == ["local", "global"] and cfg.attention.sliding_window == 128
    assert (cfg.rope.theta, cfg.rope.scaling.factor, cfg.rope.scaling.truncate) == (150000.0, 32.0, False)
    model_config_from_hf({**base, "quantization_config": {"quant_method": "mxfp4"}})  # dequantized on conversion
    with pytest.raises(ConfigError, match=r"quantization_config \(fp8\) is not supported; dequantize"):
        model_config_from_hf({**base, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match=r"attention_bias=false is not supported"):
        model_config_from_hf({**base, "attention_bias": False})
