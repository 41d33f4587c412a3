"""Pretraining: the jitted train step, the loop around it, and the `python -m engine.train` CLI.

The core is pure: `loss_fn(params, batch)` and `train_step(params, opt_state, batch)` are
functions of arrays. The loop adds what touches the outside world: data, checkpoints,
metrics, signals. Later stages (SFT, GRPO) reuse `Trainer` with their own loss.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from engine import data as data_lib
from engine.checkpoint import Checkpointer, load_params
from engine.config import MODEL_RUN_FIELDS, ConfigError, ModelConfig, TrainConfig, load_config
from engine.metrics import MetricsWriter, peak_flops, read_metrics
from engine.model import Transformer, flops_per_token
from engine.optim import make_optimizer
from engine.sharding import batch_sharding, check_divisible, logical_to_spec, make_mesh, replicated, use_mesh


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the last good checkpoint is kept."""


class Preempted(RuntimeError):
    """SIGTERM arrived; a checkpoint of the current step was saved."""


# --------------------------------------------------------------------------- params


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def param_shardings(model_cfg: ModelConfig, mesh: Mesh | None):
    """Per-parameter NamedSharding from the logical names in the model's metadata."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
    if mesh is None:
        return shapes, None

    def to_sharding(path, shape, names):
        spec = logical_to_spec(names)
        check_divisible(_path_name(path), shape.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(
        to_sharding, shapes, logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    return shapes, shardings


def abstract_model_params(model_cfg: ModelConfig, mesh: Mesh | None):
    """ShapeDtypeStructs (with shardings on `mesh`) of the model's parameters."""
    shapes, shardings = param_shardings(model_cfg, mesh)
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_params(model_cfg: ModelConfig, mesh: Mesh, seed: int):
    """Initialise directly into the sharded layout (no full copy on one device)."""
    _, shardings = param_shardings(model_cfg, mesh)

    def init():
        return nnx.to_pure_dict(nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(seed)))[1])

    with use_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)()


def graphdef_of(model_cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))[0]


def apply_model(graphdef, params, tokens, positions=None, segment_ids=None):
    return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


# --------------------------------------------------------------------------- loss and step


def cross_entropy(logits_btv, targets_bt, mask_bt, z_loss: float = 0.0):
    """(sum of masked NLL + z-loss terms, sum of masked NLL). Float32 throughout."""
    logits = logits_btv.astype(jnp.float32)
    log_z_bt = jax.nn.logsumexp(logits, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    nll_sum = jnp.sum((log_z_bt - target_logit_bt) * mask_bt)
    total = nll_sum + z_loss * jnp.sum(jnp.square(log_z_bt) * mask_bt)
    return total, nll_sum


def lm_loss_fn(graphdef, z_loss: float):
    """loss_fn(params, batch, normaliser) -> (loss, aux) for next-token prediction."""

    def loss_fn(params, batch, normaliser):
        logits = apply_model(graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        total, nll_sum = cross_entropy(logits, batch["targets"], batch["loss_mask"], z_loss)
        return total / normaliser, {"nll_sum": nll_sum, "tokens": jnp.sum(batch["loss_mask"])}

    return loss_fn


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, grad_accum: int):
    """train_step(params, opt_state, batch) -> (params, opt_state, metrics).

    With grad_accum > 1 the batch is split into micro-batches (rows i, i+A, i+2A, ... so
    each stays evenly sharded) and gradients are summed; the loss is normalised by the
    token count of the whole batch, so accumulation equals one big batch exactly in math.
    """

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(params, opt_state, batch):
        normaliser = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        if grad_accum == 1:
            (loss, aux), grads = grad_fn(params, batch, normaliser)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch
            )

            def body(carry, mb):
                (loss, aux), grads = grad_fn(params, mb, normaliser)
                return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

            zeros = (jnp.zeros(()), {"nll_sum": jnp.zeros(()), "tokens": jnp.zeros(())},
                     jax.tree.map(jnp.zeros_like, params))
            (loss, aux, grads), _ = jax.lax.scan(body, zeros, micro)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": aux["nll_sum"] / normaliser,
            "objective": loss,
            "grad_norm": optax.tree.norm(grads),
            "tokens": aux["tokens"],
        }
        return params, opt_state, metrics

    return train_step


