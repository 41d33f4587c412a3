"""Preflight: will a training step fit a target, and how fast can it be at best?

    python -m engine.train CONFIG.yaml --plan --target v5e-16     (trainflow plan PIPELINE.yaml --target ...)

`plan_step` builds the run's real trainer (model, optimizer, the `make_train_step` it jits)
over the target's devices and compiles the step ahead of time from abstract arguments
(ShapeDtypeStructs carrying the shardings; no parameter is allocated):

    TPU slice   compiled for the slice's topology on this host (libtpu, jax.experimental.topologies)
    local       compiled for the devices of this process
    GPU host    compiled where that many GPUs are here; otherwise an analytic estimate that says so

Per device it reports what the compiled step holds (XLA's memory analysis: arguments,
outputs not aliased to them, temporaries, generated code), what the arguments are made of
(parameters, optimizer state, batch: their shard sizes) and the gradients' size, against the
device's memory; the step's FLOPs; and a roofline bound on step time and MFU. Where the TPU
compiler itself refuses a step that cannot fit (RESOURCE_EXHAUSTED), its figures are reported.
`check_fits` is the same test the trainer applies before step 1.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import topologies
from jax.sharding import AbstractMesh

from engine.config import ConfigError
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import split_adapter
from engine.models.params import flops_per_token, param_shardings
from engine.models.quantize import QUANTIZED_DTYPES, quantized_abstract
from engine.ops.partitioning import BATCH_AXES, use_mesh
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import axis_sizes, mesh_axes
from engine.train.config import TrainConfig
from engine.train.memory import Memory, device_memory, knobs, older_compiler_note, shard_bytes
from engine.train.metrics import peak_flops
from engine.train.optimizer import make_optimizer
from engine.train.step import Objective
from engine.train.targets import GiB, Target, get_target
from engine.train.trainer import Trainer, lm_batch


class DoesNotFit(RuntimeError):
    """The planned step needs more memory than the target's devices have."""


