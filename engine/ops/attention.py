"""Attention in training and prefill: one entry point, `attention`, and an implementation per
platform behind it (`ComputeConfig.attention_impl`).

    reference   the masked softmax over all (t, t) scores (attention_reference.py): the tests' yardstick
    blocked     block-causal with a recomputing backward, laid out for XLA:CPU (attention_blocked.py)
    cpu_kernel  the same function as blocked in one C++ pass per (row, kv head), forward and
                backward (engine/ops/cpu_kernels/train_attention.cc): CPU, per device's shard
    cudnn       cuDNN flash attention via jax.nn.dot_product_attention, NVIDIA GPUs (attention_cudnn.py)
    splash      the Pallas TPU splash-attention kernel (attention_splash.py)

All compute the same function: causal grouped-query attention over packed documents
(segment ids, 0 = padding), an optional sliding window on local layers and an optional logit
soft-cap and optional attention sinks (GPT-OSS: a learned logit per head that joins the
softmax's denominator). Outputs at padding positions are not specified (nothing reads them).

`auto` picks by the platform being compiled for (partitioning.current_platform): cpu ->
cpu_kernel, gpu -> cudnn, tpu -> splash. Where that kernel cannot take the case (cuDNN: a
soft-cap, float32, head_dim, attention sinks; splash: a sequence length that is not a
multiple of 128; cpu_kernel: a soft-cap, sinks, a head_dim that is not a multiple of 16,
more than 8 query heads per kv head, value heads of another width, a kernel that could
not be built) auto runs `blocked` instead and warns once per process, naming the reason.
The CPU kernel is an FFI call XLA cannot partition: under a mesh of several devices it runs
in a shard_map on each device's rows and heads (as splash does on TPU).
An implementation asked for by name is never swapped: if it cannot run the case, or `cudnn`
is asked for off a GPU, that is a ConfigError. `splash` by name off TPU runs in the Pallas
interpreter (exact, slow: for tests), with a warning.

Context parallelism (a mesh `context` axis of C > 1 devices, and a sequence that divides by
C): each device holds t / C consecutive positions of its rows, gathers its rows' keys and
values (and key segments) over the context axis inside a shard_map, and attends with its own
queries to them; the gather's transpose (a reduce-scatter) returns the key and value
gradients. `splash` takes the shards' rows of its mask tables, load-balanced where it can
(attention_splash.py);
`blocked` places the queries at the device's index times t / C, a traced value, so every
device runs one program: each query block takes every key, or on a sliding-window layer its
window's worth, and what the mask hides is computed and masked, not skipped. `cpu_kernel`
and `cudnn` take no query offset: `auto` runs `blocked` there, and by name they are a
ConfigError. A prefill with a KV cache runs `decode_attention`, unsplit along the sequence.
docs/engine.md, "Sharding", has the figures and the limits.

Decoding with a KV cache attends over the cache through `decode_attention`
(`ComputeConfig.decode_attention_impl`): a step of one query per row runs, on CPU, the C++
kernel engine/ops/cpu_kernels/decode_attention.cc (`cpu_kernel`; under a mesh on each
device's rows, where the rows and a group rollout's prompts divide over its batch axes),
else the reference over the cache's explicit mask (engine/models/kv_cache.py); a prefill
(several queries per row) always runs the reference.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from engine.config import ConfigError
from engine.ops import attention_cudnn, attention_splash, cpu_kernels
from engine.ops.attention_blocked import blocked_attention
from engine.ops.attention_cudnn import cudnn_attention
from engine.ops.attention_names import DecodeImpl, Impl  # noqa: F401  (the one list; importable from here)
from engine.ops.attention_reference import dot_product_attention, reference_attention
from engine.ops.attention_splash import splash_attention
from engine.ops.partitioning import current_mesh, current_platform, kernel_axes, logical_to_spec, mesh_axis_size

BF16_BITS = jnp.uint16
"""How a bfloat16 KV cache is stored on CPU: its values' bits. XLA:CPU computes bfloat16
data movement in float32 (it converts the whole cache, writes the step's slot and converts
back: a pass over each layer's cache in every decode step); an integer cache is written in
place. The CPU decode kernel reads the bits as bfloat16; XLA's lowering converts them back."""


def stored(x, dtype):
    """x as a cache of `dtype` stores it (bfloat16 values as BF16_BITS)."""
    if dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(dtype)


def cache_values(x):
    """A stored cache array as values: bfloat16 from BF16_BITS, else x."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


AUTO = {"cpu": "cpu_kernel", "gpu": "cudnn", "tpu": "splash"}
"""What `auto` picks on each platform (anything else: blocked); on a CPU without AVX-512,
blocked (cpu_kernels.has_avx512: the kernel lost 2.5x to it on AVX2)."""
FALLBACK = "blocked"

_told: set[str] = set()


def _tell_once(message: str) -> None:
    """Warn about `message` the first time this process meets it."""
    if message not in _told:
        _told.add(message)
        warnings.warn(message, stacklevel=4)


def _device():
    mesh = current_mesh()
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def context_shards(mesh, seq_len: int) -> int:
    """Over how many devices a sequence of `seq_len` positions is split (mesh axis `context`;
    1 without one, or where the length does not divide)."""
    if mesh is None or "context" not in mesh.axis_names:
        return 1
    shards = mesh.shape["context"]
    return shards if seq_len % shards == 0 else 1


def _unsupported(
    impl: str,
    *,
    dtype,
    head_dim: int,
    seq_len: int,
    softcap,
    segmented: bool,
    sinks: bool = False,
    groups: int = 1,
    value_dim: int | None = None,
    context: int = 1,
    alibi: bool = False,
) -> str | None:
    if alibi and impl in ("cpu_kernel", "cudnn", "splash"):
        return f"{impl} takes no ALiBi bias (positions: alibi)"
    if context > 1 and impl in ("cpu_kernel", "cudnn"):
        return (
            f"context parallelism (mesh axis context={context}) gives each device a slice of the queries, "
            f"and {impl} takes no query offset"
        )
    if impl == "cpu_kernel":
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            return f"the CPU kernel takes float32 or bfloat16, not {jnp.dtype(dtype).name}"
        if softcap or sinks:
            return "the CPU kernel takes no logit soft-cap and no attention sinks"
        if head_dim % 16 or (value_dim is not None and value_dim != head_dim):
            return (
                f"the CPU kernel needs a head_dim that is a multiple of 16 (here {head_dim}) for keys and values alike"
            )
        if groups > 8:
            return f"the CPU kernel takes at most 8 query heads per kv head (here {groups})"
        return cpu_kernels.unavailable("train_attention")
    if sinks and impl == "cudnn":  # jax.nn.dot_product_attention has no sinks argument
        return "cuDNN attention here takes no attention sinks (attention_sinks)"
    if impl == "cudnn":
        return attention_cudnn.unsupported(
            dtype=dtype, head_dim=head_dim, seq_len=seq_len, softcap=softcap, segmented=segmented, device=_device()
        )
    if impl == "splash":
        return attention_splash.unsupported(seq_len=seq_len, context=context)
    return None


def choose_implementation(
    impl: Impl,
    *,
    platform: str,
    dtype,
    head_dim: int,
    seq_len: int,
    softcap: float | None = None,
    segmented: bool = True,
    sinks: bool = False,
    groups: int = 1,
    value_dim: int | None = None,
    context: int = 1,
    alibi: bool = False,
) -> str:
    """The implementation that runs `impl` on `platform` for this case (see the module
    docstring); `context`: the context shards the queries are split into; `alibi`: the
    scores take ALiBi's bias (reference and blocked only)."""
    case = dict(
        dtype=dtype,
        head_dim=head_dim,
        seq_len=seq_len,
        softcap=softcap,
        segmented=segmented,
        sinks=sinks,
        groups=groups,
        value_dim=value_dim,
        context=context,
        alibi=alibi,
    )
    if impl == "cpu_kernel" and platform != "cpu":
        raise ConfigError(
            f"compute.attention_impl: cpu_kernel runs on CPU, and this run compiles for {platform}; "
            f"use auto ({AUTO.get(platform, FALLBACK)} here) or blocked"
        )
    if impl == "auto":
        wanted = AUTO.get(platform, FALLBACK)
        reason = _unsupported(wanted, **case)
        if reason is None and wanted == "cpu_kernel" and not cpu_kernels.has_avx512():
            return FALLBACK  # measured 2.5x slower than blocked on AVX2-only CPUs: auto leaves it there
        if reason is None:
            return wanted
        _tell_once(f"attention: auto uses {FALLBACK}, not {wanted}, on {platform}: {reason}")
        return FALLBACK
    if impl == "cudnn" and platform != "gpu":
        raise ConfigError(
            f"compute.attention_impl: cudnn runs on NVIDIA GPUs, and this run compiles for {platform}; "
            f"use auto ({AUTO.get(platform, FALLBACK)} here) or blocked"
        )
    reason = _unsupported(impl, **case)
    if reason is not None:
        raise ConfigError(
            f"compute.attention_impl: {impl} cannot run this model: {reason}; "
            f"use auto (which falls back to {FALLBACK}) or {FALLBACK}"
        )
    if impl == "splash" and platform != "tpu":
        _tell_once(f"attention: splash on {platform} runs in the Pallas interpreter (exact but slow; meant for tests)")
    return impl


def chunked_segment_ids(segment_ids_bt, positions_bt, chunk: int):
    """Segment ids under which causal attention is chunked attention (Llama 4): each chunk of
    `chunk` positions of each document its own segment, so query i sees key j iff both are in
    one document, j <= i and position_i // chunk == position_j // chunk; padding (0) stays 0.
    Positions lie in [0, t). Every implementation takes segments, so each computes it as is."""
    chunks = positions_bt.shape[1] // chunk + 1  # chunk indices per document lie in [0, chunks)
    segments = jnp.ones(positions_bt.shape, jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    return jnp.where(segments != 0, segments * chunks + positions_bt.astype(jnp.int32) // chunk, 0)


def attention(
    q_btnh,
    k_bskh,
    v_bskh,
    segment_ids_bt=None,
    *,
    impl: Impl = "auto",
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    local: bool = False,
    block: int = 128,
    sinks_n=None,
    alibi_slopes: tuple[float, ...] | None = None,
):
    """Causal grouped-query self-attention over packed sequences: (b, t, n, h) in q's dtype.

    q (b, t, n, h); k, v (b, t, k, h) with n a multiple of k; segment_ids_bt (b, t), None for one
    unpadded document per row. A `local` layer sees only the `window` most recent positions,
    its own included. `local`, `window`, `softcap` and `block` (the query block of `blocked`)
    are static. `sinks_n` (n,): attention sinks, a logit per query head in each softmax's
    denominator (GPT-OSS; every implementation but cudnn takes them). `alibi_slopes` (n
    floats, static): ALiBi's -slope * (i - j) on each head's scores (BLOOM, MPT; reference and
    blocked take it, so auto falls back to blocked).
    """
    assert isinstance(local, (bool, np.bool_)), "local must be static (a Python bool)"
    window = window if local else None
    platform = current_platform()
    mesh = current_mesh()
    context = context_shards(mesh, q_btnh.shape[1])
    name = choose_implementation(
        impl,
        platform=platform,
        dtype=q_btnh.dtype,
        head_dim=q_btnh.shape[3],
        seq_len=q_btnh.shape[1],
        softcap=softcap,
        segmented=segment_ids_bt is not None,
        sinks=sinks_n is not None,
        groups=q_btnh.shape[2] // k_bskh.shape[2],
        value_dim=v_bskh.shape[3],
        context=context,
        alibi=alibi_slopes is not None,
    )
    args = (q_btnh, k_bskh, v_bskh, segment_ids_bt)
    if name == "reference":
        return reference_attention(
            *args, scale=scale, softcap=softcap, window=window, sinks_n=sinks_n, alibi_slopes=alibi_slopes
        )
    if name == "blocked":
        blocked = functools.partial(
            blocked_attention, scale=scale, softcap=softcap, window=window, block=block, alibi_slopes=alibi_slopes
        )
        if context > 1:
            return _context_parallel(blocked, mesh, *args, sinks_n)
        return blocked(*args, sinks_n=sinks_n)
    if name == "cudnn":
        return cudnn_attention(*args, scale=scale, window=window)
    if name == "cpu_kernel":
        segments = jnp.ones(q_btnh.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
        return _per_shard(
            functools.partial(cpu_kernels.train_attention, scale=float(scale), window=int(window or 0)),
            mesh,
            q_btnh,
            k_bskh,
            v_bskh,
            segments,
        )
    return splash_attention(
        *args,
        scale=scale,
        softcap=softcap,
        window=window,
        interpret=platform != "tpu",
        sinks_n=sinks_n,
        context=context,
    )


def _per_shard(kernel, mesh, q_btnh, k_bskh, v_bskh, segment_ids_bt):
    """kernel(q, k, v, segments) on each device's shard: an FFI call, which XLA's partitioner
    cannot split, runs in a shard_map under a mesh, batch split as the `act_batch` rule says and
    heads as `act_kv_heads` (query heads with their kv heads, when both divide the axis); the
    sequence stays whole on every device."""
    if mesh is None or mesh.size == 1:
        return kernel(q_btnh, k_bskh, v_bskh, segment_ids_bt)
    batch_axes, head_axes = kernel_axes(mesh, q_btnh.shape[0], q_btnh.shape[2], k_bskh.shape[2])
    heads = P(batch_axes, None, head_axes, None)
    run = jax.shard_map(
        kernel, mesh=mesh, in_specs=(heads, heads, heads, P(batch_axes, None)), out_specs=heads, check_vma=False
    )
    return run(q_btnh, k_bskh, v_bskh, segment_ids_bt)


def _context_parallel(blocked, mesh, q_btnh, k_bskh, v_bskh, segment_ids_bt, sinks_n):
    """`blocked` with each device's queries, a slice of t / C positions of its rows, against
    every key of those rows, gathered over the mesh's `context` axis (module docstring)."""
    batch_axes, head_axes = kernel_axes(mesh, q_btnh.shape[0], q_btnh.shape[2], k_bskh.shape[2])
    heads, positions = P(batch_axes, "context", head_axes, None), P(batch_axes, "context")
    segmented, sinks = segment_ids_bt is not None, sinks_n is not None

    def local(q, k, v, *rest):
        segments = rest[0] if segmented else None
        gather = functools.partial(jax.lax.all_gather, axis_name="context", axis=1, tiled=True)
        return blocked(
            q,
            gather(k),
            gather(v),
            segments,
            shift=jax.lax.axis_index("context") * q.shape[1],
            key_segment_ids_bs=gather(segments) if segmented else None,
            sinks_n=rest[-1] if sinks else None,
        )

    args = [q_btnh, k_bskh, v_bskh] + ([segment_ids_bt] if segmented else []) + ([sinks_n] if sinks else [])
    specs = [heads, heads, heads] + ([positions] if segmented else []) + ([P(head_axes)] if sinks else [])
    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)
    return run(*args)


def choose_decode_implementation(
    impl: DecodeImpl, *, platform: str, unsplit: str | None = None, alibi: bool = False
) -> str:
    """What runs a decode step's attention for `impl` on `platform` (see the module docstring):
    auto picks cpu_kernel on CPU if it builds, and falls back to reference with a warning if
    it does not. `unsplit`: why a mesh's devices cannot each take their share of the step's
    rows (None: they can, or there is one device); auto then runs reference. cpu_kernel by
    name off CPU, for such a step or without a build is a ConfigError. `alibi`: the scores
    take ALiBi's bias, which only reference adds."""
    if impl == "reference" or (impl == "auto" and (platform != "cpu" or unsplit or alibi)):
        return "reference"
    if impl == "cpu_kernel" and alibi:
        raise ConfigError(
            "compute.decode_attention_impl: cpu_kernel takes no ALiBi bias (positions: alibi); use auto or reference"
        )
    if impl == "cpu_kernel" and platform != "cpu":
        raise ConfigError(
            f"compute.decode_attention_impl: cpu_kernel runs on CPU, and this run compiles for {platform}; "
            "use auto or reference"
        )
    if impl == "cpu_kernel" and unsplit:
        raise ConfigError(
            f"compute.decode_attention_impl: cpu_kernel runs on each device's rows, and {unsplit}; "
            "use auto (reference there) or reference"
        )
    reason = cpu_kernels.unavailable("decode_attention")
    if reason is None:
        return "cpu_kernel"
    if impl == "cpu_kernel":
        raise ConfigError(
            f"compute.decode_attention_impl: {reason}; use auto (which falls back to reference) or reference"
        )
    _tell_once(f"decode attention: auto uses reference, not cpu_kernel: {reason}")
    return "reference"


def _row_split(mesh, rows: int, prompts: int | None):
    """(the mesh axes a decode step's rows split over, or None; why they cannot, or None). A
    GRPO group rollout's shared prompts split with their rows: their count must divide too."""
    if mesh is None or mesh.size == 1:
        return None, None
    axes = logical_to_spec(("act_batch",), mesh=mesh)[0]
    size = mesh_axis_size(mesh, axes)
    if size == 1:
        return None, f"the mesh's {mesh.size} devices hold no batch axis"
    for count, what in ((rows, "rows"), (prompts, "shared prompts")):
        if count is not None and count % size:
            return None, f"{count} {what} do not divide over the {size} devices of the batch axes"
    return axes, None


def decode_attention(
    q_btnh,
    k_bkhs,
    v_bksh,
    mask_bts,
    *,
    impl: DecodeImpl = "auto",
    scale: float,
    softcap: float | None = None,
    sinks_n=None,
    shared=None,
    alibi=None,
):
    """Attention of queries (b, t, n, h) over a KV cache as KVCache.update(raw=True) returns it
    (keys (b, k, h, s), values (b, k, s, h), as stored, and the mask (b, t, s)) and `shared`,
    KVCache.shared_prefix(raw=True) or None: (b, t, n, h) in the cache's value dtype. The
    reference's numbers (attention_reference.dot_product_attention), up to float32 summation
    order. Under a mesh the kernel runs in a shard_map on each device's rows (and prompts).
    `alibi`: as dot_product_attention's (ALiBi; the reference runs)."""
    b, t, n, h = q_btnh.shape
    mesh = current_mesh()
    axes, unsplit = _row_split(mesh, b, None if shared is None else shared[0].shape[0])
    platform = current_platform()
    if t != 1 or choose_decode_implementation(impl, platform=platform, unsplit=unsplit, alibi=alibi is not None) == (
        "reference"
    ):
        if shared is not None:
            shared = (cache_values(shared[0]), cache_values(shared[1]), *shared[2:])
        return dot_product_attention(
            q_btnh,
            cache_values(k_bkhs).transpose(0, 3, 1, 2),
            cache_values(v_bksh).swapaxes(1, 2),
            mask_bts,
            scale=scale,
            softcap=softcap,
            sinks_n=sinks_n,
            shared=shared,
            alibi=alibi,
        )
    k = k_bkhs.shape[1]
    group = None if shared is None else shared[3]
    sinks = () if sinks_n is None else (sinks_n.reshape(k, n // k),)
    prefix = () if shared is None else tuple(shared[:3])

    def run(q, keys, values, mask, *rest):
        return cpu_kernels.decode_attention(
            q,
            keys,
            values,
            mask,
            (*rest[:3], group) if prefix else None,
            scale=scale,
            softcap=softcap,
            sinks_kg=rest[-1] if sinks else None,
        )

    args = (q_btnh.reshape(b, k, n // k, h), k_bkhs, v_bksh, mask_bts[:, 0], *prefix, *sinks)
    if axes is not None:
        rows = [P(axes, *[None] * (a.ndim - 1)) for a in args[: 4 + len(prefix)]]
        run = jax.shard_map(run, mesh=mesh, in_specs=(*rows, *[P()] * len(sinks)), out_specs=rows[0], check_vma=False)
    return run(*args).reshape(b, 1, n, h)
