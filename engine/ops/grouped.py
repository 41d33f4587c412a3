"""The grouped matmuls of the dropless mixture of experts: rows sorted by group (expert), each
group's rows times that group's matrix, `jax.lax.ragged_dot`'s function; and the experts'
gated MLP built from three of them.

On GPU and TPU `ragged_dot` lowers to grouped kernels (megablox on TPU) and is used as is. On
XLA:CPU it costs about as much as multiplying every row by every group's matrix (at the
bench.moe shape its three products took 72% of a training step, docs/benchmarks.md). There
the rows move once into a tile-aligned layout, as megablox lays them out on TPU: each
group's rows start at a multiple of `tile` rows (128; fewer for few rows, tile_rows) and the
gap to the next group is zeros, so every tile belongs to one group. A product is then one
batched matmul over the tiles, each tile times its group's matrix (YNNPACK's batched
kernel, bf16 on the CPU's bf16 instructions). The padded rows cost at most one partial tile
per group; the layout has a static size (rows + groups x (tile - 1), rounded up to tiles).
The experts' MLP (grouped_mlp) keeps its hidden activations in that layout between its
three products, and the rows come back once at the end.

The backward pass of a tiled product is written out (a custom VJP) so that it keeps only its
operands, not the per-tile copies of the group matrices: the input gradient is the same
product with the matrices transposed, the matrices' gradient a batched product per tile
summed into its group. Where those copies would pass LOOP_ABOVE_BYTES (many or wide
experts), the product and its gradients loop over the tiles instead, reading each group's
matrix in place.

Rows past the sum of the group sizes get zeros, and no gradient, as in `ragged_dot`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from engine.ops.partitioning import current_platform

TILE = 128  # the most rows per tile (bench.moe's shape, docs/benchmarks.md)
MIN_TILE = 8


def tile_rows(m: int, groups: int) -> int:
    """Rows per tile for m rows in `groups` groups: the power of two at or above the mean
    group size, within [MIN_TILE, TILE], so that few rows (a decode step's) are not padded to
    a training step's tiles."""
    mean = max(1, -(-m // max(groups, 1)))
    return max(MIN_TILE, min(TILE, 1 << (mean - 1).bit_length()))


def tiled_grouped_matmul(x_md, w_gij, group_sizes_g, tile: int | None = None):
    """`ragged_dot(x_md, w_gij, group_sizes_g)`: (m, i) rows grouped by `group_sizes_g` (g,)
    times (g, i, j) matrices -> (m, j) in x's dtype (float32 accumulation), through the
    tile-aligned layout; `tile` rows per tile (default: tile_rows). One product alone; the
    experts' MLP is grouped_mlp."""
    _check(x_md, w_gij)
    layout = Layout.of(group_sizes_g, x_md.shape[0], tile)
    return layout.rows_of(layout.matmul(layout.aligned(x_md), w_gij))


def grouped_mlp(
    x_md, group_sizes_g, w_gate_gdf, w_up_gdf, w_down_gfd, glu: Callable, biases=None, down_sum: Callable | None = None
):
    """Each row's group's gated MLP, rows sorted by group:
    down_sum(glu(x . w_gate + b_gate, x . w_up + b_up) . w_down) + b_down, with `biases` None or
    (b_gate (g, f), b_up (g, f), b_down (g, d)) and `down_sum` a sum of partial products (a
    psum over a tensor axis) or None. Rows past the groups are not defined."""
    _check(x_md, w_gate_gdf)
    if current_platform() != "cpu":
        sizes = group_sizes_g.astype(jnp.int32)
        row_group = jnp.minimum(
            jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x_md.shape[0]), side="right"), sizes.shape[0] - 1
        )
        bias = (lambda i: 0.0) if biases is None else (lambda i: biases[i][row_group])  # noqa: E731
        gate = jax.lax.ragged_dot(x_md, w_gate_gdf, sizes) + bias(0)
        hidden = glu(gate, jax.lax.ragged_dot(x_md, w_up_gdf, sizes) + bias(1))
        y_md = jax.lax.ragged_dot(hidden, w_down_gfd, sizes)
        return (down_sum(y_md) if down_sum else y_md) + bias(2)
    layout = Layout.of(group_sizes_g, x_md.shape[0])
    x_pd = layout.aligned(x_md)
    bias = (lambda i: 0.0) if biases is None else (lambda i: layout.per_row(biases[i]))  # noqa: E731
    gate = layout.matmul(x_pd, w_gate_gdf) + bias(0)
    hidden = glu(gate, layout.matmul(x_pd, w_up_gdf) + bias(1))
    y_md = layout.rows_of(layout.matmul(hidden, w_down_gfd))
    if down_sum:
        y_md = down_sum(y_md)
    return y_md + (0.0 if biases is None else biases[2][layout.row_group])


def _check(x_md, w_gij):
    if x_md.ndim != 2 or w_gij.ndim != 3 or x_md.shape[1] != w_gij.shape[1]:
        raise ValueError(f"grouped matmul of {x_md.shape} rows by {w_gij.shape} matrices: want (m, i) and (g, i, j)")


class Layout:
    """Where m rows sorted by group go in the tile-aligned layout of `padded` rows: row r at
    `position[r]` (`padded`, out of range, for rows past the groups), tile q of group
    `tile_group[q]`; `row_group[r]` each row's group (the last for rows past the groups)."""

    def __init__(self, position, row_group, tile_group, padded: int, tile: int):
        self.position, self.row_group, self.tile_group = position, row_group, tile_group
        self.padded, self.tile = padded, tile

    @classmethod
    def of(cls, group_sizes_g, m: int, tile: int | None = None) -> Layout:
        g = group_sizes_g.shape[0]
        tile = tile or tile_rows(m, g)
        sizes = group_sizes_g.astype(jnp.int32)
        ends = jnp.cumsum(sizes)
        aligned_sizes = -(-sizes // tile) * tile
        aligned_ends = jnp.cumsum(aligned_sizes)
        padded = -(-(m + g * (tile - 1)) // tile) * tile  # sum of aligned sizes, at most
        rows = jnp.arange(m)
        group = jnp.searchsorted(ends, rows, side="right")
        row_group = jnp.minimum(group, g - 1)
        position = jnp.where(
            group < g, (aligned_ends - aligned_sizes)[row_group] + rows - (ends - sizes)[row_group], padded
        )
        tile_group = jnp.minimum(jnp.searchsorted(aligned_ends, jnp.arange(0, padded, tile), side="right"), g - 1)
        return cls(position, row_group, tile_group, padded, tile)

    def aligned(self, x_md):
        """(m, i) rows -> (padded, i), zeros between the groups."""
        return jnp.zeros((self.padded, x_md.shape[1]), x_md.dtype).at[self.position].set(x_md, mode="drop")

    def rows_of(self, y_pj):
        """(padded, j) -> the (m, j) rows, zeros for rows past the groups."""
        return y_pj.at[self.position].get(mode="fill", fill_value=0)

    def per_row(self, v_gj):
        """A per-group vector (g, j) laid out as (padded, j): each tile's group's."""
        return jnp.repeat(v_gj[self.tile_group], self.tile, axis=0)

    def matmul(self, x_pi, w_gij):
        """Each tile of x times its group's matrix: (padded, i) -> (padded, j)."""
        x_pi, w_gij, tile_group = _same_varying_axes(x_pi, w_gij, self.tile_group)
        return _tiled(x_pi, w_gij, tile_group, self.tile)


def _same_varying_axes(*arrays):
    """Inside shard_map: each operand marked as varying over every manual mesh axis that any
    of them varies over. A custom VJP's gradients must vary as its inputs do; marked here,
    outside it, a weight's gradient is summed over the axes the weight was cast over (the
    transpose of the cast), as autodiff does for an operand it broadcasts."""

    def varying(a):
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        return frozenset() if mat is None else mat.varying

    union = frozenset().union(*map(varying, arrays))
    return tuple(
        jax.lax.pcast(a, tuple(sorted(union - varying(a))), to="varying") if union - varying(a) else a for a in arrays
    )


def _dot(a, b, contract_a: int, contract_b: int, batched: bool = False):
    """a . b over the given axes (per tile, axis 0, if `batched`), float32 accumulation."""
    batch = ((0,), (0,)) if batched else ((), ())
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), batch), preferred_element_type=jnp.float32)


