"""The trainer: one loop for every gradient stage, with hooks.

    trainer = Trainer(cfg, objective)          mesh, shardings, optimizer, jitted step
    trainer.add_hook(log_metrics(...), every=cfg.log_every, resets_timer=True)
    trainer.add_hook(save_checkpoint(ckpt, ...), every=cfg.checkpoint.every_steps, on_stop=True)
    final = trainer.fit(source, checkpointer=ckpt)

Pretraining, SFT and GRPO differ only in their batch source (token shards, packed examples,
rollouts scored by rewards) and their `Objective`; resuming, SIGTERM, the non-finite check,
logging, held-out evaluation and checkpoint cadence are this loop's and its hooks'
(engine/train/hooks.py). The core stays pure: `make_train_step` (engine/train/step.py).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from engine import flat_keys
from engine.config import ConfigError
from engine.models.lora import LORA_SEED, join, split_adapter
from engine.models.params import abstract_model_params, graphdef_of, init_params
from engine.models.quantize import QUANTIZED_DTYPES, quantizable, quantize_leaf, quantized_abstract
from engine.ops.partitioning import use_mesh
from engine.parallel.config import unsplittable
from engine.parallel.distributed import preemption_agreed
from engine.parallel.mesh import batch_axes, batch_sharding, batch_shards, global_array, make_mesh, replicated
from engine.train.checkpoint import Checkpointer, load_params, stored_configs
from engine.train.config import TrainConfig
from engine.train.memory import Memory, check_fits, device_memory, knobs, shard_bytes
from engine.train.optimizer import make_optimizer, state_on_devices
from engine.train.step import Objective, lm_objective, make_eval_step, make_train_step


def lm_batch(rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a language-modelling batch (pretraining, SFT): what a Grain or SFT row holds."""
    row = lambda dtype: jax.ShapeDtypeStruct((rows, seq_len), dtype)  # noqa: E731
    return {
        "tokens": row(np.int32),
        "targets": row(np.int32),
        "positions": row(np.int32),
        "segment_ids": row(np.int32),
        "loss_mask": row(np.float32),
    }


def _signature(batch) -> dict:
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()}


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the last good checkpoint is kept."""


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint of the current step was saved."""


@dataclasses.dataclass
class TrainState:
    step: int
    params: Any
    opt_state: Any


