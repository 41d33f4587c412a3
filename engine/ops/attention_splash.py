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
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from engine.ops.partitioning import current_mesh, kernel_axes

LANES = 128  # the kernel's key blocks are multiples of the TPU's 128 lanes


def unsupported(*, seq_len: int) -> str | None:
    """Why splash attention cannot take this case (None if it can)."""
    if seq_len % LANES:
        return f"splash attention needs the sequence length a multiple of {LANES}, not {seq_len}"
    return None


def _block(t: int) -> int:
    return next(b for b in (512, 256, LANES) if t % b == 0)


def _kernel(heads: int, t: int, window: int | None, softcap: float | None, interpret: bool):
    """The kernel for one example: q (heads, t, h), k and v (kv heads, t, h). Built per trace:
    it holds its block-sparsity tables as arrays of the trace it was made in."""
    if window is None:
        head_mask = splash.CausalMask((t, t))
    else:  # query i sees keys [i - window + 1, i]
        head_mask = splash.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    b = _block(t)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    return splash.make_splash_mha(splash.MultiHeadMask([head_mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def _local_attention(q_bnth, k_bkth, v_bkth, segment_ids_bt, sinks_n, *, window, softcap, interpret):
    kernel = _kernel(q_bnth.shape[1], q_bnth.shape[2], window, softcap, interpret)
    if segment_ids_bt is None:
        return jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks_n))(q_bnth, k_bkth, v_bkth)
    segments = splash.SegmentIds(segment_ids_bt, segment_ids_bt)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, s, sinks=sinks_n))(q_bnth, k_bkth, v_bkth, segments)


def splash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, scale: float, softcap: float | None = None,
                     window: int | None = None, interpret: bool = False, sinks_n=None):
    """Causal grouped-query attention with the splash kernel; (b, t, n, h) in the dtype of q.
    `sinks_n` (n,): attention sinks (GPT-OSS), the kernel's `sinks`."""
    q_bnth = (q_btnh * scale).astype(q_btnh.dtype).transpose(0, 2, 1, 3)  # the kernel does not scale
    k_bkth, v_bkth = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    segmented, has_sinks = segment_ids_bt is not None, sinks_n is not None
    args = (q_bnth, k_bkth, v_bkth) + ((segment_ids_bt,) if segmented else ()) + ((sinks_n,) if has_sinks else ())

    def run(q, k, v, *rest):
        segment_ids, sinks = rest[0] if segmented else None, rest[-1] if has_sinks else None
        return _local_attention(q, k, v, segment_ids, sinks, window=window, softcap=softcap, interpret=interpret)

    mesh = current_mesh()
    if mesh is not None and mesh.size > 1:
        batch_axes, head_axes = kernel_axes(mesh, q_bnth.shape[0], q_bnth.shape[1], k_bkth.shape[1])
        heads = P(batch_axes, head_axes, None, None)
        in_specs = (heads, heads, heads) + ((P(batch_axes, None),) if segmented else ()) + (
            (P(head_axes),) if has_sinks else ())
        run = jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)
    return run(*args).transpose(0, 2, 1, 3)