def _tiles(a_pi, tile: int):
    return a_pi.reshape(a_pi.shape[0] // tile, tile, a_pi.shape[1])


LOOP_ABOVE_BYTES = 256 << 20
"""The batched product gathers a copy of its group's matrix per tile: past this many bytes of
copies (many experts, or wide ones) the product loops over the tiles instead, reading each
matrix in place. The loop is slower at bench.moe's shape (0.680 against 0.586 s a step,
docs/benchmarks.md) but needs no copies: Qwen3-30B-A3B's 128 experts would copy 3.6 GB per
projection in bf16 for a training batch of 16k tokens."""


def _looped(w_gij, tile_group) -> bool:
    copies = tile_group.shape[0] * w_gij.shape[1] * w_gij.shape[2] * jnp.dtype(w_gij.dtype).itemsize
    return copies > LOOP_ABOVE_BYTES


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_pi, w_gij, tile_group, tile):
    dtype = jnp.result_type(x_pi, w_gij)
    if _looped(w_gij, tile_group):

        def body(q, y_pj):
            x_ti = jax.lax.dynamic_slice_in_dim(x_pi, q * tile, tile)
            w_ij = jax.lax.dynamic_index_in_dim(w_gij, tile_group[q], keepdims=False)
            return jax.lax.dynamic_update_slice_in_dim(y_pj, _dot(x_ti, w_ij, 1, 0).astype(dtype), q * tile, 0)

        return jax.lax.fori_loop(0, tile_group.shape[0], body, jnp.zeros((x_pi.shape[0], w_gij.shape[2]), dtype))
    y = _dot(_tiles(x_pi, tile), w_gij[tile_group], 2, 1, batched=True)
    return y.reshape(x_pi.shape[0], -1).astype(dtype)


