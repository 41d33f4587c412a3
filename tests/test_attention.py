"""Block-causal attention and the model's matmuls: the same function and gradients as the
straightforward versions, in fewer operations and less saved memory. (Every attention
implementation against the reference: tests/test_attention_backends.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import graphdef_of
from engine.models.transformer import ACTIVATIONS, Transformer
from engine.ops import dense as dense_module
from engine.ops.attention_blocked import _mask, blocked_attention, key_parts, key_start, query_blocks
from engine.ops.attention_reference import attention_mask, reference_attention
from engine.ops.dense import dense, gated_mlp

B, T, N, K, H = 2, 40, 6, 2, 8


def _qkv(dtype=jnp.float32, seed=0, t=T):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return draw(B, t, N, H), draw(B, t, K, H), draw(B, t, K, H), draw(B, t, N, H)


# Two packed documents and trailing padding in row 0, one document in row 1.
SEGMENTS = jnp.asarray([[1] * 15 + [2] * 20 + [0] * 5, [3] * T])
VALID = (SEGMENTS != 0)[:, :, None, None]
CASES = {
    "causal": dict(window=None, softcap=None),
    "sliding_window": dict(window=6, softcap=None),
    "window_wider_than_a_block": dict(window=20, softcap=None),
    "softcap": dict(window=None, softcap=2.0),
}


def _reference(q, k, v, case):
    return reference_attention(q, k, v, SEGMENTS, scale=0.3, **case)


def _blocked(q, k, v, case, block):
    return blocked_attention(q, k, v, SEGMENTS, scale=0.3, block=block, **case)


def test_query_blocks_cover_the_sequence():
    assert query_blocks(40, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert query_blocks(40, 16) == [(0, 16), (16, 32), (32, 40)]  # the last block is shorter
    assert query_blocks(40, 0) == [(0, 40)]
    assert query_blocks(40, 64) == [(0, 40)]


_REFERENCES: dict = {}  # case -> the reference's values and gradients


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("block", [8, 16, 0])
def test_blocked_attention_and_its_gradients_equal_the_reference(case, block):
    """Values and d(sum(out * w))/d(q, k, v), each side one jitted program (the reference's
    computed once per case, for every block size)."""
    q, k, v, w = _qkv()
    name = case
    case = CASES[case]

    def values_and_grads(fn):
        def run(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(w * VALID)

        return jax.jit(run)(q, k, v)

    if name not in _REFERENCES:
        _REFERENCES[name] = values_and_grads(lambda q, k, v: _reference(q, k, v, case))
    expected, g_ref = _REFERENCES[name]
    got, g_new = values_and_grads(lambda q, k, v: _blocked(q, k, v, case, block))
    np.testing.assert_allclose(got * VALID, expected * VALID, atol=2e-6)
    for name, a, b in zip("qkv", g_ref, g_new):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("window", [None, 20])
def test_unpacked_blocked_attention_and_its_gradients_equal_the_reference(window):
    """Without segment ids the keys left of each block go unmasked (key_parts)."""
    q, k, v, w = _qkv(seed=4)
    run = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, None, scale=0.3, window=window) * w)  # noqa: E731
    blocked = functools.partial(blocked_attention, block=8)
    np.testing.assert_allclose(
        blocked(q, k, v, None, scale=0.3, window=window),
        reference_attention(q, k, v, None, scale=0.3, window=window),
        atol=2e-6,
    )
    g_ref = jax.grad(run(reference_attention), argnums=(0, 1, 2))(q, k, v)
    g_new = jax.grad(run(blocked), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_new):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


def _flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def test_a_local_layer_skips_the_key_blocks_left_of_its_window():
    """At 256 positions in blocks of 16 with a window of 16, a query block needs at most two
    key blocks where a global layer's last block needs all sixteen: forward and backward
    do a fraction of the global layer's work."""
    q, k, v, _ = _qkv(t=256)
    segments = jnp.ones((B, 256), jnp.int32)

    def step(window):
        def loss(q, k, v):
            return jnp.sum(blocked_attention(q, k, v, segments, scale=0.3, window=window, block=16) ** 2)

        return lambda q, k, v: jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    local, global_ = _flops(step(16), q, k, v), _flops(step(None), q, k, v)
    assert local < 0.3 * global_, (local, global_)


def test_bfloat16_attention_keeps_its_dtype_and_tracks_float32():
    q, k, v, w = _qkv(jnp.bfloat16)
    case = CASES["causal"]
    out = _blocked(q, k, v, case, 8)
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out * VALID, np.float32), _reference(*f32, case) * VALID, atol=3e-2)
    grads = jax.grad(lambda q, k, v: jnp.sum(_blocked(q, k, v, case, 8).astype(jnp.float32)), argnums=(0, 1, 2))(
        q, k, v
    )
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3


