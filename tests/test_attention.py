"""Block-causal attention and the model's matmuls: the same function and gradients as the
straightforward versions, in fewer operations and less saved memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.ops.attention import causal_attention, query_blocks
from engine.models.config import ComputeConfig, ModelConfig
from engine.ops.dense import dense
from engine.models.transformer import Transformer
from engine.ops.attention import attention_mask, dot_product_attention

B, T, N, K, H = 2, 40, 6, 2, 8


def _qkv(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return draw(B, T, N, H), draw(B, T, K, H), draw(B, T, K, H), draw(B, T, N, H)


# Two packed documents and trailing padding in row 0, one document in row 1.
SEGMENTS = jnp.asarray([[1] * 15 + [2] * 20 + [0] * 5, [3] * T])
VALID = (SEGMENTS != 0)[:, :, None, None]
CASES = {
    "causal": dict(window=None, local=False, softcap=None),
    "sliding_window": dict(window=6, local=True, softcap=None),
    "window_off_on_global_layer": dict(window=6, local=False, softcap=None),
    "softcap": dict(window=None, local=False, softcap=2.0),
}


def _reference(q, k, v, case):
    mask = attention_mask(SEGMENTS, SEGMENTS, window=case["window"], local=case["local"])
    return dot_product_attention(q, k, v, mask, scale=0.3, softcap=case["softcap"])


def _blocked(q, k, v, case, block):
    return causal_attention(q, k, v, SEGMENTS, scale=0.3, softcap=case["softcap"], window=case["window"],
                            local=case["local"], block=block)


def test_query_blocks_cover_the_sequence():
    assert query_blocks(40, 8) == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    assert query_blocks(40, 16) == [(0, 16), (16, 32), (32, 40)]  # the last block is shorter
    assert query_blocks(40, 0) == [(0, 40)]
    assert query_blocks(40, 64) == [(0, 40)]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("block", [8, 16, 0])
def test_blocked_attention_and_its_gradients_equal_the_reference(case, block):
    q, k, v, w = _qkv()
    case = CASES[case]
    expected = _reference(q, k, v, case)
    got = _blocked(q, k, v, case, block)
    np.testing.assert_allclose(got * VALID, expected * VALID, atol=2e-6)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w * VALID)

    g_ref = jax.grad(loss(lambda q, k, v: _reference(q, k, v, case)), argnums=(0, 1, 2))(q, k, v)
    g_new = jax.grad(loss(lambda q, k, v: _blocked(q, k, v, case, block)), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_new):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


def test_a_traced_local_flag_selects_the_window():
    q, k, v, _ = _qkv()
    case = CASES["sliding_window"]
    run = jax.jit(lambda local: causal_attention(q, k, v, SEGMENTS, scale=0.3, window=6, local=local, block=8))
    np.testing.assert_allclose(run(True) * VALID, _reference(q, k, v, case) * VALID, atol=2e-6)
    np.testing.assert_allclose(run(False) * VALID, _reference(q, k, v, CASES["causal"]) * VALID, atol=2e-6)


def test_bfloat16_attention_keeps_its_dtype_and_tracks_float32():
    q, k, v, w = _qkv(jnp.bfloat16)
    case = CASES["causal"]
    out = _blocked(q, k, v, case, 8)
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out * VALID, np.float32), _reference(*f32, case) * VALID, atol=3e-2)
    grads = jax.grad(lambda q, k, v: jnp.sum(_blocked(q, k, v, case, 8).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
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


def test_model_logits_do_not_depend_on_the_attention_block():
    cfg = ModelConfig(vocab_size=37, d_model=22, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10,
                      mlp_dim=26, max_seq_len=64)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 37, (2, 32)))
    blocked = Transformer(cfg, ComputeConfig(attention_block=8), rngs=nnx.Rngs(0))(tokens)
    single = Transformer(cfg, ComputeConfig(attention_block=0), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(blocked, single, atol=1e-5)


@pytest.mark.parametrize("shapes", [((3, 5, 4), (4, 9), 1), ((3, 5, 9), (9, 4), 1), ((3, 5, 3, 2), (3, 2, 7), 2)],
                         ids=["narrow_input", "narrow_output", "two_contracted_axes"])
def test_dense_gradients_equal_autodiff_of_a_plain_contraction(shapes):
    x_shape, w_shape, n_in = shapes
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.standard_normal(x_shape)), jnp.asarray(rng.standard_normal(w_shape))
    out_shape = x_shape[: len(x_shape) - n_in] + w_shape[n_in:]
    probe = jnp.asarray(rng.standard_normal(out_shape))

    def plain(x, w):
        return jnp.tensordot(x, w, axes=n_in)

    np.testing.assert_allclose(dense(x, w, n_in), plain(x, w), rtol=1e-6)
    g_plain = jax.grad(lambda x, w: jnp.sum(plain(x, w) * probe), argnums=(0, 1))(x, w)
    g_dense = jax.grad(lambda x, w: jnp.sum(dense(x, w, n_in) * probe), argnums=(0, 1))(x, w)
    for a, b in zip(g_plain, g_dense):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_gradients_equal_autodiff(activation):
    from engine.ops.dense import gated_mlp
    from engine.models.transformer import ACTIVATIONS

    act = ACTIVATIONS[activation]
    rng = np.random.default_rng(2)
    x, wg, wu, wd, probe = (jnp.asarray(rng.standard_normal(s)) for s in [(2, 7, 5), (5, 11), (5, 11), (11, 5), (2, 7, 5)])

    def plain(x, wg, wu, wd):
        return (act(x @ wg) * (x @ wu)) @ wd

    np.testing.assert_allclose(gated_mlp(x, wg, wu, wd, act), plain(x, wg, wu, wd), rtol=1e-6)
    g_plain = jax.grad(lambda *a: jnp.sum(plain(*a) * probe), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    g_fast = jax.grad(lambda *a: jnp.sum(gated_mlp(*a, act) * probe), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], g_plain, g_fast):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