@dataclasses.dataclass
class Plan:
    """One training step on one target."""

    stage: str
    target: Target
    devices: int
    device_kind: str
    mesh: dict[str, int]
    how: str
    """compiled | refused by the compiler | estimate (no GPU here)."""
    memory: Memory
    capacity: float
    """Bytes of memory per device."""
    tokens: int
    """Tokens per optimizer step (rows x sequence length)."""
    updates: int
    """Optimizer updates per step (GRPO's num_iterations)."""
    model_flops: float
    """6 x parameters x tokens + attention, the whole step over all devices (the MFU numerator)."""
    hardware_flops: float
    """What the devices execute, recomputation included, all devices together."""
    flops_source: str
    peak_flops: float
    """FLOP/s of one device."""
    bandwidth: float | None
    to_fit: str = ""
    """What would make the step smaller (memory.knobs)."""
    compiler_message: str | None = None
    compiler_note: str | None = None
    """What to know of the compiler's figures (memory.older_compiler_note: a TPU step under jax < 0.11)."""
    compiled: Any = dataclasses.field(default=None, repr=False)
    """The compiled step (None when refused or estimated)."""
    network: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes per device per step over ICI and DCN (`network_bytes`; compiled TPU steps only)."""
    matmuls: str = "default"
    """compute.matmul_precision: the recipe the layers' matmuls were compiled with."""
    state_on_host: bool = False
    """optimizer.host_offload: the optimizer's state is in the hosts' memory, no argument in HBM."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def step_seconds_bound(self) -> tuple[float, str]:
        """A lower bound on the step time: its FLOPs at peak, or its inputs read and outputs
        written once at full memory bandwidth, whichever is slower."""
        compute = self.hardware_flops / self.devices / self.peak_flops
        if self.bandwidth is None:
            return compute, "compute"
        traffic = (self.memory.argument + self.memory.output) * self.updates / self.bandwidth
        return (compute, "compute") if compute >= traffic else (traffic, "memory")

    @property
    def mfu_bound(self) -> float:
        seconds, _ = self.step_seconds_bound
        return self.model_flops / (seconds * self.peak_flops * self.devices)


# --------------------------------------------------------------------------- targets and devices


def target_devices(target: Target) -> list | None:
    """The devices to compile for: the slice's topology, the GPUs here, this process's devices;
    None where the target can only be estimated (a GPU host planned without its GPUs)."""
    if target.platform == "local":
        return jax.devices()
    if target.platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            raise ConfigError(
                f"--target {target.name}: compiling for a TPU topology needs libtpu (pip install 'trainflow[tpu]')"
            )
        # Compiling needs no chip: let this process load libtpu beside another that holds it.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        assert target.topology is not None  # every TPU target names its topology (targets.py)
        try:
            # One chip: its own host (libtpu's default host bounds are a 2x2 board).
            bounds: dict[str, Any] = {"chips_per_host_bounds": (1, 1, 1)} if target.chips == 1 else {}
            if target.slices > 1:  # several slices over DCN: the devices carry their slice_index
                bounds["num_slices"] = target.slices
            return list(topologies.get_topology_desc(target.topology, "tpu", **bounds).devices)
        except jax.errors.JaxRuntimeError as e:
            raise ConfigError(
                f"--target {target.name}: libtpu cannot describe topology {target.topology}: {str(e).splitlines()[0]}"
            ) from None
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
    return gpus[: target.chips] if len(gpus) >= target.chips else None


def mesh_shape(cfg: MeshConfig, devices: int, target: str) -> dict[str, int]:
    """The configured mesh fitted to `devices` (-1 takes the rest); impossible is one sentence."""
    axes, sizes = mesh_axes(cfg), axis_sizes(cfg)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes and devices % known == 0:
        sizes[sizes.index(-1)] = devices // known
    if math.prod(sizes) != devices:
        written = " ".join(f"{axis}={size}" for axis, size in zip(axes, axis_sizes(cfg)))
        raise ConfigError(
            f"--target {target}: mesh {written} does not fit its {devices} devices; "
            "set one mesh axis to -1 to take the rest"
        )
    return dict(zip(axes, sizes))


# --------------------------------------------------------------------------- FLOPs


def _with_bubble(cfg: TrainConfig, hardware: float, source: str) -> tuple[float, str]:
    """GPipe's stages also run their layers in the bubble's slots (engine/ops/pipeline.py):
    the layers' share of the work (all but the LM head's) times (M + S - 1) / M."""
    stages = cfg.mesh.pipeline
    if stages == 1:
        return hardware, source
    microbatches = cfg.compute.pipeline_microbatches or stages
    head = cfg.model.vocab_size * cfg.model.d_model / cfg.model.num_params(include_embedding=False, active=True)
    layers = hardware * (1 - min(head, 1.0))
    bubble = f"+ the GPipe bubble ({stages - 1} of {microbatches + stages - 1} slots per stage)"
    return hardware + layers * (stages - 1) / microbatches, f"{source}, {bubble}"


def _flops(cfg: TrainConfig, tokens: int, updates: int) -> tuple[float, float, str]:
    """(model FLOPs, hardware FLOPs, where they come from) of one step, all devices together."""
    model = flops_per_token(cfg.model, cfg.data.seq_len) * tokens * updates
    if cfg.lora is not None:  # a frozen base has no weight gradients: forward + input gradients, 4 of 6
        model = model * 4 / 6
        if cfg.compute.remat == "full":
            return model, model * 6 / 4, "analytic (LoRA): 4 x parameters x tokens + attention, x 6/4 for remat full"
        return model, model, "analytic (LoRA): 4 x parameters x tokens + attention (no base weight gradients)"
    if cfg.compute.remat == "full":  # the backward pass runs the forward again: 8 instead of 6
        return model, model * 8 / 6, "analytic: 6 x parameters x tokens + attention, x 8/6 for remat full"
    return model, model, "analytic: 6 x parameters x tokens + attention"


# --------------------------------------------------------------------------- the plan


def plan_step(
    cfg: TrainConfig,
    target: Target,
    *,
    stage: str = "train",
    objective: Callable[[Any], Objective] | None = None,
    batch: dict[str, jax.ShapeDtypeStruct] | None = None,
    updates_per_batch: int = 1,
    make_trainer: Callable[..., Trainer] | None = None,
    compiler_options: dict[str, Any] | None = None,
    from_scratch: bool = False,
) -> Plan:
    """Compile `cfg`'s training step for `target` (or estimate it) and size it per device.

    `objective` and `batch` (name -> ShapeDtypeStruct) describe a stage whose loss or batch is not
    language modelling (GRPO); by default next-token cross-entropy over cfg.data's rows.
    `make_trainer(cfg, objective, devices=...)` builds a Trainer subclass (a reward model's,
    whose params carry a head). `compiler_options` go to XLA with the compile (debug options
    such as {"xla_dump_to": DIR}: `buffer_assignment` reads what that dump holds).
    `from_scratch`: a pretraining without a model to start from (the knobs offer no adapter).
    """
    batch = dict(batch or lm_batch(cfg.data.batch_size, cfg.data.seq_len))
    if cfg.lora is not None and cfg.lora.dropout:  # the rows' dropout seeds (engine/models/lora.py)
        batch["lora_seed"] = jax.ShapeDtypeStruct((cfg.data.batch_size, 1), np.int32)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    devices = target_devices(target)
    if devices is None:
        return _estimate(cfg, target, stage, batch, tokens, updates_per_batch, from_scratch)
    try:
        trainer = (
            make_trainer(cfg, objective, devices=devices)
            if make_trainer is not None
            else Trainer(cfg, objective, updates_per_batch=updates_per_batch, devices=devices)
        )
    except ConfigError as e:
        raise ConfigError(f"--target {target.name} ({len(devices)} devices): {e}") from None
    abstract_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()
    }
    base = () if trainer.abstract_base is None else (trainer.abstract_base,)  # LoRA: the frozen base
    parts = dict(
        parameters=shard_bytes(trainer.abstract_params) + sum(shard_bytes(b) for b in base),
        optimizer_state=shard_bytes(trainer.abstract_opt_state),
        batch=shard_bytes(abstract_batch),
        gradients=shard_bytes(trainer.abstract_params),
    )
    message, compiled, note = None, None, None
    with use_mesh(trainer.mesh):
        lowered = (
            trainer.jitted_train_step()
            .trace(trainer.abstract_params, trainer.abstract_opt_state, abstract_batch, *base)
            .lower()
        )
    try:
        compiled = lowered.compile(compiler_options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        message = str(e).splitlines()[0]
        memory, how = _refused(message, parts, cfg.optimizer.host_offload), "refused by the compiler"
    else:
        analysis = compiled.memory_analysis()
        memory, how = Memory.of(analysis, **parts, platform=devices[0].platform), "compiled"
        note = older_compiler_note(analysis, devices[0].platform)
    model_flops, hardware_flops, source = _flops(cfg, tokens, updates_per_batch)
    hardware_flops, source = _with_bubble(cfg, hardware_flops, source)
    if compiled is not None and not cfg.compute.scan_layers and cfg.grad_accum == 1:
        # XLA counts a loop's body once, so its count is the step's only without scanned layers.
        costs = compiled.cost_analysis()
        costs = costs[0] if isinstance(costs, (list, tuple)) else costs
        if costs and costs.get("flops"):
            hardware_flops = costs["flops"] * len(devices) * updates_per_batch
            source = "XLA's cost analysis of the compiled step"
    chip = target.chip
    peak = chip.peak_flops if chip else peak_flops(devices[:1])[0]
    plan = Plan(
        stage,
        target,
        len(devices),
        devices[0].device_kind,
        dict(trainer.mesh.shape),
        how,
        memory,
        chip.memory_bytes if chip else device_memory(devices[0]),
        tokens,
        updates_per_batch,
        model_flops,
        hardware_flops,
        source,
        peak,
        chip.memory_bandwidth if chip else None,
        knobs(cfg, from_scratch),
        message,
        note,
        compiled,
    )
    if compiled is not None and target.platform == "tpu":
        plan.network = network_bytes(compiled.as_text())
    plan.matmuls = cfg.compute.matmul_precision
    plan.state_on_host = cfg.optimizer.host_offload
    return plan


_SIZE = r"([\d.]+)([KMGT]?)"


def _refused(message: str, parts: dict[str, float], state_on_host: bool = False) -> Memory:
    """The figures of a compile the TPU compiler refused: "... the total memory required for HLO
    temporaries (17.39G) exceeds available HBM (15.75G)" (its sizes are in GiB). That figure is
    everything its buffer assignment put in HBM, the arguments too (its memory-usage report's
    total: Llama 3.2 1B in float32 with float32 or bfloat16 moments, 25.99G and 21.39G, differ
    by the moments' 4.60 GiB alone), so the temporaries are what it holds beyond them. An
    optimizer state kept in the hosts' memory (`state_on_host`) is no argument in HBM."""
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    found = re.search(rf"temporaries \({_SIZE}\)", message)
    argument = parts["parameters"] + (0.0 if state_on_host else parts["optimizer_state"]) + parts["batch"]
    temporaries = float(found.group(1)) * scale[found.group(2)] - argument if found else float("nan")
    return Memory(**parts, argument=argument, output=0.0, alias=0.0, temporaries=temporaries, generated_code=0.0)


def _estimate(
    cfg: TrainConfig, target: Target, stage: str, batch: dict, tokens: int, updates: int, from_scratch: bool
) -> Plan:
    """A GPU host planned without its GPUs: the state's exact shard sizes on an abstract mesh,
    and activations by the usual count (Korthikanti et al. 2022, flash attention: 34 bytes x
    d_model per token per layer in 16-bit, 2 with full remat plus one layer's 34) plus the
    float32 logits and their gradient."""
    chip = target.chip
    assert chip is not None  # a target estimated without compiling names its chip (targets.py)
    sizes = mesh_shape(cfg.mesh, target.chips, target.name)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    try:
        shapes, shardings = param_shardings(cfg.model, cfg.compute, mesh, cfg.lora)
    except ConfigError as e:
        raise ConfigError(f"--target {target.name} ({target.chips} devices): {e}") from None
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    frozen = 0.0
    if cfg.lora is not None:  # the adapter trains; the base is held (quantized with QLoRA), no gradient or state
        params, base = split_adapter(params)
        base_dtype = cfg.lora.base_dtype
        if base_dtype in QUANTIZED_DTYPES:
            base = quantized_abstract(base, base_dtype)
        elif base_dtype is not None:
            base = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(base_dtype), sharding=a.sharding), base
            )
        frozen = shard_bytes(base)
    tx, _ = make_optimizer(cfg.optimizer, cfg.schedule, cfg.steps, params)
    opt = jax.eval_shape(tx.init, params)
    opt = optax.tree_map_params(
        tx,
        lambda o, p: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=p.sharding),
        opt,
        params,
        transform_non_params=lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype),
    )
    batch_shards = math.prod(size for axis, size in sizes.items() if axis in BATCH_AXES)
    batch_bytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in batch.values()) / batch_shards
    m = cfg.model
    local_tokens = tokens / cfg.grad_accum / batch_shards / sizes["context"]  # each row's positions split over it
    per_layer = 34 * m.d_model * local_tokens / sizes["tensor"]
    kept = (
        2 * m.d_model * local_tokens * m.num_layers + per_layer
        if cfg.compute.remat == "full"
        else per_layer * m.num_layers
    )
    logits = 8 * m.vocab_size * local_tokens / sizes["tensor"]
    trained = shard_bytes(params)
    memory = Memory(
        trained + frozen,
        shard_bytes(opt),
        batch_bytes,
        trained,
        argument=trained + frozen + (0.0 if cfg.optimizer.host_offload else shard_bytes(opt)) + batch_bytes,
        output=0.0,
        alias=0.0,
        temporaries=trained + kept + logits,
        generated_code=0.0,
    )
    model_flops, hardware_flops, source = _flops(cfg, tokens, updates)
    plan = Plan(
        stage,
        target,
        target.chips,
        chip.kind,
        sizes,
        "estimate (no GPU here)",
        memory,
        chip.memory_bytes,
        tokens,
        updates,
        model_flops,
        hardware_flops,
        source,
        chip.peak_flops,
        chip.memory_bandwidth,
        knobs(cfg, from_scratch),
    )
    plan.state_on_host = cfg.optimizer.host_offload
    return plan