def test_the_backward_pass_saves_no_score_sized_tensor():
    q, k, v, _ = _qkv()
    case = CASES["causal"]
    _, vjp = jax.vjp(lambda q, k, v: _blocked(q, k, v, case, 8), q, k, v)
    # Scores are (b, heads, t, s): s / head_dim = 5 times the size of q here.
    assert max(leaf.size for leaf in jax.tree.leaves(vjp)) <= q.size
    # The plain version keeps its probabilities: the check can fail.
    _, vjp_ref = jax.vjp(lambda q, k, v: _reference(q, k, v, case), q, k, v)
    assert max(leaf.size for leaf in jax.tree.leaves(vjp_ref)) >= B * N * T * T


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["unpacked", "packed"])
@pytest.mark.parametrize("window", [None, 6, 20])
def test_a_key_part_goes_unmasked_only_where_every_query_sees_every_key(segments, window):
    """The blocked kernel skips the select on a key part whose mask it drops: that part must be
    all visible in the reference mask, and every other part's mask must equal the reference's."""
    full = attention_mask(*(2 * [jnp.ones((B, T), jnp.int32) if segments is None else segments]), window=window)
    dropped = 0
    for q0, q1 in query_blocks(T, 8):
        for a, e in key_parts(q0, q1, key_start(q0, window)):
            mask = _mask(segments, q0, q1, a, e - a, window)
            want = np.broadcast_to(full[:, q0:q1, a:e], (B, q1 - q0, e - a))
            if mask is None:
                dropped += 1
                assert want.all(), (q0, a, e)
            else:
                np.testing.assert_array_equal(np.broadcast_to(mask, want.shape), want)
    # Without segments the left-of-diagonal parts of global layers (and of the window of 20,
    # which covers a block and the one before it) need no mask; a window of 6 cuts every part.
    assert (dropped > 0) == (segments is None and window != 6)


def test_bfloat16_blocked_attention_runs_every_product_in_bfloat16():
    """XLA:CPU upcasts a bf16 product to float32 when an operand is a bare transpose (or its
    contraction is not on the minor axes); each block's products slice their operands so
    that every dot, forward and backward, keeps bf16 operands (the CPU's bf16 kernels)."""
    q, k, v, w = _qkv(jnp.bfloat16, t=64)
    loss = lambda q, k, v: jnp.sum(blocked_attention(q, k, v, None, scale=0.3, block=16).astype(jnp.float32) * w)  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    dots = re.findall(r"= f32\[[^]]*\]\S* dot\((%[^,]+), (%[^)]+)\)", hlo)
    operand_type = dict(re.findall(r"^\s*(%\S+) = (\w+)\[", hlo, re.M))
    assert len(dots) >= 7 * 4
    assert all(operand_type[a] == operand_type[b] == "bf16" for a, b in dots), dots


def test_model_logits_do_not_depend_on_the_attention_block():
    cfg = ModelConfig(
        vocab_size=37, d_model=22, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10, mlp_dim=26, max_seq_len=64
    )
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 37, (2, 32)))
    blocked = Transformer(cfg, ComputeConfig(attention_block=8), rngs=nnx.Rngs(0))(tokens)
    single = Transformer(cfg, ComputeConfig(attention_block=0), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(blocked, single, atol=1e-5)


# --------------------------------------------------------------------------- matmuls

BACKWARDS = ["cpu", "autodiff"]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize(
    "shapes",
    [((3, 5, 4), (4, 9), 1), ((3, 5, 9), (9, 4), 1), ((3, 5, 3, 2), (3, 2, 7), 2)],
    ids=["narrow_input", "narrow_output", "two_contracted_axes"],
)
def test_dense_gradients_equal_autodiff_of_a_plain_contraction(shapes, backward):
    x_shape, w_shape, n_in = shapes
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.standard_normal(x_shape)), jnp.asarray(rng.standard_normal(w_shape))
    out_shape = x_shape[: len(x_shape) - n_in] + w_shape[n_in:]
    probe = jnp.asarray(rng.standard_normal(out_shape))

    def plain(x, w):
        return jnp.tensordot(x, w, axes=n_in)

    np.testing.assert_allclose(dense(x, w, n_in, backward=backward), plain(x, w), rtol=1e-6)
    g_plain = jax.grad(lambda x, w: jnp.sum(plain(x, w) * probe), argnums=(0, 1))(x, w)
    g_dense = jax.grad(lambda x, w: jnp.sum(dense(x, w, n_in, backward=backward) * probe), argnums=(0, 1))(x, w)
    for a, b in zip(g_plain, g_dense):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_gradients_equal_autodiff(activation, backward):
    act = ACTIVATIONS[activation]
    rng = np.random.default_rng(2)
    x, wg, wu, wd, probe = (
        jnp.asarray(rng.standard_normal(s)) for s in [(2, 7, 5), (5, 11), (5, 11), (11, 5), (2, 7, 5)]
    )

    def plain(x, wg, wu, wd):
        return (act(x @ wg) * (x @ wu)) @ wd

    def ours(*a):
        return gated_mlp(*a, act, backward=backward)

    np.testing.assert_allclose(ours(x, wg, wu, wd), plain(x, wg, wu, wd), rtol=1e-6)
    g_plain = jax.grad(lambda *a: jnp.sum(plain(*a) * probe), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    g_fast = jax.grad(lambda *a: jnp.sum(ours(*a) * probe), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], g_plain, g_fast):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_float32_out_returns_the_unrounded_accumulator_and_rounds_its_gradient(backward):
    """The LM head's product: bf16 operands, the float32 accumulator returned as is, and the
    gradients those of that float32 product, in the operands' dtype."""
    rng = np.random.default_rng(5)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(3, 5, 16), (16, 9)])
    probe = jnp.asarray(rng.standard_normal((3, 5, 9)), jnp.float32)

    def plain(x, w):
        return jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)

    out = dense(x, w, float32_out=True, backward=backward)
    assert out.dtype == jnp.float32 and dense(x, w, backward=backward).dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, plain(x, w))
    g_plain = jax.grad(lambda x, w: jnp.sum(plain(x, w) * probe), argnums=(0, 1))(x, w)
    g_dense = jax.grad(lambda x, w: jnp.sum(dense(x, w, float32_out=True, backward=backward) * probe), argnums=(0, 1))(
        x, w
    )
    for a, b in zip(g_plain, g_dense):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=2e-2, atol=2e-2)


