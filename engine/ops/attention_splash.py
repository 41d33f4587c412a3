"""Splash attention on TPUs (`splash`): JAX's Pallas TPU kernel
(jax.experimental.pallas.ops.tpu.splash_attention).

The kernel skips every (query block, key block) tile its static mask leaves empty: the
upper triangle, and on a sliding-window layer everything left of the window. Packed
documents are its segment ids, grouped-query heads its multi-head mode (query heads share
kv heads in groups), the logit soft-cap its `attn_logits_soft_cap`, attention sinks
(GPT-OSS) its `sinks`. It wants the sequence length a multiple of 128 (`unsupported` says
so; auto attention then falls back to `blocked`).

The kernel is a Pallas call, which XLA's partitioner cannot split: under a mesh it runs in
a shard_map, batch split as the `act_batch` rule says and heads as `act_heads` (when the kv
heads divide the tensor axis). Off TPU it runs in the Pallas interpreter: exact and slow,
what the tests use to check it on CPU.

Under context parallelism (a mesh `context` axis of C devices, engine/ops/attention.py) each
device holds t / C of its rows' queries. The kernel is then made once for the whole (t, t)
mask with `q_seq_shards` = C (and `head_shards` = the head split), and its block-sparsity
tables go into the shard_map split the same way (`manual_sharding_spec`), as MaxText does:
each device's kernel skips the tiles its own rows of the mask leave empty. The device
all-gathers its rows' keys, values and key segment ids over `context` inside the shard_map,
so their gradients are reduce-scattered back.

With positions in order the last shard's rows see the most keys, and it bounds the step.
Where each shard's two half-chunks are whole 128-lane blocks (`balanced`), the queries take
MaxText's load-balanced layout instead: the sequence is cut into 2C half-chunks and shard d
computes half-chunks d and 2C - 1 - d, an early and a late one, so every shard computes the
same number of tiles. The half-chunks travel there and back by two ppermutes inside the
shard_map (the keys stay in order), and the mask's rows (`q_sequence`) are the positions in
that order.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine.ops.partitioning import current_mesh, kernel_axes, mesh_axis_size

LANES = 128  # the kernel's key blocks are multiples of the TPU's 128 lanes


def unsupported(*, seq_len: int, context: int = 1) -> str | None:
    """Why splash attention cannot take this case (None if it can); `context`: the shards the
    queries are split into."""
    if seq_len % LANES:
        return f"splash attention needs the sequence length a multiple of {LANES}, not {seq_len}"
    if (seq_len // context) % LANES:
        return (
            f"splash attention needs each context shard's {seq_len // context} positions (mesh axis "
            f"context={context}) a multiple of {LANES}"
        )
    return None


def _block(t: int) -> int:
    return next(b for b in (512, 256, LANES) if t % b == 0)


TUNING: dict[str, Any] = {}
"""BlockSizes fields set over `block_sizes`' choice (`block_q`, `block_kv_compute`,
`use_fused_bwd_kernel`, ...): empty in a run; bench/tpu_v5e.py's `--splash` sets it to
measure a choice on the chip. A size larger than the sequence is taken down to it."""


def block_sizes(b: int) -> splash.BlockSizes:
    """The kernel's tiles for a sequence whose block is `b` (`_block`): `b` everywhere (MaxText's
    default on TPU is 512 for each), then TUNING over it. `use_fused_bwd_kernel` (dq with dk
    and dv in one pass over the blocks, where the split kernels compute every block's
    probabilities twice) took qwen3-0.6b's step on a v5e chip from 0.831 to 0.774 s
    (bench/results/tpu-v5e.json), but compiled for two slices with data over them it sent
    about twice the gradient all-reduce's bytes over DCN (tests/test_multislice_plan.py), so
    it is not the default until that is understood. It takes no dq blocks."""
    sizes: dict[str, Any] = dict.fromkeys(
        ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"), b
    )
    sizes |= {"block_q_dq": b, "block_kv_dq": b}
    sizes |= TUNING
    if sizes.get("use_fused_bwd_kernel"):
        sizes["block_q_dq"] = sizes["block_kv_dq"] = None
    return splash.BlockSizes(**sizes)


def balanced(t: int, shards: int) -> bool:
    """Whether `shards` context shards of a `t`-position sequence take the load-balanced layout:
    each shard's two half-chunks whole 128-lane blocks."""
    return shards > 1 and t % (2 * shards) == 0 and (t // (2 * shards)) % LANES == 0


def balanced_order(t: int, shards: int) -> np.ndarray:
    """The positions in the load-balanced layout: shard d holds half-chunks d and 2C - 1 - d
    of the 2C the sequence is cut into (an early and a late one), so every shard's queries see
    about as many keys as another's."""
    chunks = np.arange(t, dtype=np.int32).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * shards - 1 - d]]) for d in range(shards)])


