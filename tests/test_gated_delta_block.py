"""The `gated_delta` mixer kind (engine/models/gated_delta_block.py) as a block of the decoder:

- the module equals transformers 5.25's Qwen3NextGatedDeltaNet (fused projections) and
  Qwen3_5GatedDeltaNet (split ones) with the same random weights, float32, 37 tokens (not a
  multiple of the chunk), one row right-padded;
- in a hybrid decoder (ModelConfig.mixer_pattern) its layers form a stack of their own,
  scanned with the attention layers' stack as one repeating unit, and the scanned model
  equals the unrolled one;
- packed rows: the convolution and the state restart at each document;
- decoding carries its state (KVCache.states): a prompt plus N decoded tokens leaves the
  same convolution window and recurrent state, and the same logits, as one forward over the
  same tokens, a left-padded row included; sampling's group rows each get the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.models.common import Build
from engine.models.config import ComputeConfig, GatedDeltaConfig, ModelConfig
from engine.models.gated_delta_block import GatedDeltaNet
from engine.models.kv_cache import KVCache
from engine.models.params import apply_model, graphdef_of
from engine.models.transformer import Transformer, layer_schedule
from engine.ops.gated_delta import gated_delta_chunked, gated_delta_scan
from tests.deps import need
from tests.test_hf_parity import engine_logits

torch = need("torch")
need("transformers")

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

D, HK, HV, DK, DV, T = 22, 3, 6, 5, 7, 37  # odd sizes: 3 key heads serve 6 value heads
SIZES = dict(num_key_heads=HK, num_value_heads=HV, key_head_dim=DK, value_head_dim=DV)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def tiny(**fields) -> ModelConfig:
    base = dict(
        family="qwen3",
        vocab_size=61,
        d_model=D,
        num_layers=7,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        mlp_dim=26,
        qk_norm=True,
        mixer_pattern=["gated_delta", "gated_delta", "attention"],
        gated_delta=SIZES,
    )
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
def test_the_mixer_equals_transformers(fused):
    cfg = tiny(gated_delta={**SIZES, "fused_projections": fused})
    hf_kwargs = dict(
        hidden_size=D,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        rms_norm_eps=cfg.norm.eps,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    if fused:
        hf = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**hf_kwargs), 0)
    else:
        hf = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**hf_kwargs), 0)
    with torch.no_grad():  # weights large enough that decay, gate and norm all matter
        for p in hf.parameters():
            p.normal_(0.0, 0.4)
        hf.A_log.uniform_(-1.0, 1.0)
    w = {name: p.detach().numpy() for name, p in hf.named_parameters()}
    spec = next(layer.mixer for layer in cfg.layer_specs() if layer.mixer.kind == "gated_delta")
    ours = GatedDeltaNet(spec, Build.of(cfg, ComputeConfig()), rngs=nnx.Rngs(0))
    linear = lambda name, *shape: w[name].T.reshape(*shape)  # noqa: E731  (out, in) -> (in, ...)
    if fused:
        ours.w_qkvz_dkx[...] = linear("in_proj_qkvz.weight", D, HK, -1)
        ours.w_ba_dkx[...] = linear("in_proj_ba.weight", D, HK, -1)
    else:
        ours.w_qkv_dc[...] = linear("in_proj_qkv.weight", D, -1)
        ours.w_z_dvh[...] = linear("in_proj_z.weight", D, HV, DV)
        ours.w_b_dv[...] = linear("in_proj_b.weight", D, HV)
        ours.w_a_dv[...] = linear("in_proj_a.weight", D, HV)
    ours.conv_c1k[...] = w["conv1d.weight"]
    ours.a_log_v[...], ours.dt_bias_v[...], ours.norm_h[...] = w["A_log"], w["dt_bias"], w["norm.weight"]
    ours.w_out_vhd[...] = linear("out_proj.weight", HV, DV, D)

    x = np.random.default_rng(1).normal(size=(2, T, D)).astype(np.float32)
    mask = np.ones((2, T), np.int64)
    mask[1, T - 6 :] = 0  # one right-padded row
    with torch.no_grad():
        expected = hf(torch.from_numpy(x), attention_mask=torch.from_numpy(mask)).numpy()
    got = ours(jnp.asarray(x), None, jnp.asarray(mask, jnp.int32), spec)
    scale = np.abs(expected).max()  # outputs of a few units: float32 rounding relative to them
    assert scale > 0.5
    assert max_diff(got[0], expected[0]) < 1e-5 * scale
    assert max_diff(got[1, : T - 6], expected[1, : T - 6]) < 1e-5 * scale


def test_a_hybrid_decoder_stacks_and_scans_its_kinds():
    cfg = tiny(attention_output_gate=True)
    assert cfg.layer_stacks() == [("gated_delta_blocks", (0, 1, 3, 4, 6)), ("blocks", (2, 5))]
    # a unit of (gated_delta, gated_delta, attention) scanned twice, the last layer after it
    assert layer_schedule(cfg.layer_pattern()) == (0, 3, 2)
    scanned = Transformer(cfg, ComputeConfig(), rngs=nnx.Rngs(0))
    params = nnx.state(scanned, nnx.Param)
    assert params["gated_delta_blocks"]["attn"]["w_qkv_dc"].shape == (5, D, 2 * HK * DK + HV * DV)
    assert params["blocks"]["attn"]["wq_dnh"].shape == (2, D, 4, 12)  # query and output gate per head
    assert sum(a.size for a in jax.tree.leaves(params)) == cfg.num_params()
    as_dict = nnx.to_pure_dict(params)
    per_layer = dict(as_dict)
    for name, indices in cfg.layer_stacks():  # the same weights, one entry per layer
        per_layer[name] = {i: jax.tree.map(lambda a, i=i: a[i], as_dict[name]) for i in range(len(indices))}
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11))
    mask = np.ones((2, 11), np.int32)
    mask[1, 8:] = 0
    got = engine_logits(cfg, ComputeConfig(scan_layers=False), per_layer, tokens, mask)
    assert max_diff(got, engine_logits(cfg, ComputeConfig(), as_dict, tokens, mask)) < 1e-5


def test_decoding_carries_the_state_of_a_full_forward():
    """Prompt (one row left-padded) + 5 decoded tokens == one cached forward over all of them."""
    cfg = tiny(gated_delta={**SIZES, "fused_projections": True}, attention_output_gate=True)
    compute = ComputeConfig()
    model = Transformer(cfg, compute, rngs=nnx.Rngs(2))
    prompt, new = 9, 5
    tokens = jax.random.randint(jax.random.key(3), (2, prompt + new), 1, cfg.vocab_size)
    mask = jnp.ones((2, prompt + new), jnp.int32).at[1, :3].set(0)  # row 1: 3 tokens of left padding
    tokens = jnp.where(mask == 1, tokens, 0)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask

    full_logits, full = model(tokens, positions, mask, cache=KVCache.init(cfg, compute, 2, prompt + new))
    logits, cache = model(
        tokens[:, :prompt], positions[:, :prompt], mask[:, :prompt], cache=KVCache.init(cfg, compute, 2, prompt + new)
    )
    steps = [logits[:, -1]]
    for i in range(prompt, prompt + new):
        step, cache = model(tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache=cache)
        steps.append(step[:, -1])
    linear = [i for i, layer in enumerate(cfg.layer_pattern()) if layer.mixer == "gated_delta"]
    assert all(cache.states[i] is None for i in range(cfg.num_layers) if i not in linear)
    for i in linear:
        window, recurrent = cache.states[i]
        assert window.shape == (2, 3, 2 * HK * DK + HV * DV) and np.abs(recurrent).max() > 1e-3
        assert max_diff(window, full.states[i].conv_bkc) < 1e-6
        assert max_diff(recurrent, full.states[i].recurrent_bhkv) < 1e-5
    assert max_diff(jnp.stack(steps[:-1], 1), full_logits[:, prompt - 1 : -1]) < 1e-4
    # the left-padded row's logits are its unpadded sequence's
    alone, _ = model(tokens[1:, 3:], positions[1:, 3:], mask[1:, 3:], cache=KVCache.init(cfg, compute, 1, prompt + new))
    assert max_diff(alone[0], full_logits[1, 3:]) < 1e-4
    # a group of rows per prompt each carries its prompt's state
    shared = cache.share(3, 4)
    assert shared.states[linear[0]].recurrent_bhkv.shape[0] == 6
    assert max_diff(shared.states[linear[0]].recurrent_bhkv[3:], cache.states[linear[0]].recurrent_bhkv[1:2]) == 0


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="multiple of num_key_heads"):
        GatedDeltaConfig(num_key_heads=4, num_value_heads=6, key_head_dim=4, value_head_dim=4)
    with pytest.raises(ValueError, match="gated_delta"):
        tiny(gated_delta=None)


def test_packed_documents_equal_each_document_alone():
    """Packed rows (segment ids): the convolution and the recurrent state restart at each
    document, so every document's logits are those of the document run alone; the chunked
    form and the per-token recurrence agree across chunk and document boundaries."""
    cfg = tiny(gated_delta={**SIZES, "fused_projections": True}, attention_output_gate=True)
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, ComputeConfig(), rngs=nnx.Rngs(4)), nnx.Param))
    lengths = [7, 66, 5]  # the middle document spans two chunks of 64
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None].astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, segments.shape)
    graphdef = graphdef_of(cfg, ComputeConfig())
    packed = apply_model(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    start = 0
    for n in lengths:
        alone = engine_logits(cfg, ComputeConfig(), params, tokens[:, start : start + n], np.ones((1, n), np.int32))
        assert max_diff(packed[:, start : start + n], alone) < 1e-5
        start += n

    rng = np.random.default_rng(7)
    q, k = (jnp.asarray(rng.normal(size=(1, 77, 2, 5)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, 77, 4, 3)), jnp.float32)
    g = -jnp.asarray(np.abs(rng.normal(size=(1, 77, 4))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (1, 77, 4)), jnp.float32)
    ids = jnp.asarray(np.repeat([1, 2, 3, 4], [3, 30, 1, 43])[None], jnp.int32)
    chunked = gated_delta_chunked(q, k, v, g, beta, chunk_size=16, segment_ids_bt=ids)
    scanned = gated_delta_scan(q, k, v, g, beta, segment_ids_bt=ids)
    assert max_diff(chunked[0], scanned[0]) < 1e-5 and max_diff(chunked[1], scanned[1]) < 1e-5