# --------------------------------------------------------------------------- the report


def format_plan(plan: Plan) -> str:
    """The plan as people read it: one block per stage (GiB, or MiB for a small model)."""
    m = plan.memory
    unit, scale = ("GiB", GiB) if m.total >= GiB else ("MiB", 2**20)
    size = lambda b: f"{b / scale:10.2f}"
    chip = plan.target.chip
    slices = f"{plan.target.slices} slices of " if plan.target.slices > 1 else ""
    where = (
        f"{plan.devices} x {chip.kind if chip else plan.device_kind} ({slices}topology {plan.target.topology})"
        if plan.target.platform == "tpu"
        else f"{plan.devices} x {plan.device_kind}"
    )
    mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.items())
    matmuls = f", {plan.matmuls} matmuls" if plan.matmuls != "default" else ""
    lines = [
        f"stage {plan.stage} on {plan.target.name}: {where}, mesh {mesh}{matmuls}; {plan.how}",
        f"  per device                        {unit}",
        f"    parameters                 {size(m.parameters)}",
        f"    optimizer state            {size(m.optimizer_state)}"
        + ("   (in the hosts' memory: optimizer.host_offload)" if plan.state_on_host else ""),
        f"    batch                      {size(m.batch)}",
        f"    arguments                  {size(m.argument)}   ("
        + ("parameters and batch" if plan.state_on_host else "the three above")
        + (", as the compiler lays them out)" if plan.how == "compiled" else ")"),
        f"    gradients                  {size(m.gradients)}   (param-shaped, the parameters' dtype)",
        f"    temporaries                {size(m.temporaries)}   (activations, gradients, workspace)",
        f"    outputs not donated        {size(m.output - m.alias)}",
        f"    generated code             {size(m.generated_code)}",
        f"    total                      {size(m.total)}   of {plan.capacity / scale:.2f}: "
        + ("fits" if plan.fits else "DOES NOT FIT")
        + f" ({m.total / plan.capacity:.0%})",
    ]
    if plan.network:
        lines.append(
            f"  collectives per device per step: ICI {plan.network['ici'] / 2**20:.2f} MiB, "
            f"DCN {plan.network['dcn'] / 2**20:.2f} MiB" + (" (sent to other slices)" if plan.target.slices > 1 else "")
        )
    if plan.compiler_message:
        lines.append(f"  compiler: {plan.compiler_message}")
    if plan.compiler_note:
        lines.append(f"  compiler: {plan.compiler_note}")
    seconds, bound = plan.step_seconds_bound
    peak = (
        f"{plan.peak_flops / 1e12:.0f} TFLOP/s"
        if plan.peak_flops >= 1e12
        else f"{plan.peak_flops / 1e9:.0f} GFLOP/s measured"
    )
    lines += [
        f"  step: {plan.tokens} tokens x {plan.updates} update(s), {plan.model_flops:.3g} model FLOPs, "
        f"{plan.hardware_flops:.3g} executed ({plan.flops_source})",
        f"  roofline: step >= {seconds * 1e3:{'.1f' if seconds >= 1e-3 else '.3g'}} ms ({bound}-bound at {peak}"
        + (f", {plan.bandwidth / 1e9:.0f} GB/s" if plan.bandwidth else "")
        + " per device), "
        f"MFU <= {plan.mfu_bound:.0%}, at most {plan.tokens * plan.updates / seconds / plan.devices:,.0f} "
        "tokens/s per device",
    ]
    if not plan.fits:
        lines.append(f"  to fit: {plan.to_fit}")
    return "\n".join(lines)


