"""The one seam between the JAX releases trainflow supports: 0.10 (the newest Python 3.11
gets) and 0.12 (Python 3.12+). Read without importing jax, so a process can decide its
XLA_FLAGS before jax starts (XLA aborts on a flag it does not know).

What differs, and where it is used:

    XLA:CPU's loop emitter   jax 0.10's XLA compiles fusions with its MLIR emitters and keeps
                             the older loop emitter behind --xla_cpu_use_fusion_emitters=false
                             (the tests' fast compile); jax 0.12's XLA has only the MLIR
                             emitters and no such flag.
    buffer-assignment total  jax >= 0.11's memory analysis states `total_allocation_bytes`,
                             the compiler's own peak; under 0.10 the plan takes the heap peak
                             on TPU and GPU (within 0.4% of the assignment for llama3.1-8b on a
                             v5p-8) and says that the older compiler's temporaries' sum
                             overstates. engine/train/memory.py tells the two apart by the
                             analysis itself (whether it has the attribute), not by version.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version


@cache
def jax_version() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, from its metadata (jax is not imported)."""
    try:
        text = version("jaxlib")
    except PackageNotFoundError:
        text = version("jax")
    major, minor = (int(part) for part in text.split(".")[:2])
    return major, minor


def has_cpu_loop_emitter() -> bool:
    """Whether this XLA still has the loop emitter and its switch (jax < 0.11)."""
    return jax_version() < (0, 11)


def cpu_loop_emitter_flags() -> list[str]:
    """XLA_FLAGS that compile CPU fusions with the loop emitter, where this XLA has it."""
    return ["--xla_cpu_use_fusion_emitters=false"] if has_cpu_loop_emitter() else []


def cpu_fusion_emitter_options() -> dict[str, bool]:
    """compiler_options that compile with the MLIR fusion emitters (XLA's default), overriding
    the loop-emitter flag where this XLA has one; nothing to override where it has not."""
    return {"xla_cpu_use_fusion_emitters": True} if has_cpu_loop_emitter() else {}