def _tiled_fwd(x_pi, w_gij, tile_group, tile):
    return _tiled(x_pi, w_gij, tile_group, tile), (x_pi, w_gij, tile_group)


def _tiled_bwd(tile, residuals, dy_pj):
    x_pi, w_gij, tile_group = residuals
    if _looped(w_gij, tile_group):
        return (*_looped_bwd(x_pi, w_gij, tile_group, tile, dy_pj.astype(jnp.result_type(x_pi, w_gij))), None)
    dy_qtj = _tiles(dy_pj.astype(jnp.result_type(x_pi, w_gij)), tile)
    x_qti = _tiles(x_pi, tile)
    dx = _dot(dy_qtj, w_gij[tile_group], 2, 2, batched=True).reshape(x_pi.shape).astype(x_pi.dtype)  # dy . w^T
    # x^T . dy per tile, summed per group; the narrower operand first (XLA:CPU transposes the
    # first operand of a product contracted on its major axis, engine/ops/dense.py).
    if x_pi.shape[1] <= dy_pj.shape[1]:
        dw_qij = _dot(x_qti, dy_qtj, 1, 1, batched=True)
    else:
        dw_qij = _dot(dy_qtj, x_qti, 1, 1, batched=True).transpose(0, 2, 1)
    dw = jnp.zeros(w_gij.shape, jnp.float32).at[tile_group].add(dw_qij, indices_are_sorted=True)
    return dx, dw.astype(w_gij.dtype), None


def _looped_bwd(x_pi, w_gij, tile_group, tile, dy_pj):
    """The tile loop's gradients: dx = dy . w^T per tile; dw[g] += x^T . dy for each tile of g."""

    def body(q, carry):
        dx_pi, dw_gij = carry
        x_ti = jax.lax.dynamic_slice_in_dim(x_pi, q * tile, tile)
        dy_tj = jax.lax.dynamic_slice_in_dim(dy_pj, q * tile, tile)
        g = tile_group[q]
        w_ij = jax.lax.dynamic_index_in_dim(w_gij, g, keepdims=False)
        dx_pi = jax.lax.dynamic_update_slice_in_dim(dx_pi, _dot(dy_tj, w_ij, 1, 1).astype(dx_pi.dtype), q * tile, 0)
        dw_ij = jax.lax.dynamic_index_in_dim(dw_gij, g, keepdims=False) + _dot(x_ti, dy_tj, 0, 0)
        return dx_pi, jax.lax.dynamic_update_index_in_dim(dw_gij, dw_ij, g, 0)

    dx, dw = jax.lax.fori_loop(
        0, tile_group.shape[0], body, (jnp.zeros(x_pi.shape, x_pi.dtype), jnp.zeros(w_gij.shape, jnp.float32))
    )
    return dx, dw.astype(w_gij.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