def summary(plan: Plan) -> dict[str, Any]:
    """The plan's figures as JSON-able numbers (bytes, FLOPs, seconds)."""
    seconds, bound = plan.step_seconds_bound
    return {
        "stage": plan.stage,
        "target": plan.target.name,
        "devices": plan.devices,
        "mesh": plan.mesh,
        "how": plan.how,
        "fits": plan.fits,
        "capacity_bytes": plan.capacity,
        "memory_bytes": {**dataclasses.asdict(plan.memory), "total": plan.memory.total},
        "model_flops": plan.model_flops,
        "hardware_flops": plan.hardware_flops,
        "flops_source": plan.flops_source,
        "step_seconds_bound": seconds,
        "bound": bound,
        "mfu_bound": plan.mfu_bound,
        "network_bytes": plan.network,
        "matmul_precision": plan.matmuls,
    }


def report(plans: list[Plan], print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Print each plan; raise DoesNotFit naming the stages that do not fit, else their summaries."""
    for plan in plans:
        print_fn(format_plan(plan))
    too_big = [p for p in plans if not p.fits]
    if too_big:
        raise DoesNotFit(
            "; ".join(
                f"stage {p.stage} does not fit {p.target.name}: {p.memory.total / GiB:.2f} GiB per device of "
                f"{p.capacity / GiB:.2f}; to fit: {p.to_fit}"
                for p in too_big
            )
        )
    return {p.stage: summary(p) for p in plans}


def plan_train(cfg: TrainConfig, target: str) -> dict[str, Any]:
    """`python -m engine.train CONFIG --plan --target NAME`: plan pretraining's step."""
    return report([plan_step(cfg, get_target(target), stage="pretrain")])


# --------------------------------------------------------------------------- collectives

REDUCTIONS = ("all-reduce", "all-reduce-start", "reduce-scatter")
"""The ops that sum gradients over the devices that split the batch."""
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (.+?) ([a-z][\w-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.-]+)")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _group_size(attributes: str) -> int:
    """Devices in each replica group: {{0,1,2,3},...}, [groups,size]<=[n], or mesh[...] {axes}."""
    if found := re.search(r"replica_groups=\{\{([\d,]*)\}", attributes):
        return len(found.group(1).split(","))
    if found := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attributes):
        return int(found.group(1))
    if found := re.search(r"replica_groups=mesh\[([^\]]*)\](?: \{([^}]*)\})?", attributes):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", found.group(1)))
        axes = re.findall(r"'(\w+)'", found.group(2)) if found.group(2) else list(sizes)
        return math.prod(int(sizes[a]) for a in axes)
    return 1