def test_a_bfloat16_gated_mlp_rounds_its_hidden_activation_once():
    """activation(gate) * up is computed in float32 from the rounded projections and rounded
    once, as torch's bf16 kernels do; left to XLA, a bf16 silu is rounded after each of its
    negate, exp, add and divide."""
    rng = np.random.default_rng(6)
    x, wg, wu, wd = (
        jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(2, 7, 16), (16, 32), (16, 32), (32, 16)]
    )
    f32 = jnp.float32

    def product(a, b):
        return jnp.einsum("...i,ij->...j", a, b, preferred_element_type=f32).astype(jnp.bfloat16)

    gate, up = product(x, wg), product(x, wu)
    hidden = (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(jnp.bfloat16)
    for backward in BACKWARDS:
        np.testing.assert_array_equal(
            np.float32(gated_mlp(x, wg, wu, wd, jax.nn.silu, backward=backward)),
            np.float32(product(hidden, wd)),
            err_msg=backward,
        )


@pytest.mark.parametrize("platform,hand_written", [("cpu", True), ("gpu", False), ("tpu", False)])
def test_auto_uses_the_hand_written_matmul_backward_only_on_cpu(platform, hand_written, monkeypatch):
    monkeypatch.setattr(dense_module, "current_platform", lambda: platform)
    x, w = jnp.ones((3, 5, 4)), jnp.ones((4, 9))
    jaxprs = [
        str(jax.make_jaxpr(lambda x, w: dense(x, w))(x, w)),
        str(jax.make_jaxpr(lambda x: gated_mlp(x, w, w, w.T, jax.nn.silu))(x)),
    ]
    assert all(("custom_vjp_call" in jaxpr) == hand_written for jaxpr in jaxprs)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_every_model_matmul_goes_through_the_injected_dot_general(backward):
    """Forward: 4 attention + 3 MLP projections a layer and the LM head; the hand-written
    backward computes its two products per matmul with it too."""
    calls = []

    def counting_dot_general(lhs, rhs, dimension_numbers, **kwargs):
        calls.append(lhs.shape)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)

    cfg = ModelConfig(
        vocab_size=37, d_model=22, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10, mlp_dim=26, max_seq_len=64
    )
    compute = ComputeConfig(scan_layers=False, matmul_backward=backward)
    model = Transformer(cfg, compute, rngs=nnx.Rngs(0), dot_general=counting_dot_general)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 37, (2, 9)))
    graphdef, state = nnx.split(model)

    def loss(state, gd=graphdef):
        return jnp.sum(nnx.merge(gd, state)(tokens) ** 2)

    forward = 2 * 7 + 1
    jax.make_jaxpr(jax.grad(loss))(state)  # tracing the gradient calls every product once
    assert len(calls) == (3 * forward if backward == "cpu" else forward)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss))(state)["embed_vd"][...],
        jax.jit(jax.grad(lambda s: loss(s, graphdef_of(cfg, compute))))(state)["embed_vd"][...],
        rtol=1e-6,
    )