class BatchSource(Protocol):
    """Where a stage's batches come from. `next_batch` gets the live state (GRPO samples from
    the current policy) and returns a global batch plus host-side metrics of making it;
    get_state/set_state make it resumable (stored with every checkpoint)."""

    def next_batch(self, state: TrainState) -> tuple[dict[str, jax.Array], dict[str, float]]: ...
    def get_state(self) -> dict: ...
    def set_state(self, state: dict) -> None: ...


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step."""

    step: int
    state: TrainState
    metrics: dict[str, jax.Array]
    """The last update's metrics (objective, grad_norm and the objective's aux), on device."""
    source_metrics: dict[str, float]
    """Host-side metrics the batch source reported for this step (e.g. rewards)."""
    last: bool
    """The final step of the run."""
    stopping: bool
    """SIGTERM arrived: the loop stops after the hooks that run on stop."""
    steps_timed: int
    seconds_timed: float
    """Steps and seconds of training (hooks excluded) since the previous `log_metrics`."""
    trainer: Trainer

    def scalars(self, keys: Iterable[str] | None = None) -> dict[str, float]:
        keys = self.metrics if keys is None else keys
        return {k: float(self.metrics[k]) for k in keys if k in self.metrics}


@dataclasses.dataclass
class _Hook:
    fn: Callable[[StepInfo], dict[str, Any] | None]
    every: int
    on_stop: bool
    resets_timer: bool

    def due(self, info: StepInfo) -> bool:
        return info.step % self.every == 0 or info.last or (info.stopping and self.on_stop)


class IteratorSource:
    """A BatchSource over an iterator of whole batches (a Grain iterator, SFT rows)."""

    def __init__(self, trainer: Trainer, iterator):
        self.trainer, self.iterator = trainer, iterator

    def next_batch(self, state: TrainState):
        return self.trainer.global_batch(next(self.iterator)), {}

    def get_state(self) -> dict:
        return self.iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.iterator.set_state(state)


def _install_sigterm() -> dict:
    flag = {"stop": False}

    def handler(signum, frame):
        flag["stop"] = True

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. inside a test runner thread)
        pass
    return flag


class Trainer:
    """Owns the mesh, the jitted step and the loop of one run.

    `cfg.steps` counts batches; each batch makes `updates_per_batch` optimizer updates (GRPO's
    mu), so the schedule spans steps x updates_per_batch.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        objective: Callable[[Any], Objective] | None = None,
        *,
        updates_per_batch: int = 1,
        devices=None,
    ):
        self.cfg, self.updates_per_batch = cfg, updates_per_batch
        self.mesh = make_mesh(cfg.mesh, devices)
        # The config checks a fixed context size; -1 is sized only now.
        reason = unsplittable(cfg.data.seq_len, self.mesh.shape["context"], "data.seq_len")
        if reason:
            raise ConfigError(reason)
        n_batch_shards = batch_shards(self.mesh)
        micro_rows = cfg.data.batch_size // cfg.grad_accum
        if micro_rows % n_batch_shards:
            raise ConfigError(
                f"data.batch_size ({cfg.data.batch_size}) / grad_accum ({cfg.grad_accum}) = {micro_rows} "
                f"rows per micro-batch must divide over the {' x '.join(batch_axes(self.mesh))} mesh axes "
                f"({n_batch_shards} shards)"
            )
        self.lora = cfg.lora
        self.lora_dropout = cfg.lora is not None and cfg.lora.dropout > 0
        self.graphdef = graphdef_of(cfg.model, cfg.compute, cfg.lora)
        self.abstract_params = abstract_model_params(cfg.model, cfg.compute, self.mesh, cfg.lora)
        self.abstract_base = None
        """With LoRA: the frozen base's ShapeDtypeStructs; `abstract_params` is then the adapter's,
        the state (params, optimizer, checkpoints) the adapter's alone."""
        self.base_params = None
        if cfg.lora is not None:
            self.abstract_params, base = split_adapter(self.abstract_params)
            dtype = cfg.lora.base_dtype
            if dtype in QUANTIZED_DTYPES:  # QLoRA: the projections held quantized (engine/models/quantize.py)
                self.abstract_base = quantized_abstract(base, dtype)
            else:
                self.abstract_base = (
                    base
                    if dtype is None
                    else jax.tree.map(
                        lambda a: jax.ShapeDtypeStruct(
                            a.shape, np.dtype(jax.numpy.bfloat16 if dtype == "bfloat16" else dtype), sharding=a.sharding
                        ),
                        base,
                    )
                )
        self.quantized_base = cfg.lora is not None and cfg.lora.base_dtype in QUANTIZED_DTYPES
        # Trained beside the model's (or adapter's) params: the optimizer, its state's shardings,
        # the train step and the checkpoints below all cover them.
        self.abstract_params = {**self.abstract_params, **self.extra_trainable_params()}
        self.param_shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
        self.base_shardings = (
            None if self.abstract_base is None else jax.tree.map(lambda a: a.sharding, self.abstract_base)
        )
        warmup = cfg.compute.indexer_loss == "warmup" and cfg.model.mla.index_topk is not None
        self.tx, self.schedule = make_optimizer(  # the indexer's dense warm-up trains it alone (dsa.py)
            cfg.optimizer,
            cfg.schedule,
            cfg.steps * updates_per_batch,
            self.abstract_params,
            only="indexer" if warmup else None,
        )
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        self.opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sh: sh,
            abstract_opt,
            self.param_shardings,
            transform_non_params=lambda _: replicated(self.mesh),
        )
        if cfg.optimizer.host_offload:
            memories = {m.kind for m in self.mesh.devices.flat[0].addressable_memories()}
            if "pinned_host" not in memories:
                raise ConfigError(
                    f"optimizer.host_offload: the devices ({self.mesh.devices.flat[0].device_kind}) have no "
                    f"pinned_host memory to keep the optimizer's state in (theirs: {', '.join(sorted(memories))})"
                )
            self.tx = state_on_devices(self.tx, self.opt_shardings)
            self.opt_shardings = jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), self.opt_shardings)
        self.abstract_opt_state = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_opt, self.opt_shardings
        )
        lm = lambda graphdef: lm_objective(graphdef, cfg.z_loss, cfg.loss_tiles)  # noqa: E731
        self.objective = (objective or lm)(self.graphdef)
        self.batch_sharding = batch_sharding(self.mesh)
        self.hooks: list[_Hook] = []
        self.batch_shapes = lm_batch(cfg.data.batch_size, cfg.data.seq_len) if objective is None else None
        if self.batch_shapes is not None and self.lora_dropout:
            self.batch_shapes[LORA_SEED] = jax.ShapeDtypeStruct((cfg.data.batch_size, 1), np.int32)
        """A batch's shapes when known before the first one exists (language modelling), so the
        step compiles, and its memory is checked, before any state is allocated."""
        self._train_step: Any = None  # the jitted step (jitted_train_step), once made
        self._compiled_step: tuple[dict, Any] | None = None  # (batch signature, compiled step) ahead of time
        self._eval_step = None

    def extra_trainable_params(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Parameters a subclass trains beside the model's (a reward model's head), as top-level
        entries of the params tree, each a ShapeDtypeStruct with its sharding: the hook
        `__init__` calls before it lays out the optimizer over the tree. A subclass that adds
        some initialises them in `init_state`."""
        return {}

    # -- jitted functions (compiled lazily, once)
    def jitted_train_step(self):
        """The jitted `make_train_step` of this run (also what the preflight compiles, plan.py);
        with LoRA it takes the frozen base as a fourth argument (never donated)."""
        base = () if self.abstract_base is None else (self.base_shardings,)
        return jax.jit(
            make_train_step(self.objective, self.tx, self.cfg.grad_accum),
            in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding, *base),
            out_shardings=(self.param_shardings, self.opt_shardings, replicated(self.mesh)),
            donate_argnums=(0, 1),
        )

    def _base_args(self) -> tuple:
        if self.abstract_base is None:
            return ()
        if self.base_params is None:
            self.base_params = self.load_base()
        return (self.base_params,)

    def train_step(self, params, opt_state, batch):
        if self._compiled_step is None:
            self.compile_train_step(batch)
        signature, compiled = self._compiled_step
        # A 4-bit QLoRA base: XLA:CPU hands its quantized values over in an unpacked layout the
        # ahead-of-time executable refuses; jit's own call adopts the arrays' layouts.
        if _signature(batch) == signature and not (self.quantized_base and jax.default_backend() == "cpu"):
            return compiled(params, opt_state, batch, *self._base_args())
        with use_mesh(self.mesh):  # a batch of another shape or dtype: jit compiles it
            return self._train_step(params, opt_state, batch, *self._base_args())

    def lora_seeds(self, step: int, rows: int) -> jax.Array:
        """One dropout seed per row of step `step + 1`'s batch (engine/models/lora.py: dropout_rows)."""
        seeds = np.random.default_rng([self.cfg.seed, step, 0x10A]).integers(0, 2**31 - 1, (rows, 1), dtype=np.int32)
        return global_array(seeds, self.batch_sharding)

    def model_params(self, params):
        """The whole model's params for `params` of the state: with LoRA the adapter joined to
        the frozen base (no array copied), else params themselves."""
        return params if self.abstract_base is None else join(params, self._base_args()[0])

    def model_param_shardings(self):
        """Shardings of `model_params(...)`."""
        return self.param_shardings if self.abstract_base is None else join(self.param_shardings, self.base_shardings)

    def compile_train_step(self, batch) -> None:
        """Compile the step for batches like `batch` (arrays or ShapeDtypeStructs) from the
        abstract state, and refuse it, before anything runs, if its memory exceeds a device's
        (ConfigError naming the numbers and the knobs)."""
        self._train_step = self.jitted_train_step()
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in batch.items()}
        base = () if self.abstract_base is None else (self.abstract_base,)
        with use_mesh(self.mesh):
            compiled = (
                self._train_step.trace(self.abstract_params, self.abstract_opt_state, batch, *base).lower().compile()
            )
        devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]  # this host's
        trained = shard_bytes(self.abstract_params)
        memory = Memory.of(
            compiled.memory_analysis(),
            parameters=trained + sum(shard_bytes(b) for b in base),
            optimizer_state=shard_bytes(self.abstract_opt_state),
            batch=shard_bytes(batch),
            gradients=trained,
            platform=devices[0].platform,
        )
        to_fit = knobs(self.cfg, from_scratch=self.cfg.checkpoint.init_from is None)
        check_fits(memory, min(device_memory(d) for d in devices), self.mesh.size, devices[0].platform, to_fit)
        self._compiled_step = (_signature(batch), compiled)

    def eval_step(self, params, batch):
        if self._eval_step is None:
            base = () if self.base_shardings is None else (self.base_shardings,)
            self._eval_step = jax.jit(
                make_eval_step(self.objective),
                in_shardings=(self.param_shardings, self.batch_sharding, *base),
                out_shardings=replicated(self.mesh),
            )
        with use_mesh(self.mesh):
            return self._eval_step(params, batch, *self._base_args())

    def global_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global arrays from the whole batch, which every process holds: each process places
        only the rows (and, where an axis spans processes, the slices) its devices hold, so
        the result does not depend on the layout."""
        return {k: global_array(v, self.batch_sharding) for k, v in batch.items()}

    # -- state
    def load_base(self):
        """The frozen base of a LoRA run: checkpoint.init_from's params, in lora.base_dtype.
        Quantized (QLoRA): read on the host, then each weight is placed and quantized on the
        devices in turn, so no full-precision copy of the base is ever on them."""
        if not self.cfg.checkpoint.init_from:
            raise ConfigError("lora: needs checkpoint.init_from, the base model the adapter trains on")
        if self.cfg.lora.base_dtype not in QUANTIZED_DTYPES:
            return self._load_init_from(self.abstract_base)
        host = self._load_init_from(None, as_numpy=True)
        dtype = self.cfg.lora.base_dtype

        def place(path, value, want):
            attr = quantizable(path)
            if attr is None:
                return global_array(np.asarray(value, want.dtype), want.sharding)
            full = global_array(np.asarray(value, np.float32), NamedSharding(self.mesh, want.qvalue.sharding.spec))
            return jax.jit(
                lambda x: quantize_leaf(x, attr, dtype), out_shardings=jax.tree.map(lambda a: a.sharding, want)
            )(full)

        with use_mesh(self.mesh):
            return jax.tree_util.tree_map_with_path(place, host, self.abstract_base)

    def _load_init_from(self, abstract, *, as_numpy: bool = False):
        cfg = self.cfg
        assert cfg.checkpoint.init_from is not None  # only called when there is one
        _, stored = stored_configs(cfg.checkpoint.init_from)
        if stored.scan_layers != cfg.compute.scan_layers:  # the one compute setting that changes the layout
            raise ConfigError(
                f"checkpoint.init_from: {cfg.checkpoint.init_from} holds "
                f"{'stacked' if stored.scan_layers else 'per-layer'} "
                f"parameters; set compute.scan_layers: {str(stored.scan_layers).lower()} to restore them"
            )
        model_cfg, params, _ = load_params(cfg.checkpoint.init_from, abstract, as_numpy=as_numpy)
        # by the flat keys (num_heads, not the whole attention section) so the message names the field
        saved, wanted = flat_keys.unfold(model_cfg.model_dump()), flat_keys.unfold(cfg.model.model_dump())
        if saved != wanted:  # compute settings (precision, remat, ...) may differ; the architecture may not
            differing = ", ".join(f"{k} ({saved[k]!r} vs {wanted[k]!r})" for k in saved if saved[k] != wanted.get(k))
            raise ConfigError(
                f"checkpoint.init_from: {cfg.checkpoint.init_from} holds a different model architecture: {differing}"
            )
        return params

    def init_state(self) -> TrainState:
        """Fresh params (or checkpoint.init_from's, whose architecture must be this run's) and
        a fresh optimizer. With LoRA: a fresh adapter (PEFT's initialisation) on the base."""
        cfg = self.cfg
        if cfg.lora is not None:
            self._base_args()
            params = init_params(cfg.model, cfg.compute, self.mesh, cfg.seed, cfg.lora, adapter_only=True)
        elif cfg.checkpoint.init_from:
            params = self._load_init_from(self.abstract_params)
        else:
            params = init_params(cfg.model, cfg.compute, self.mesh, cfg.seed)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return TrainState(0, params, opt_state)

    def held_out_loss(self, params, batches: Iterable[dict[str, np.ndarray]]) -> dict[str, float]:
        """Token-mean loss over whole batches (pretraining's validation split, SFT's held-out
        examples, evaluation)."""
        nll, tokens = 0.0, 0.0
        for local in batches:
            aux = self.eval_step(params, self.global_batch(local))
            nll, tokens = nll + float(aux["nll_sum"]), tokens + float(aux["tokens"])
        loss = nll / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": tokens}

    # -- the loop
    def add_hook(
        self,
        fn: Callable[[StepInfo], dict[str, Any] | None],
        *,
        every: int = 1,
        on_stop: bool = False,
        resets_timer: bool = False,
    ) -> None:
        """Run `fn(info)` after every `every`-th step and the last one (and when stopping on
        SIGTERM if `on_stop`). Hooks run in the order added; what one returns joins the run's
        final metrics. A hook that `resets_timer` consumed the throughput figures
        (`info.steps_timed`, `info.seconds_timed`): the next one counts from zero."""
        self.hooks.append(_Hook(fn, every, on_stop, resets_timer))

    def fit(
        self,
        source: BatchSource,
        *,
        checkpointer: Checkpointer,
        log: Callable[[str], None],
        state: TrainState | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run to cfg.steps, resuming from the checkpointer's newest intact step (params,
        optimizer and the source's state; `Checkpointer.resume_step`). Returns the final state
        and metrics.

        Raises TrainingError for a non-finite loss (that step's checkpoint is never written;
        the last good one is kept), Preempted after SIGTERM once the hooks that run on stop
        (the checkpoint) have run, and CorruptCheckpoint when no stored step is intact.
        """
        cfg = self.cfg
        compiled_ahead = self._compiled_step is not None
        ahead_seconds = None  # the compile below, when it runs: what compile_seconds then reports
        if not compiled_ahead and self.batch_shapes is not None:  # before any state exists
            log("compiling the train step ...")
            start = time.perf_counter()
            self.compile_train_step(self.batch_shapes)
            ahead_seconds = time.perf_counter() - start
            log(f"compiled the train step in {ahead_seconds:.1f} s")
            compiled_ahead = True
        resume_step = checkpointer.resume_step(log)
        if resume_step is not None:
            params, opt_state, _, source_state = checkpointer.restore(
                resume_step, self.abstract_params, self.abstract_opt_state
            )
            source.set_state(source_state)
            state = TrainState(resume_step, params, opt_state)
            log(f"resumed from checkpoint step {resume_step} in {checkpointer.directory}")
        state = state or self.init_state()
        # One process: a Python SIGTERM handler. Several: JAX's coordination service owns SIGTERM
        # and the ranks agree on the step to stop at (preemption_agreed).
        stop = _install_sigterm() if jax.process_count() == 1 else {"stop": False}
        final: dict[str, Any] = {}

        def check_finite(step: int, metrics) -> None:
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                checkpointer.wait()
                kept = checkpointer.latest_step()
                what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm}; loss {loss:.4g})"
                raise TrainingError(
                    f"non-finite {what} at step {step}; stopped. "
                    + (
                        f"The last good checkpoint (step {kept}) in {checkpointer.directory} is intact"
                        if kept is not None
                        else f"No checkpoint was saved in {checkpointer.directory}"
                    )
                )

        pending = None  # the previous step's metrics, checked one step late to keep dispatch async
        steps_timed, seconds_timed, first = 0, 0.0, True
        if state.step < cfg.steps and not compiled_ahead:
            log(f"compiling the train step (with step {state.step + 1} of {cfg.steps}) ...")
        while state.step < cfg.steps:
            start = time.perf_counter()
            batch, source_metrics = source.next_batch(state)
            if self.lora_dropout:  # the rows' dropout seeds: from the run's seed and the step, layout-free
                batch = {**batch, LORA_SEED: self.lora_seeds(state.step, len(next(iter(batch.values()))))}
            for _ in range(self.updates_per_batch):
                state.params, state.opt_state, metrics = self.train_step(state.params, state.opt_state, batch)
            state.step += 1
            if first:  # keep compilation out of the throughput figures
                jax.block_until_ready(metrics)
                first_seconds = time.perf_counter() - start
                # What the log said compiling took: the ahead-of-time compile, else the first
                # step (compiled as it ran). Not the first step alone after an ahead compile.
                final["compile_seconds"] = ahead_seconds if ahead_seconds is not None else first_seconds
                if not compiled_ahead:
                    log(f"compiled and ran step {state.step} in {first_seconds:.1f} s")
                first = False
            else:
                steps_timed += 1
            stopping = preemption_agreed(state.step, stop["stop"])
            info = StepInfo(
                state.step, state, metrics, source_metrics, state.step == cfg.steps, stopping, steps_timed, 0.0, self
            )
            due = [hook for hook in self.hooks if hook.due(info)]
            if pending is not None:
                check_finite(*pending)
            pending = (state.step, metrics)
            if due:
                check_finite(state.step, metrics)
                pending = None
            if steps_timed:
                seconds_timed += time.perf_counter() - start
            info.seconds_timed = seconds_timed
            for hook in due:
                final.update(hook.fn(info) or {})
                if hook.resets_timer:
                    steps_timed, seconds_timed = 0, 0.0
            if stopping:
                checkpointer.close()
                raise Preempted(f"SIGTERM: saved checkpoint at step {state.step} in {checkpointer.directory}")
        if pending is not None:
            check_finite(*pending)
        return state, final
