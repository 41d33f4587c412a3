"""The keys torch.topk picks on CPU, ties included, in JAX (DSA's `indexer_ties: torch_cpu`).

torch.topk on CPU (ATen's topk_impl_loop) fills a vector of (value, index) pairs of a row of
n and runs libstdc++'s std::partial_sort to k when k * 64 <= n, else std::nth_element to
k - 1, comparing values only; the first k pairs are its choice. Among values that tie at the
k-th, which ones land in the first k depends on those algorithms' swaps, not on the keys'
order (transformers' DSA indexer, whose scores tie at exactly 0 where every head's ReLU is 0,
takes what they leave). This replays them exactly:

- nth_element is introselect: while the range [first, last) is over 3 long (and the depth
  budget 2 * floor(log2 n) lasts), move the median of (first + 1, mid, last - 1) to first,
  Hoare-partition the rest around it, keep the side holding the k-th. The partition runs here
  in one data-parallel step: its left scan stops at the values not above the pivot (L_0, L_1,
  ... in order), its right scan at those not below it (R_0, R_1, ... from the end, the pivot
  itself last); round j swaps L_j and R_j while L_j < R_j, and the first round m where not
  returns min(L_m, R_(m-1)), the left scan's stop (at an R already swapped, or an L). The last
  3 or fewer go through a stable insertion sort; an exhausted depth budget a heap select.
- partial_sort is a heap select: a min-heap of the first k, each later value above its top
  replacing it (sequential, as the library's).

Shapes: one row (n,) with its length `n_valid` (the positions after it are not in the row);
vmapped over the rest by the caller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _above(a, b):
    """The library's comparator for largest: a before b (NaN first; the scores have none)."""
    return a > b


