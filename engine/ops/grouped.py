"""The grouped matmul of the dropless mixture of experts: rows sorted by group (expert), each
group's rows times that group's matrix, `jax.lax.ragged_dot`'s function.

On GPU and TPU `ragged_dot` lowers to grouped kernels (megablox on TPU) and is used as is. On
XLA:CPU it costs about as much as multiplying every row by every group's matrix (at the
bench.moe shape its three products took 72% of a training step, docs/benchmarks.md). There
the product runs as megablox does it on TPU, in plain XLA: the rows are cut into tiles (128
rows; fewer for few rows, tile_rows); each (tile, group) pair that holds rows of the group
-- at most tiles + groups - 1 of them, a static count -- is one product of the tile by the
group's matrix, rows of other groups masked to zero; the pairs are one batched matmul
(YNNPACK's, bf16 on the CPU's bf16 instructions), summed back into their tiles. The work is
the routed rows' plus at most one partial tile per group boundary.

The backward pass is written out (a custom VJP) so that it keeps only the operands and the
group sizes, not the per-pair gathered copies: the input gradient is the same tiled product
with the transposed matrices, the matrices' gradient a batched product per pair summed into
its group.

Rows past the sum of the group sizes get zeros, and no gradient, as in `ragged_dot`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.ops.partitioning import current_platform

TILE = 128  # the most rows per tile (bench.moe's shape, docs/benchmarks.md)
MIN_TILE = 8


def tile_rows(m: int, groups: int) -> int:
    """Rows per tile for m rows in `groups` groups: the power of two at or above the mean
    group size, within [MIN_TILE, TILE], so that few rows (a decode step's) are not padded to
    a training step's tiles: the padding is at most a tile per group boundary."""
    mean = max(1, -(-m // max(groups, 1)))
    return max(MIN_TILE, min(TILE, 1 << (mean - 1).bit_length()))


def grouped_matmul(x_md, w_gij, group_sizes_g):
    """(m, i) rows grouped by `group_sizes_g` (g,) times (g, i, j) matrices -> (m, j), in
    x's dtype (float32 accumulation). On CPU the tiled product, elsewhere `ragged_dot`."""
    if current_platform() == "cpu":
        return tiled_grouped_matmul(x_md, w_gij, group_sizes_g)
    return jax.lax.ragged_dot(x_md, w_gij, group_sizes_g)


def tiled_grouped_matmul(x_md, w_gij, group_sizes_g, tile: int | None = None):
    """`ragged_dot(x_md, w_gij, group_sizes_g)` as a batched matmul over (tile, group) pairs;
    `tile` rows per tile (default: tile_rows)."""
    if x_md.ndim != 2 or w_gij.ndim != 3 or x_md.shape[1] != w_gij.shape[1]:
        raise ValueError(f"grouped matmul of {x_md.shape} rows by {w_gij.shape} matrices: want (m, i) and (g, i, j)")
    tile = tile or tile_rows(x_md.shape[0], w_gij.shape[0])
    x_md, w_gij, group_sizes_g = _same_varying_axes(x_md, w_gij, group_sizes_g.astype(jnp.int32))
    return _tiled(x_md, w_gij, group_sizes_g, tile)


def _same_varying_axes(*arrays):
    """Inside shard_map: each operand marked as varying over every manual mesh axis that any
    of them varies over. A custom VJP's gradients must vary as its inputs do; marked here,
    outside it, a weight's gradient is summed over the axes the weight was cast over (the
    transpose of the cast), as autodiff does for an operand it broadcasts."""
    def varying(a):
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        return frozenset() if mat is None else mat.varying

    union = frozenset().union(*map(varying, arrays))
    return tuple(jax.lax.pcast(a, tuple(sorted(union - varying(a))), to="varying") if union - varying(a) else a
                 for a in arrays)


def _pairs(group_sizes_g, m: int, tile: int):
    """The (tile, group) pairs, padded to the static bound tiles + groups - 1: each pair's
    group, tile and (pair, row) mask of the tile's rows that belong to the group."""
    g = group_sizes_g.shape[0]
    tiles = -(-m // tile)
    ends = jnp.cumsum(group_sizes_g)
    starts = ends - group_sizes_g
    first = starts // tile
    touched = jnp.where(group_sizes_g > 0, (jnp.maximum(ends, 1) - 1) // tile - first + 1, 0)
    upto = jnp.cumsum(touched)
    pair = jnp.arange(tiles + g - 1)
    group = jnp.searchsorted(upto, pair, side="right")  # the group whose pairs cover `pair`
    valid = group < g
    group = jnp.minimum(group, g - 1)
    tile_id = jnp.clip(first[group] + pair - (upto - touched)[group], 0, tiles - 1)
    rows = tile_id[:, None] * tile + jnp.arange(tile)
    mask = valid[:, None] & (rows >= starts[group][:, None]) & (rows < ends[group][:, None])
    return group, tile_id, mask


def _gather_tiles(a_md, tile_id, mask, tile: int):
    """a's rows as (pairs, tile, cols): each pair's tile, rows outside its group zeroed."""
    m, cols = a_md.shape
    tiles = -(-m // tile)
    a = jnp.pad(a_md, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, cols)[tile_id]
    return jnp.where(mask[..., None], a, jnp.zeros((), a.dtype))


def _scatter_tiles(a_ptj, tile_id, m: int, tile: int):
    """The pairs' (pairs, tile, cols) products summed back into (m, cols) rows."""
    tiles, cols = -(-m // tile), a_ptj.shape[-1]
    out = jnp.zeros((tiles, tile, cols), a_ptj.dtype).at[tile_id].add(a_ptj, indices_are_sorted=True)
    return out.reshape(tiles * tile, cols)[:m]


def _batched(a, b, contract_a: int, contract_b: int):
    """Per pair (axis 0): a . b over the given axes, float32 accumulation."""
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)


def _product(x_md, w_gij, group, tile_id, mask, tile: int):
    x_pti = _gather_tiles(x_md, tile_id, mask, tile)
    y_ptj = _batched(x_pti, w_gij[group], 2, 1)
    return _scatter_tiles(y_ptj, tile_id, x_md.shape[0], tile).astype(jnp.result_type(x_md, w_gij))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_md, w_gij, group_sizes_g, tile):
    return _product(x_md, w_gij, *_pairs(group_sizes_g, x_md.shape[0], tile), tile)


def _tiled_fwd(x_md, w_gij, group_sizes_g, tile):
    return _tiled(x_md, w_gij, group_sizes_g, tile), (x_md, w_gij, group_sizes_g)


def _tiled_bwd(tile, residuals, dy_mj):
    x_md, w_gij, group_sizes_g = residuals
    group, tile_id, mask = _pairs(group_sizes_g, x_md.shape[0], tile)
    dy_mj = dy_mj.astype(jnp.result_type(x_md, w_gij))
    dy_ptj = _gather_tiles(dy_mj, tile_id, mask, tile)
    dx_pti = _batched(dy_ptj, w_gij[group], 2, 2)  # dy . w^T
    dx = _scatter_tiles(dx_pti, tile_id, x_md.shape[0], tile).astype(x_md.dtype)
    x_pti = _gather_tiles(x_md, tile_id, mask, tile)
    # x^T . dy per pair, summed per group; the narrower operand first (XLA:CPU transposes the
    # first operand of a product contracted on its major axis, engine/ops/dense.py).
    if x_md.shape[1] <= dy_mj.shape[1]:
        dw_pij = _batched(x_pti, dy_ptj, 1, 1)
    else:
        dw_pij = _batched(dy_ptj, x_pti, 1, 1).transpose(0, 2, 1)
    dw = jnp.zeros(w_gij.shape, jnp.float32).at[group].add(dw_pij, indices_are_sorted=True)
    return dx, dw.astype(w_gij.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