def make_eval_step(loss_fn: Callable):
    def eval_step(params, batch):
        _, aux = loss_fn(params, batch, 1.0)
        return aux

    return eval_step


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class TrainState:
    step: int
    params: Any
    opt_state: Any


class Trainer:
    """Owns the mesh, the jitted step, checkpoints and metrics of one run."""

    def __init__(self, cfg: TrainConfig, loss_fn_factory: Callable | None = None, devices=None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg.mesh, devices)
        n_batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro_rows = cfg.data.batch_size // cfg.grad_accum
        if micro_rows % n_batch_shards:
            raise ConfigError(
                f"data.batch_size ({cfg.data.batch_size}) / grad_accum ({cfg.grad_accum}) = {micro_rows} "
                f"rows per micro-batch must divide over the data x fsdp mesh axes ({n_batch_shards} shards)"
            )
        self.graphdef = graphdef_of(cfg.model)
        self.abstract_params = abstract_model_params(cfg.model, self.mesh)
        self.param_shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.schedule, cfg.steps, self.abstract_params)
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        self.opt_shardings = optax.tree_map_params(
            self.tx, lambda _, sh: sh, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: replicated(self.mesh),
        )
        self.abstract_opt_state = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_opt, self.opt_shardings
        )
        factory = loss_fn_factory or (lambda graphdef: lm_loss_fn(graphdef, cfg.z_loss))
        self.loss_fn = factory(self.graphdef)
        self.batch_sharding = batch_sharding(self.mesh)
        self._train_step = None
        self._eval_step = None

    # -- jitted functions (compiled lazily, once)
    def train_step(self, params, opt_state, batch):
        if self._train_step is None:
            step = make_train_step(self.loss_fn, self.tx, self.cfg.grad_accum)
            self._train_step = jax.jit(
                step,
                in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding),
                out_shardings=(self.param_shardings, self.opt_shardings, replicated(self.mesh)),
                donate_argnums=(0, 1),
            )
        with use_mesh(self.mesh):
            return self._train_step(params, opt_state, batch)

    def eval_step(self, params, batch):
        if self._eval_step is None:
            self._eval_step = jax.jit(
                make_eval_step(self.loss_fn),
                in_shardings=(self.param_shardings, self.batch_sharding),
                out_shardings=replicated(self.mesh),
            )
        with use_mesh(self.mesh):
            return self._eval_step(params, batch)

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local_batch.items()}

    def init_state(self) -> TrainState:
        cfg = self.cfg
        if cfg.checkpoint.init_from:
            model_cfg, params, _ = load_params(cfg.checkpoint.init_from, self.abstract_params)
            # Precision, initialisation and memory settings may differ; the architecture may not.
            saved = model_cfg.model_dump(exclude=MODEL_RUN_FIELDS)
            wanted = cfg.model.model_dump(exclude=MODEL_RUN_FIELDS)
            if saved != wanted:
                differing = ", ".join(f"{k} ({saved[k]!r} vs {wanted[k]!r})" for k in saved if saved[k] != wanted.get(k))
                raise ConfigError(
                    f"checkpoint.init_from: {cfg.checkpoint.init_from} holds a different model architecture: {differing}"
                )
        else:
            params = init_params(cfg.model, self.mesh, cfg.seed)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return TrainState(0, params, opt_state)

    def evaluate(self, params, dataset_dir: str, split: str, batches: int) -> dict[str, float]:
        cfg = self.cfg
        it = iter(data_lib.make_dataset(
            dataset_dir, split, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size // cfg.grad_accum,
            shuffle=False, packing=cfg.data.packing, repeat=True,
            process_index=jax.process_index(), process_count=jax.process_count(),
        ))
        nll, tokens = 0.0, 0.0
        for _ in range(batches):
            aux = self.eval_step(params, self.global_batch(next(it)))
            nll += float(aux["nll_sum"])
            tokens += float(aux["tokens"])
        loss = nll / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def _install_sigterm() -> dict:
    flag = {"stop": False}

    def handler(signum, frame):
        flag["stop"] = True

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. inside a test runner thread)
        pass
    return flag


