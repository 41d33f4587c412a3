"""What a compiled training step holds per device, and whether that fits the device.

`Memory` holds XLA's memory analysis of a compiled step (arguments, outputs not aliased to
them, temporaries, generated code) and what the arguments are made of: parameters, optimizer
state and batch (their shard sizes; the compiler may pad them), plus the gradients' size. The trainer applies
`check_fits` to its compiled step before step 1; the preflight (plan.py) reports the same.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from engine.config import ConfigError
from engine.train.targets import GiB

OLDER_TPU_COMPILER = (
    "this compiler (jax < 0.11) states no buffer-assignment total, so the temporaries are its heap peak, "
    "which for llama3.1-8b on a v5p-8 (8 rows, remat full) came within 0.4% of its buffer assignment; its own "
    "temporaries figure (temp_size_in_bytes, {temp} here) sums every buffer and overstates what a large step "
    "holds: for that step 17.86 GiB per chip against the assignment's 13.96 at 4,096 positions (+28%) and "
    "23.65 against 17.43 at 8,192 (+36%); jax >= 0.11 (Python 3.12+) states the assignment itself"
)
"""What the plan says of a TPU step compiled under jax < 0.11 (libtpu 0.0.42.1): the figures of
bench/results/compiled_step-jax0.10.2.json (`python -m bench.compiled_step` under jax 0.10.2)."""


def older_compiler_note(analysis, platform: str) -> str | None:
    """The OLDER_TPU_COMPILER sentence for a TPU step whose memory analysis states no
    buffer-assignment total; None where it does (or off TPU, where temp_size is exact)."""
    if platform != "tpu" or hasattr(analysis, "total_allocation_bytes"):
        return None
    temp = analysis.temp_size_in_bytes
    return OLDER_TPU_COMPILER.format(temp=f"{temp / GiB:.2f} GiB" if temp >= GiB else f"{temp / 2**20:.2f} MiB")


def knobs(cfg, from_scratch: bool = False) -> str:
    """What would make the step of run config `cfg` smaller, for the does-not-fit sentence
    (less what it already does). A model trained `from_scratch` (pretraining without
    checkpoint.init_from) has no trained base for an adapter: LoRA is not offered to it."""
    found = ["shard the state over more devices (mesh.fsdp)"]
    if cfg.mesh.context == 1:
        found.append("split each sequence's positions over devices (mesh.context)")
    if cfg.compute.remat != "full":
        found.append("recompute activations (compute.remat: full)")
    found.append("fewer rows per step or per micro-batch (data.batch_size, grad_accum)")
    if cfg.compute.param_dtype != "bfloat16":
        found.append("bfloat16 parameters (compute.param_dtype)")
    lora = getattr(cfg, "lora", None)
    if lora is None and not from_scratch:
        found.append("train a low-rank adapter on the frozen model instead of every weight (lora: {rank: 16})")
    if (lora is None and not from_scratch) or (lora is not None and lora.base_dtype not in ("int8", "nf4")):
        found.append("with lora, hold the frozen base quantized (lora.base_dtype: nf4 or int8)")
    return ", ".join(found[:-1]) + f", or {found[-1]}"


@dataclasses.dataclass
class Memory:
    """Bytes per device of one compiled step (the device holding the most)."""

    parameters: float
    optimizer_state: float
    batch: float
    gradients: float
    """Param-shaped, in the parameters' dtype: what the temporaries hold of them at most (XLA
    may write them into the donated outputs instead)."""
    argument: float
    output: float
    alias: float
    temporaries: float
    generated_code: float

    @property
    def total(self) -> float:
        """What the step needs at once: inputs, outputs not written over the (donated) inputs,
        temporaries and the program itself."""
        return self.argument + self.output - self.alias + self.temporaries + self.generated_code

    @classmethod
    def of(
        cls,
        analysis,
        parameters: float,
        optimizer_state: float,
        batch: float,
        gradients: float,
        platform: str = "cpu",
    ) -> Memory:
        """From `compiled.memory_analysis()` of a step compiled for `platform`, and the state's
        shard sizes. The temporaries are what the compiler's buffer assignment holds beside the
        live arguments and outputs: its total allocation where the analysis states it (jax >=
        0.11), else its heap peak (TPU, GPU) or, on CPU, temp_size_in_bytes, which there is
        exactly the one preallocated temporary block (XLA:CPU's peak leaves it out). On TPU,
        temp_size_in_bytes sums every temporary buffer and overstates the assignment
        (`OLDER_TPU_COMPILER`). The heap peak also counts what the step keeps in the hosts'
        memory (an optimizer state offloaded, OptimizerConfig.host_offload), left out here."""
        live = analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        assigned = getattr(analysis, "total_allocation_bytes", 0) or 0
        on_host = sum(
            (getattr(analysis, f"host_{part}_size_in_bytes", 0) or 0) * sign
            for part, sign in (("argument", 1), ("output", 1), ("alias", -1), ("temp", 1))
        )
        peak = (getattr(analysis, "peak_memory_in_bytes", 0) or 0) - on_host
        if assigned > live:
            temporaries = assigned - live
        elif platform != "cpu" and peak > live:
            temporaries = peak - live
        else:
            temporaries = analysis.temp_size_in_bytes
        return cls(
            parameters,
            optimizer_state,
            batch,
            gradients,
            analysis.argument_size_in_bytes,
            analysis.output_size_in_bytes,
            analysis.alias_size_in_bytes,
            float(temporaries),
            analysis.generated_code_size_in_bytes,
        )


def shard_bytes(tree) -> float:
    """Bytes of the largest shard of each array of `tree` (ShapeDtypeStructs with shardings), summed."""

    def one(x) -> float:
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        bits = (
            jax.numpy.iinfo(x.dtype).bits
            if jax.numpy.issubdtype(x.dtype, jax.numpy.integer)
            else np.dtype(x.dtype).itemsize * 8
        )
        return math.prod(shape) * bits / 8  # 4-bit types (a QLoRA base) count half a byte

    return float(sum(one(x) for x in jax.tree.leaves(tree)))


def device_memory(device) -> float:
    """Bytes one device can hold: what its runtime says, else (CPU) this host's memory shared
    by the devices of this process."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(len(jax.local_devices()), 1)


def check_fits(memory: Memory, capacity: float, devices: int, kind: str, to_fit: str) -> None:
    """Refuse a step whose memory exceeds its devices', naming the numbers and the knobs."""
    if memory.total <= capacity:
        return
    raise ConfigError(
        f"the training step needs {memory.total / GiB:.2f} GiB per device (parameters "
        f"{memory.parameters / GiB:.2f}, optimizer state {memory.optimizer_state / GiB:.2f}, batch "
        f"{memory.batch / GiB:.2f}, temporaries {memory.temporaries / GiB:.2f} GiB with the gradients) but each of "
        f"the {devices} {kind} devices has {capacity / GiB:.2f} GiB; to fit: {to_fit}"
    )