def _kernel(
    heads: int,
    t: int,
    window: int | None,
    softcap: float | None,
    interpret: bool,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    rows: np.ndarray | None = None,
):
    """The kernel for one example: q (heads, t, h), k and v (kv heads, t, h); its tables split
    into head_shards x q_seq_shards parts (a shard_map's); `rows`: the query positions in the
    order the queries come (default: 0..t-1). Built per trace: it holds its block-sparsity
    tables as arrays of the trace it was made in."""
    head_mask: splash.CausalMask | splash.LocalMask
    if window is None:
        head_mask = splash.CausalMask((t, t))
    else:  # query i sees keys [i - window + 1, i]
        head_mask = splash.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    if rows is not None:  # the mask's rows are these positions, as MaxText's load-balanced causal mask
        head_mask.q_sequence = rows
    b = _block(t // q_seq_shards // (1 if rows is None else 2))
    sizes = block_sizes(b)
    return splash.make_splash_mha(
        splash.MultiHeadMask([head_mask] * heads),
        block_sizes=sizes,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )


def _exchanges(shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each shard's first and second half-chunk go in the balanced layout (ppermute
    pairs): half-chunk j goes to shard j if j < C, else to 2C - 1 - j."""
    to = lambda j: j if j < shards else 2 * shards - 1 - j  # noqa: E731
    return [(d, to(2 * d)) for d in range(shards)], [(d, to(2 * d + 1)) for d in range(shards)]


def _to_balanced(x, axis: int, shards: int):
    """A shard's t / C positions (half-chunks 2d, 2d + 1) -> its balanced ones (d, 2C - 1 - d),
    inside a shard_map over `context`. Every even half-chunk travels by one ppermute, every odd
    one by another; on an even shard the early half-chunk is the even one."""
    first, second = jnp.split(x, 2, axis=axis)
    evens, odds = _exchanges(shards)
    got_even, got_odd = jax.lax.ppermute(first, "context", evens), jax.lax.ppermute(second, "context", odds)
    even = jax.lax.axis_index("context") % 2 == 0
    return jnp.concatenate([jnp.where(even, got_even, got_odd), jnp.where(even, got_odd, got_even)], axis=axis)


def _from_balanced(y, axis: int, shards: int):
    """The inverse of _to_balanced: each half-chunk back to the shard it came from."""
    early, late = jnp.split(y, 2, axis=axis)
    evens, odds = _exchanges(shards)
    even = jax.lax.axis_index("context") % 2 == 0
    back = lambda pairs: [(b, a) for a, b in pairs]  # noqa: E731
    first = jax.lax.ppermute(jnp.where(even, early, late), "context", back(evens))
    second = jax.lax.ppermute(jnp.where(even, late, early), "context", back(odds))
    return jnp.concatenate([first, second], axis=axis)


def _apply(kernel, q_bnth, k_bkth, v_bkth, segment_ids_bt, key_segment_ids_bs, sinks_n):
    """`kernel` on each example; the keys' segment ids are the queries' unless given."""
    if segment_ids_bt is None:
        return jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks_n))(q_bnth, k_bkth, v_bkth)
    keys = segment_ids_bt if key_segment_ids_bs is None else key_segment_ids_bs
    segments = splash.SegmentIds(segment_ids_bt, keys)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, s, sinks=sinks_n))(q_bnth, k_bkth, v_bkth, segments)


def splash_attention(
    q_btnh,
    k_bskh,
    v_bskh,
    segment_ids_bt=None,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    interpret: bool = False,
    sinks_n=None,
    context: int = 1,
):
    """Causal grouped-query attention with the splash kernel; (b, t, n, h) in the dtype of q.
    `sinks_n` (n,): attention sinks (GPT-OSS), the kernel's `sinks`. `context` > 1: the
    current mesh splits the positions over its `context` axis (module docstring)."""
    q_bnth = (q_btnh * scale).astype(q_btnh.dtype).transpose(0, 2, 1, 3)  # the kernel does not scale
    k_bkth, v_bkth = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    segmented, has_sinks = segment_ids_bt is not None, sinks_n is not None
    args = (q_bnth, k_bkth, v_bkth) + ((segment_ids_bt,) if segmented else ()) + ((sinks_n,) if has_sinks else ())
    heads, t = q_bnth.shape[1], q_bnth.shape[2]

    def run(q, k, v, *rest):
        segment_ids, sinks = rest[0] if segmented else None, rest[-1] if has_sinks else None
        return _apply(_kernel(q.shape[1], q.shape[2], window, softcap, interpret), q, k, v, segment_ids, None, sinks)

    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return run(*args).transpose(0, 2, 1, 3)
    batch_axes, head_axes = kernel_axes(mesh, q_bnth.shape[0], heads, k_bkth.shape[1])
    seq_axis = "context" if context > 1 else None
    split = P(batch_axes, head_axes, seq_axis, None)
    specs = (
        (split, split, split)
        + ((P(batch_axes, seq_axis),) if segmented else ())
        + ((P(head_axes),) if has_sinks else ())
    )
    if seq_axis is None:
        run = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=split, check_vma=False)
        return run(*args).transpose(0, 2, 1, 3)
    balance = balanced(t, context)
    kernel = _kernel(
        heads,
        t,
        window,
        softcap,
        interpret,
        head_shards=mesh_axis_size(mesh, head_axes),
        q_seq_shards=context,
        rows=balanced_order(t, context) if balance else None,
    )
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(head_axes, seq_axis)))

    def run_shard(kernel, q, k, v, *rest):
        segment_ids, sinks = rest[0] if segmented else None, rest[-1] if has_sinks else None
        gather = functools.partial(jax.lax.all_gather, axis_name=seq_axis, tiled=True)
        keys = gather(segment_ids, axis=1) if segmented else None
        if balance:  # the queries (and their segments) in the balanced layout; the keys stay in order
            q = _to_balanced(q, 2, context)
            segment_ids = _to_balanced(segment_ids, 1, context) if segmented else None
        out = _apply(kernel, q, gather(k, axis=2), gather(v, axis=2), segment_ids, keys, sinks)
        return _from_balanced(out, 2, context) if balance else out

    sharded = jax.shard_map(run_shard, mesh=mesh, in_specs=(kernel_spec, *specs), out_specs=split, check_vma=False)
    return sharded(kernel, *args).transpose(0, 2, 1, 3)