def _executed(hlo_text: str) -> list[tuple[int, str, str, str]]:
    """(times it runs per step, shape, opcode, the rest of the line) of every instruction in an
    optimized HLO module's text: a while loop's body (the layer scan) runs as many times as its
    condition's bound (its largest integer constant), a called computation as its callers do."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (start := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = start.group(1)
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and (instruction := _INSTRUCTION.match(line)):
            result_shape, op, rest = instruction.group(2, 3, 4)
            computations[current].append((result_shape, op, rest))
    bounds = {
        name: max(
            (int(rest.split(")")[0]) for shape, op, rest in body if op == "constant" and shape.startswith("s32[]")),
            default=1,
        )
        for name, body in computations.items()
    }
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, body in computations.items():
        for _, opcode, rest in body:
            called = dict(_CALLS.findall(rest))
            trips = bounds.get(called.get("condition", ""), 1) if opcode == "while" else 1
            for kind, callee in called.items():
                callers.setdefault(callee, []).append((name, trips if kind == "body" else 1))

    @functools.cache
    def runs(name: str) -> int:
        return 1 if name == entry else sum(runs(caller) * factor for caller, factor in callers.get(name, ()))

    return [(runs(name), *instruction) for name, body in computations.items() for instruction in body]


def _bytes(dtype: str, dims: str) -> float:
    elements = math.prod(int(d) for d in dims.split(",") if d)
    return elements * (4 if dtype in ("s4", "u4") else int(re.sub(r"\D", "", dtype) or 8)) / 8


def collective_bytes(hlo_text: str, ops: tuple[str, ...] = REDUCTIONS) -> dict[str, float]:
    """Bytes per step that the compiled module's `ops` reduce, by element type ("f32", "bf16"),
    from its optimized HLO text (`compiled.as_text()`): each op's full (unscattered) operand,
    times how often its computation runs (_executed)."""
    totals: dict[str, float] = {}
    for runs, shape, opcode, rest in _executed(hlo_text):
        if opcode not in ops:
            continue
        scale = _group_size(rest) if opcode == "reduce-scatter" else 1
        for dtype, dims in _ARRAY.findall(shape):
            totals[dtype] = totals.get(dtype, 0.0) + runs * scale * _bytes(dtype, dims)
    return totals


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _senders(rest: str) -> float:
    """The share of a Megascale send's devices that send: a collective-permute's transfer
    (ONE_TO_ONE) names its source -> target pairs, and a device that is no pair's source
    sends nothing (a pipeline's one-way hand-off between two slices: half of them)."""
    pairs = re.findall(r"\{(\d+)->(\d+)\}", rest)
    if not pairs:
        return 1.0
    return len({s for s, _ in pairs}) / len({d for pair in pairs for d in pair})


def network_bytes(hlo_text: str) -> dict[str, float]:
    """Bytes per device per step on each network, from the compiled step's HLO text:

    dcn  what the device sends to other slices. A multi-slice TPU compile lowers a collective
         over slices to one within each slice plus transfers of the Megascale runtime (`send`
         instructions with `_xla_megascale_transfer_type`): their payloads, padded as laid out,
         averaged over the devices (a one-way collective-permute's: its sources' share).
    ici  the arrays its collectives within the slice reduce, gather or exchange (a reduce-
         scatter's or all-gather's full array; asynchronous `-start` forms counted once).
    """
    totals = {"ici": 0.0, "dcn": 0.0}
    for runs, shape, opcode, rest in _executed(hlo_text):
        arrays = _ARRAY.findall(shape)
        if opcode == "send" and "_xla_megascale_transfer_type" in rest:
            totals["dcn"] += runs * _bytes(*arrays[0]) * _senders(rest)
        elif opcode.removesuffix("-start") in COLLECTIVES and arrays:
            dtype, dims = ([a for a in arrays if a[1]] or arrays)[-1]  # a -start's tuple ends with its result
            scale = _group_size(rest) if opcode.startswith("reduce-scatter") else 1
            totals["ici"] += runs * scale * _bytes(dtype, dims)
    return totals


def dump_options(directory: str) -> dict[str, Any]:
    """compiler_options that make XLA write the compiled step's buffer assignment to `directory`."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*train_step.*"}


def buffer_assignment(directory: str) -> dict[str, float]:
    """What the compiler's own buffer assignment holds in device memory (memory space 0, HBM on
    an accelerator) for the train step dumped into `directory` (dump_options): `total` bytes
    (every allocation there: arguments, outputs, temporaries, constants) and `temporaries`
    (its preallocated temporary block)."""
    reports = sorted(glob.glob(os.path.join(directory, "*train_step*memory-usage-report.txt")))
    assignments = sorted(glob.glob(os.path.join(directory, "*train_step*buffer-assignment.txt")))
    assert reports and assignments, f"no train_step buffer assignment dumped in {directory}"
    report = open(reports[-1]).read()
    total = re.search(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", report)
    if total is None:
        raise RuntimeError(f"{reports[-1]}: XLA's buffer report has no total of the default memory space")
    temporaries = sum(
        int(size)
        for size, rest in re.findall(r"^allocation \d+: size (\d+), (.*)$", open(assignments[-1]).read(), re.M)
        if "preallocated-temp" in rest and "color" not in rest
    )
    return {"total": float(total.group(1)), "temporaries": float(temporaries)}


# --------------------------------------------------------------------------- planner hooks
# A training stage kind names a hook `step_spec(cfg, models) -> StepSpec` (tasks/registry.py:
# StageKind.planner): what `trainflow plan` compiles for one stage of that kind.

InputModels = Mapping[str, tuple[ModelConfig, ComputeConfig]]
"""A stage's model inputs (`checkpoint`, DPO's `reference`, distillation's `teacher`) -> the
model and compute settings each holds: `name in models` says whether the stage has it."""


@dataclasses.dataclass
class StepSpec:
    """One training stage's step as `plan_step` compiles it (the arguments it takes)."""

    config: TrainConfig
    """The trainer's view; its model is what a later stage that fine-tunes this one trains."""
    objective: Callable[[Any], Objective] | None = None
    batch: dict[str, jax.ShapeDtypeStruct] | None = None
    updates_per_batch: int = 1
    make_trainer: Callable[..., Trainer] | None = None
    from_scratch: bool = False
    uncounted: Callable[[Plan], list[str]] = lambda plan: []
    """What the stage holds beside the step that the plan does not count, in words (given the plan)."""


def fine_tuned_model(cfg: Any, models: InputModels) -> tuple[ModelConfig, ComputeConfig]:
    """The model a fine-tune trains: its input checkpoint's, unless its config sets one."""
    model, compute = models["checkpoint"]
    return cfg.model or model, cfg.compute or compute


def frozen_params_gib(models: InputModels, name: str, compute: ComputeConfig | None) -> tuple[int, float]:
    """(parameters, GiB in all) of a frozen model input, in its compute's (or `compute`'s) dtype."""
    model, own = models[name]
    count = model.num_params()
    return count, count * jnp.dtype((compute or own).param_dtype).itemsize / 2**30


def step_spec(cfg: TrainConfig, models: InputModels) -> StepSpec:
    """Pretraining's planner hook: without an `init` input it trains from random weights."""
    return StepSpec(cfg, from_scratch="init" not in models)