def _adjust_heap(values, q, first, hole, length, value):
    """libstdc++'s __adjust_heap on q[first:first + length]: sift the hole down, push `value` up."""
    top = hole

    def down_cond(state):
        _, _, second = state
        return second < (length - 1) // 2

    def down(state):
        q, hole, second = state
        second = 2 * (second + 1)
        second = jnp.where(_above(values[q[first + second]], values[q[first + second - 1]]), second - 1, second)
        q = q.at[first + hole].set(q[first + second])
        return q, second, second

    q, hole, second = jax.lax.while_loop(down_cond, down, (q, hole, hole))
    last_child = ((length & 1) == 0) & (second == (length - 2) // 2)
    child = 2 * (second + 1) - 1
    q = jnp.where(last_child, q.at[first + hole].set(q[first + child]), q)
    hole = jnp.where(last_child, child, hole)

    def up_cond(state):
        q, hole = state
        return (hole > top) & _above(values[q[first + (hole - 1) // 2]], values[value])

    def up(state):
        q, hole = state
        parent = (hole - 1) // 2
        return q.at[first + hole].set(q[first + parent]), parent

    q, hole = jax.lax.while_loop(up_cond, up, (q, hole))
    return q.at[first + hole].set(value)


def _heap_select(values, q, first, middle, last):
    """libstdc++'s __heap_select: the first middle - first of [first, last) by a min-heap."""
    length = middle - first

    def make(i, q):
        parent = (length - 2) // 2 - i
        return _adjust_heap(values, q, first, parent, length, q[first + parent])

    q = jax.lax.fori_loop(0, jnp.where(length < 2, 0, (length - 2) // 2 + 1), make, q)

    def scan(i, q):
        def pop(q):
            value = q[i]
            return _adjust_heap(values, q.at[i].set(q[first]), first, 0, length, value)

        return jax.lax.cond(_above(values[q[i]], values[q[first]]), pop, lambda q: q, q)

    return jax.lax.fori_loop(middle, last, scan, q)


def _partition(values, q, first, last):
    """One introselect step on [first, last): the pivot moved to first, the Hoare partition's
    swaps done at once, and its cut."""
    n = q.shape[0]
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    va, vb, vc = values[q[a]], values[q[b]], values[q[c]]
    median = jnp.where(
        _above(va, vb),
        jnp.where(_above(vb, vc), b, jnp.where(_above(va, vc), c, a)),
        jnp.where(_above(va, vc), a, jnp.where(_above(vb, vc), c, b)),
    )
    q = q.at[first].set(q[median]).at[median].set(q[first])
    pivot = values[q[first]]
    at = jnp.arange(n)
    v = values[q]
    left = (at > first) & (at < last) & ~_above(v, pivot)  # the left scan's stops, in order
    right = (at >= first) & (at < last) & ~_above(pivot, v)  # the right scan's, from the end
    left_rank = jnp.cumsum(left) - 1
    right_rank = jnp.cumsum(right[::-1])[::-1] - 1
    big = n + 1
    left_at = jnp.full((n + 1,), big).at[jnp.where(left, left_rank, n)].set(at, mode="drop")
    right_at = jnp.full((n + 1,), -1).at[jnp.where(right, right_rank, n)].set(at, mode="drop")
    left_at, right_at = left_at.at[n].set(big), right_at.at[n].set(-1)
    m = jnp.argmax(left_at >= right_at)  # the round that does not swap
    cut = jnp.where(m == 0, left_at[0], jnp.minimum(left_at[m], right_at[jnp.maximum(m - 1, 0)]))
    swapped_left = left & (left_rank < m)
    swapped_right = right & (right_rank < m)
    # a position is never swapped twice: an L_j that is also an R_i has i >= m or j >= m
    partner = jnp.where(swapped_left, right_at[jnp.clip(left_rank, 0, n)], left_at[jnp.clip(right_rank, 0, n)])
    return jnp.where(swapped_left | swapped_right, q[jnp.clip(partner, 0, n - 1)], q), cut


def _nth_element(values, q, nth, last):
    """libstdc++'s std::nth_element(q, q + nth, q + last) by `values`, descending."""

    def cond(state):
        _, first, last, depth = state
        return (last - first > 3) & (depth > 0)

    def body(state):
        q, first, last, depth = state
        q, cut = _partition(values, q, first, last)
        return q, jnp.where(cut <= nth, cut, first), jnp.where(cut <= nth, last, cut), depth - 1

    depth = 2 * (jnp.floor(jnp.log2(jnp.maximum(last, 1).astype(jnp.float32))).astype(jnp.int32))
    q, first, last, depth = jax.lax.while_loop(cond, body, (q, jnp.int32(0), last, depth))

    def heap(q):  # the depth budget spent: a heap select, the nth put first
        q = _heap_select(values, q, first, nth + 1, last)
        return q.at[first].set(q[nth]).at[nth].set(q[first])

    def insertion(q):  # 3 or fewer: stably by value, descending
        at = jnp.arange(q.shape[0])
        inside = (at >= first) & (at < last)
        v = values[q]
        before = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (at[None, :] < at[:, None]))
        rank = first + jnp.sum(inside[None, :] & inside[:, None] & before, axis=1)
        return q.at[jnp.where(inside, rank, at)].set(q)

    return jax.lax.cond(last - first > 3, heap, insertion, q)


def torch_cpu_top_k(values_n, k: int, n_valid):
    """(k,) int32: the positions torch.topk(values[:n_valid], min(k, n_valid)) picks on CPU
    (in no particular order); where k > n_valid, also positions from n_valid on (the caller
    masks them)."""
    n = values_n.shape[0]
    q = jnp.arange(n, dtype=jnp.int32)
    n_valid = jnp.asarray(n_valid, jnp.int32)
    if k >= n:
        return q[:k]

    def select(q):
        return jax.lax.cond(
            k * 64 <= n_valid,
            lambda q: _heap_select(values_n, q, 0, k, n_valid),
            lambda q: _nth_element(values_n, q, k - 1, n_valid),
            q,
        )

    q = jax.lax.cond(k < n_valid, select, lambda q: q, q)
    return q[:k]