def log_to_stderr(msg: str) -> None:
    """The default `log` of the run functions: one line to stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


def run_pretrain(
    cfg: TrainConfig, log: Callable[[str], None] | None = None, loss_fn_factory: Callable | None = None
) -> dict[str, Any]:
    """Train `cfg.steps` steps, resuming from the latest checkpoint in checkpoint.directory.

    Returns the final metrics. Raises ConfigError for bad input, TrainingError for a
    non-finite loss (naming the step), Preempted after SIGTERM (a checkpoint is saved).
    """
    log = log or log_to_stderr
    if not cfg.data.path:
        raise ConfigError("data.path is required: a token dataset directory written by the tokenize stage")
    if not cfg.checkpoint.directory:
        raise ConfigError("checkpoint.directory is required")
    meta = data_lib.read_meta(cfg.data.path)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({meta['vocab_size']}) of dataset {cfg.data.path}"
        )
    trainer = Trainer(cfg, loss_fn_factory)
    train_data = data_lib.make_dataset(
        cfg.data.path, "train", seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
        seed=cfg.data.seed, shuffle=cfg.data.shuffle, packing=cfg.data.packing,
        process_index=jax.process_index(), process_count=jax.process_count(), prefetch=cfg.data.worker_buffer,
    )
    evaluate = None
    if cfg.data.eval_split in meta["splits"] and cfg.data.eval_batches > 0:
        def evaluate(params):
            return trainer.evaluate(params, cfg.data.path, cfg.data.eval_split, cfg.data.eval_batches)
    return train_loop(cfg, trainer, iter(train_data), evaluate, log)


def train_loop(cfg: TrainConfig, trainer: Trainer, data_iter, evaluate: Callable | None,
               log: Callable[[str], None], extra_meta: dict | None = None) -> dict[str, Any]:
    """The loop every gradient stage shares (pretrain, SFT): resume, step, log, evaluate,
    checkpoint, stop cleanly on SIGTERM.

    `data_iter` yields this process's batches (tokens, targets, positions, segment_ids,
    loss_mask) and has get_state()/set_state() for checkpoints; `evaluate(params)` returns
    held-out metrics; `extra_meta` is stored in each checkpoint's meta.
    """
    ckpt = Checkpointer(cfg.checkpoint.directory, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    metrics_dir = cfg.metrics_dir or str(Path(cfg.checkpoint.directory).parent)
    is_primary = jax.process_index() == 0
    resume_step = ckpt.latest_step()
    if resume_step is not None:
        params, opt_state, ckpt_meta, data_state = ckpt.restore(
            resume_step, trainer.abstract_params, trainer.abstract_opt_state
        )
        data_iter.set_state(data_state)
        state = TrainState(resume_step, params, opt_state)
        log(f"resumed from checkpoint step {resume_step} in {cfg.checkpoint.directory}")
    else:
        state = trainer.init_state()
    _truncate_metrics(metrics_dir, state.step)
    writer = MetricsWriter(metrics_dir, enabled=is_primary)
    has_eval = evaluate is not None

    flops_token = flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = peak_flops()
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    stop = _install_sigterm()
    progress = _progress_bar(cfg, state.step)

    def ckpt_meta_for(step):
        return {"step": step, "config": cfg.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json"),
                "seed": cfg.seed, "format": "trainflow.checkpoint/1", **(extra_meta or {})}

    def check_finite(step, metrics):
        loss = float(metrics["loss"])
        if not math.isfinite(loss) or not math.isfinite(float(metrics["grad_norm"])):
            ckpt.wait()
            last = ckpt.latest_step()
            raise TrainingError(
                f"non-finite loss ({loss}) at step {step}; stopped. The last good checkpoint "
                f"(step {last}) in {cfg.checkpoint.directory} is intact"
            )
        return loss

    final: dict[str, Any] = {}
    pending = None  # (step, metrics) of the previous step, checked one step late to keep dispatch async
    window_start, window_steps, first_step = time.perf_counter(), 0, True
    try:
        while state.step < cfg.steps:
            batch = trainer.global_batch(next(data_iter))
            state.params, state.opt_state, metrics = trainer.train_step(state.params, state.opt_state, batch)
            state.step += 1
            window_steps += 1
            if first_step:  # keep compilation out of the throughput figures
                jax.block_until_ready(metrics)
                final["compile_seconds"] = time.perf_counter() - window_start
                window_start, window_steps, first_step = time.perf_counter(), 0, False
            if pending is not None:
                check_finite(*pending)
            pending = (state.step, metrics)
            step = state.step
            log_now = step % cfg.log_every == 0 or step == cfg.steps
            save_now = step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or stop["stop"]
            eval_now = has_eval and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0))
            if log_now or save_now or eval_now:
                loss = check_finite(step, metrics)
                pending = None
            if log_now:
                elapsed = time.perf_counter() - window_start
                tokens_per_second = window_steps * tokens_per_step / elapsed if window_steps else float("nan")
                values = {
                    "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                    "learning_rate": float(trainer.schedule(step - 1)),
                    "tokens_per_second": tokens_per_second,
                    "tflops_per_device": tokens_per_second * flops_token / jax.device_count() / 1e12,
                    "mfu": tokens_per_second * flops_token / peak,
                }
                writer.write(step, values)
                final.update(values)
                if progress is not None:
                    progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:,.0f}")
                window_start, window_steps = time.perf_counter(), 0
            if eval_now:
                eval_metrics = evaluate(state.params)
                writer.write(step, eval_metrics)
                final.update(eval_metrics)
                window_start = time.perf_counter()
            if save_now:
                ckpt.save(step, state.params, state.opt_state, ckpt_meta_for(step), data_iter.get_state())
            if progress is not None:
                progress.update(1)
            if stop["stop"]:
                ckpt.close()
                raise Preempted(f"SIGTERM: saved checkpoint at step {step} in {cfg.checkpoint.directory}")
    finally:
        if progress is not None:
            progress.close()
        writer.close()
        ckpt.close()
    final.update({
        "steps": state.step, "final_loss": final.get("loss"),
        "tokens": state.step * tokens_per_step, "num_params": cfg.model.num_params(),
        "peak_flops": peak, "peak_flops_source": peak_source,
    })
    return final


def _truncate_metrics(metrics_dir: str, step: int) -> None:
    """After a resume, drop metrics logged past the checkpoint (they will be logged again)."""
    path = Path(metrics_dir) / "metrics.jsonl"
    if jax.process_index() != 0 or not path.is_file():
        return
    import json

    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _progress_bar(cfg: TrainConfig, start: int):
    if not cfg.progress or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)


# --------------------------------------------------------------------------- CLI


def maybe_initialize_distributed() -> None:
    """Join a multi-process run when the launcher set TRAINFLOW_COORDINATOR etc."""
    import os

    if "TRAINFLOW_COORDINATOR" not in os.environ:
        return
    # Must precede backend start-up; only the CPU client reads it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["TRAINFLOW_COORDINATOR"],
        num_processes=int(os.environ["TRAINFLOW_NUM_PROCESSES"]),
        process_id=int(os.environ["TRAINFLOW_PROCESS_ID"]),
    )


def run_cli(argv: list[str] | None, module: str, schema, run: Callable, failures: tuple = ()) -> int:
    """`python -m <module> CONFIG.yaml [key=value ...]` for a training entry point.

    Exit codes (the launchers rely on them): 0 success, 2 a config error (one line, no
    traceback), 1 a failed run (e.g. a non-finite loss), 143 stopped by SIGTERM after saving
    a checkpoint. The final stdout line is {"result": metrics}.
    """
    import json

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m {module} CONFIG.yaml [key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0], argv[1:], schema=schema)
        maybe_initialize_distributed()
        result = run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, *failures) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(str(e), file=sys.stderr)
        return 143
    print(json.dumps({"result": result}))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.train", TrainConfig, run_pretrain)


if __name__ == "__main__":
    sys.exit(main())
