"""XLA:CPU kernels of our own, in C++ next to this file, called as XLA FFI custom calls.

    decode_attention.cc   one query per row against a KV cache and a group's shared prefix
    train_attention.cc    causal grouped-query attention in training, forward and backward
    common.h              what they share: bfloat16 conversion, vectors, exp, the thread pool

XLA:CPU compiles some of the model's small, fused pieces of work (decode attention: two
batched products of a few rows each, and the softmax between them) into many operations
that run far below the CPU's speed. These kernels do such a piece in one pass.

The source is compiled on first use, for this CPU (`-march=native`), with the C++ compiler
found as $CXX, g++, c++ or clang++, against the XLA FFI headers jaxlib ships
(`jax.ffi.include_dir()`), and cached under $TRAINFLOW_KERNEL_CACHE (default
~/.cache/trainflow/kernels, or under $XDG_CACHE_HOME) by a hash of the source, the compiler,
its flags, jax's version and the CPU: a cache shared by machines of other CPUs holds one
library per CPU. Processes compiling at once wait on a file lock; a library appears under its
final name only when complete. Where no compiler is found or the build fails,
`unavailable()` says why and callers use XLA's own lowering (engine/ops/attention.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCES = {name: Path(__file__).with_name(f"{name}.cc") for name in ("decode_attention", "train_attention")}
HEADERS = (Path(__file__).with_name("common.h"),)
TARGETS = {  # library -> {XLA custom-call target: the handler's symbol}
    "decode_attention": {"trainflow_decode_attention": "TrainflowDecodeAttention"},
    "train_attention": {
        "trainflow_train_attention_fwd": "TrainflowTrainAttentionForward",
        "trainflow_train_attention_bwd": "TrainflowTrainAttentionBackward",
    },
}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")

_state: dict[str, object] = {}  # name -> registered target name, or the reason it is unavailable


def cache_dir() -> Path:
    if os.environ.get("TRAINFLOW_KERNEL_CACHE"):
        return Path(os.environ["TRAINFLOW_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainflow" / "kernels"


def compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _cpu() -> str:
    """The CPU as the compiled code depends on it (-march=native): model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()


def has_avx512() -> bool:
    """Whether this x86 CPU has AVX-512 (avx512f): where the training-attention kernel was
    measured faster than XLA's `blocked` lowering. On AVX2 alone (AMD EPYC Zen 3) it ran 2.5x
    slower (docs/benchmarks.md), so `attention_impl: auto` does not pick it there."""
    return any(line.startswith("flags") and " avx512f" in f" {line.split(':', 1)[-1]} " for line in _cpu().splitlines())


def build(name: str) -> Path:
    """The compiled library of kernel `name`, built (once per source, compiler and CPU) if missing."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++)")
    source = SOURCES[name]
    include = jax.ffi.include_dir()
    command = [cxx, *FLAGS, f"-I{include}", str(source)]
    texts = [source.read_text(), *(header.read_text() for header in HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *command[:-1], jax.__version__, _cpu()]).encode()).hexdigest()
    directory = cache_dir()
    library = directory / f"{name}-{key[:16]}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if library.exists():
            return library
        fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{name}-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([*command, "-o", partial], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"compiling {source.name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(partial, library)  # complete, under its final name
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


def unavailable(name: str = "decode_attention") -> str | None:
    """None once kernel `name` is built, loaded and registered with XLA:CPU; else why not."""
    if name not in _state:
        try:
            library = ctypes.CDLL(str(build(name)))
            for target, symbol in TARGETS[name].items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            _state[name] = None
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
            _state[name] = f"the CPU kernel {name} is unavailable: {error}"
    return _state[name]  # type: ignore[return-value]


def decode_attention(
    q_bkgh, k_bkhs, v_bksh, mask_bs, shared=None, *, scale: float, softcap: float | None = None, sinks_kg=None
):
    """One query per row (b, k, g, h) against its cache, keys (b, k, h, s) and values (b, k, s,
    h) under mask (b, s), and a `shared` prefix (k_pkhp, v_pkph, mask_pp, group) or None: the
    output (b, k, g, h), as attention_reference._one_query_attention computes it (up to float32
    summation order). Keys and values are float32, bfloat16, or uint16 holding bfloat16 bits
    (engine/ops/attention.py: BF16_BITS); the output is float32 or bfloat16 as they are. Needs
    unavailable() to be None."""
    dtype = jnp.bfloat16 if k_bkhs.dtype in (jnp.uint16, jnp.bfloat16) else jnp.float32
    b, k, g, h = q_bkgh.shape
    if shared is None:
        prefix = (jnp.zeros((1, k, h, 0), k_bkhs.dtype), jnp.zeros((1, k, 0, h), k_bkhs.dtype), jnp.zeros((1, 0), bool))
        group = 1
    else:
        *prefix, group = shared
        prefix = (*prefix[:2], prefix[2].astype(bool))
    sinks = jnp.zeros((k, g), jnp.float32) if sinks_kg is None else sinks_kg.astype(jnp.float32)
    call = jax.ffi.ffi_call("trainflow_decode_attention", jax.ShapeDtypeStruct((b, k, g, h), dtype))
    return call(
        q_bkgh.astype(dtype),
        k_bkhs,
        v_bksh,
        mask_bs.astype(bool),
        *prefix,
        sinks,
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
        group=np.int64(group),
        has_sinks=np.int64(sinks_kg is not None),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def train_attention(q_btnh, k_btkh, v_btkh, segment_ids_bt, scale: float, window: int):
    """Causal grouped-query attention of q (b, t, n, h) over k, v (b, t, k, h) with segment ids
    (b, t) (0 = padding) and a sliding `window` (0: none), as attention_blocked.blocked_attention
    computes it (up to float32 summation order; a query that sees no key gets 0): (b, t, n, h)
    in q's dtype, float32 or bfloat16, h a multiple of 16, n / k at most 8. Differentiable in
    q, k and v (train_attention.cc's backward). Needs unavailable("train_attention") to be None."""
    return _train_forward(q_btnh, k_btkh, v_btkh, segment_ids_bt, scale, window)[0]


def _train_forward(q, k, v, segment_ids, scale, window):
    b, t, n, h = q.shape
    kv = k.shape[2]
    call = jax.ffi.ffi_call(
        "trainflow_train_attention_fwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kv, t, n // kv), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        segment_ids.astype(jnp.int32),
        scale=np.float32(scale),
        window=np.int64(window),
    )
    return out, (q, k, v, segment_ids, out, lse)


def _train_backward(scale, window, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    call = jax.ffi.ffi_call(
        "trainflow_train_attention_bwd",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, q.dtype),
            jax.ShapeDtypeStruct(v.shape, q.dtype),
        ),
        vmap_method="sequential",
    )
    dq, dk, dv = call(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        segment_ids.astype(jnp.int32),
        out,
        lse,
        d_out.astype(q.dtype),
        scale=np.float32(scale),
        window=np.int64(window),
    )
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


train_attention.defvjp(lambda q, k, v, s, scale, window: _train_forward(q, k, v, s, scale, window), _train_backward)
