"""The tiled grouped matmul and the experts' MLP (engine/ops/grouped.py) against
`jax.lax.ragged_dot`, the function they stand in for on CPU: values and gradients, for group
layouts that cross tiles, leave groups empty and leave rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.models.moe import dropless_experts
from engine.ops import grouped
from engine.ops.grouped import grouped_mlp, tiled_grouped_matmul

LAYOUTS = {
    # group sizes, rows, tile
    "boundaries inside tiles, empty groups first, between and last": ([0, 5, 37, 0, 1, 20, 0], 70, 16),
    "rows past the groups, a partial last tile": ([9, 0, 30], 50, 8),
    "one group, tile larger than the rows": ([0, 23, 0], 23, 128),
    "every group a whole tile": ([8, 8, 8, 8], 32, 8),
    "the default tile for few rows": ([3, 0, 12, 9, 1], 30, None),
}


def _ragged(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def _loss(fn, x, w, sizes, dy):
    return jnp.sum(fn(x, w, sizes).astype(jnp.float32) * dy)


@pytest.fixture(params=["batched", "looped"])
def form(request, monkeypatch):
    """Both forms of the tiled product: one batched matmul over per-tile copies of the
    matrices, and the tile loop that takes over where the copies would be too large."""
    if request.param == "looped":
        monkeypatch.setattr(grouped, "LOOP_ABOVE_BYTES", 0)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_and_gradients_equal_ragged_dot(layout, form):
    sizes, m, tile = LAYOUTS[layout]
    rng = np.random.default_rng(len(layout))
    x = jnp.asarray(rng.normal(size=(m, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), 24, 40)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(m, 40)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    tiled = jax.jit(lambda x, w, s: tiled_grouped_matmul(x, w, s, tile))

    np.testing.assert_allclose(tiled(x, w, sizes), _ragged(x, w, sizes), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda x, w: _loss(tiled, x, w, sizes, dy), argnums=(0, 1)))(x, w)
    want = jax.grad(lambda x, w: _loss(_ragged, x, w, sizes, dy), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    total = int(sizes.sum())
    assert not np.any(np.asarray(tiled(x, w, sizes))[total:])  # rows past the groups: zeros
    assert not np.any(np.asarray(got[0])[total:])  # and no gradient


def test_the_experts_mlp_with_biases_equals_three_ragged_dots(form):
    sizes, m = [0, 5, 37, 0, 1, 20, 0], 70  # rows past the groups too
    g, d, f = len(sizes), 16, 24
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((g, d, f), (g, d, f), (g, f, d))]
    bs = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((g, f), (g, f), (g, d))]
    sizes = jnp.asarray(sizes, jnp.int32)
    total = int(sizes.sum())
    group = jnp.repeat(jnp.arange(g), sizes, total_repeat_length=total)

    def glu(gate, up):
        return jax.nn.silu(gate) * up

    def reference(x, ws, bs):
        gate = _ragged(x, ws[0], sizes)[:total] + bs[0][group]
        hidden = glu(gate, _ragged(x, ws[1], sizes)[:total] + bs[1][group])
        return _ragged(jnp.pad(hidden, ((0, m - total), (0, 0))), ws[2], sizes)[:total] + bs[2][group]

    def ours(x, ws, bs):
        return grouped_mlp(x, sizes, *ws, glu, bs)[:total]  # rows past the groups are not defined

    dy = jnp.asarray(rng.normal(size=(total, d)), jnp.float32)
    np.testing.assert_allclose(jax.jit(ours)(x, ws, bs), reference(x, ws, bs), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * dy), argnums=(0, 1, 2)))(x, ws, bs)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * dy), argnums=(0, 1, 2))(x, ws, bs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0])[total:])  # rows past the groups get no gradient


def test_bf16_keeps_its_dtype_and_accumulates_in_float32(form):
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([40, 0, 88], jnp.int32)
    x = jnp.asarray(rng.normal(size=(128, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 256, 32)), jnp.bfloat16)
    y = jax.jit(tiled_grouped_matmul)(x, w, sizes)
    assert y.dtype == jnp.bfloat16
    # Within one bf16 rounding of the float32 product: accumulated in float32, rounded once.
    want = np.asarray(_ragged(x, w, sizes))
    assert np.all(np.abs(np.asarray(y, np.float32) - want) <= np.abs(want) * 2.0**-8 + 1e-6)
    dx, dw = jax.jit(
        jax.grad(lambda x, w: jnp.sum(tiled_grouped_matmul(x, w, sizes).astype(jnp.float32)), argnums=(0, 1))
    )(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_the_cpu_dropless_experts_run_the_tiled_product_not_ragged_dot():
    rng = np.random.default_rng(2)
    n, k, d, f, e = 64, 2, 16, 24, 4
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]

    def glu(gate, up):
        return jax.nn.silu(gate) * up

    def run(x, *ws):
        return dropless_experts(x, experts, weights, *ws, glu)

    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) ** 2), argnums=(0, 1, 2, 3))).lower(x, *ws).as_text()
    assert "ragged" not in hlo
    # The per-token definition: each token's k experts, weighted.
    want = sum(
        weights[:, j, None]
        * jnp.einsum(
            "nf,nfd->nd",
            glu(jnp.einsum("nd,ndf->nf", x, ws[0][experts[:, j]]), jnp.einsum("nd,ndf->nf", x, ws[1][experts[:, j]])),
            ws[2][experts[:, j]],
        )
        for j in range(k)
    )
    np.testing.assert_allclose(jax.jit(run)(x, *ws), want, rtol=1e-5, atol=1e-5)


def test_the_loop_takes_over_where_the_per_tile_copies_would_be_too_large(monkeypatch):
    """The batched form is one batched matmul (a dot with a batch dimension, over per-tile
    copies of the matrices); past LOOP_ABOVE_BYTES of copies the loop runs instead, whose
    products have no batch dimension (each reads one matrix in place)."""
    x, w = jnp.zeros((300, 64), jnp.float32), jnp.zeros((6, 64, 96), jnp.float32)
    sizes = jnp.asarray([50, 50, 50, 50, 50, 50], jnp.int32)

    def hlo():
        return (
            jax.jit(jax.grad(lambda x, w, s: jnp.sum(tiled_grouped_matmul(x, w, s)), argnums=(0, 1)))
            .lower(x, w, sizes)
            .compile()
            .as_text()
        )

    assert "lhs_batch_dims={0}" in hlo()
    tiles = -(-(300 + 6 * 63) // 64)  # tiles of 64 rows
    monkeypatch.setattr(grouped, "LOOP_ABOVE_BYTES", tiles * 64 * 96 * 4 - 1)  # just under the copies' bytes
    assert "lhs_batch_dims" not in hlo()


def test_refuses_operands_that_do_not_line_up():
    with pytest.raises(ValueError, match=r"\(5, 3\) rows by \(2, 4, 6\) matrices"):
        tiled_grouped_matmul(jnp.zeros((5, 3)), jnp.zeros((2, 4, 6)), jnp.asarray([2, 3]))
