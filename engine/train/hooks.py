"""The standard hooks of a training run, and `run_training`, which wires them to the loop.

    save_checkpoint    params, optimizer, the source's state and meta; also on SIGTERM
    log_metrics        metrics.jsonl, the sinks (TensorBoard, MLflow, W&B), the progress bar's
                       postfix: loss, grad_norm, learning rate, throughput and MFU, the batch
                       source's metrics
    evaluate_held_out  held-out metrics every eval_every steps and at the end
    advance_progress   a tqdm bar on the primary process

Every stage (pretrain, SFT, GRPO) runs `run_training(trainer, source, ...)`: the same
resume, cadence, stop and logging, whatever the batches and the loss. The checkpoint hook
runs first, so whatever fails after it (an evaluation, a full disk for the logs) leaves the
step's checkpoint committed; a retry that resumes at the final step finishes the final
evaluation instead of training again.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from engine.contract import CHECKPOINT_FORMAT, METRICS_FILE
from engine.data.urls import is_url
from engine.models.params import flops_per_token
from engine.models.quantize import describe_path
from engine.train.checkpoint import Checkpointer
from engine.train.metrics import MetricsWriter, flat_params, peak_flops, read_metrics
from engine.train.trainer import BatchSource, StepInfo, Trainer

_NOT_LOGGED = ("objective", "nll_sum", "tokens")  # sums that only normalise other metrics


def log_to_stderr(msg: str) -> None:
    """The default `log` of the run functions: one line to stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


def log_metrics(
    writer: MetricsWriter,
    *,
    tokens_per_step: int | None = None,
    progress: tqdm | None = None,
    keys: tuple[str, ...] | None = None,
) -> Callable[[StepInfo], dict]:
    """Write the step's metrics. `keys`: which of the update's metrics to log (None: all);
    with `tokens_per_step`, also tokens/s, TFLOP/s per device and MFU since the last log."""
    peak = flops_token = None

    def hook(info: StepInfo) -> dict:
        nonlocal peak, flops_token
        cfg, trainer = info.trainer.cfg, info.trainer
        # A mixture of experts' router losses and expert loads (engine/train/step.py) always.
        moe = [k for k in info.metrics if k.startswith("moe_")]
        update = info.scalars([*keys, *moe] if keys else [k for k in info.metrics if k not in _NOT_LOGGED])
        if "grad_norm" not in update:
            update["grad_norm"] = float(info.metrics["grad_norm"])
        values = {
            **info.source_metrics,
            **update,
            "learning_rate": float(trainer.schedule(info.step * trainer.updates_per_batch - 1)),
        }
        if tokens_per_step:
            if peak is None:
                peak, _ = peak_flops()
                flops_token = flops_per_token(cfg.model, cfg.data.seq_len)
            tokens_per_second = (
                info.steps_timed * tokens_per_step / info.seconds_timed if info.steps_timed else float("nan")
            )
            values.update(
                tokens_per_second=tokens_per_second,
                tflops_per_device=tokens_per_second * flops_token / jax.device_count() / 1e12,
                mfu=tokens_per_second * flops_token / peak,
            )
            if progress is not None:
                progress.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_second:,.0f}")
        writer.write(info.step, values)
        return values

    return hook


def evaluate_held_out(writer: MetricsWriter, evaluate: Callable[[Any], dict]) -> Callable[[StepInfo], dict]:
    def hook(info: StepInfo) -> dict:
        values = evaluate(info.state.params)
        writer.write(info.step, values)
        return values

    return hook


def save_checkpoint(checkpointer: Checkpointer, source: BatchSource, meta: dict) -> Callable[[StepInfo], None]:
    def hook(info: StepInfo) -> None:
        checkpointer.save(
            info.step, info.state.params, info.state.opt_state, {**meta, "step": info.step}, source.get_state()
        )

    return hook


def advance_progress(progress: tqdm) -> Callable[[StepInfo], None]:
    def hook(info: StepInfo) -> None:
        progress.update(1)

    return hook


def truncate_metrics(metrics_dir: str | Path, step: int) -> None:
    """After a resume, drop metrics logged past the checkpoint (they will be logged again)."""
    path = Path(metrics_dir) / METRICS_FILE
    if jax.process_index() != 0 or not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def finish_final_step(writer: MetricsWriter, metrics_dir: str | Path, state, evaluate) -> dict[str, Any]:
    """A run resumed at its final step trained nothing: take the final step's metrics from
    the log, and evaluate if the evaluation did not finish (it runs after the checkpoint)."""
    final: dict[str, Any] = {}
    for record in read_metrics(metrics_dir):
        if record.get("step") == state.step:
            final.update({k: v for k, v in record.items() if k != "step"})
    if evaluate is not None and "eval_loss" not in final:
        values = evaluate(state.params)
        writer.write(state.step, values)
        final.update(values)
    return final


def checkpoint_meta(trainer: Trainer, **extra) -> dict:
    """What every checkpoint records besides its arrays (engine.contract.CHECKPOINT_FORMAT)."""
    cfg = trainer.cfg
    meta = {
        "config": cfg.model_dump(mode="json"),
        "model": cfg.model.model_dump(mode="json"),
        "compute": cfg.compute.model_dump(mode="json"),
        "seed": cfg.seed,
        "format": CHECKPOINT_FORMAT,
        **extra,
    }
    init_from = cfg.checkpoint.init_from or ""
    if cfg.lora is not None and is_url(init_from):  # a base in a bucket is named by its URL
        meta["lora"] = {**cfg.lora.model_dump(mode="json"), "base_checkpoint": init_from}
    elif cfg.lora is not None:  # the params are an adapter of this base (engine/models/lora.py)
        assert cfg.checkpoint.directory is not None  # every entry point requires one
        base = Path(init_from).absolute()
        meta["lora"] = {
            **cfg.lora.model_dump(mode="json"),
            "base_checkpoint": str(base),
            "base_relative": os.path.relpath(base, Path(cfg.checkpoint.directory).absolute()),
        }
    return meta


def run_training(
    trainer: Trainer,
    source: BatchSource,
    *,
    log: Callable[[str], None],
    evaluate: Callable[[Any], dict] | None = None,
    meta: dict | None = None,
    tokens_per_step: int | None = None,
    logged: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Train to cfg.steps with the standard hooks (resuming from cfg.checkpoint.directory).

    `evaluate(params)` returns held-out metrics; `meta` joins each checkpoint's meta;
    `tokens_per_step` turns on throughput and MFU; `logged` picks the update metrics logged.
    Returns the final metrics.
    """
    cfg = trainer.cfg
    directory = cfg.checkpoint.directory
    assert directory is not None  # every entry point requires one (a ConfigError before this)
    if trainer.quantized_base:  # which path QLoRA takes on this platform
        assert cfg.lora is not None and cfg.lora.base_dtype is not None
        log(describe_path(cfg.lora.base_dtype, trainer.mesh.devices.flat[0].platform))
    checkpointer = Checkpointer(directory, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    metrics_dir = cfg.metrics_dir or str(Path(directory).parent)
    primary = jax.process_index() == 0
    try:
        resume_step = checkpointer.resume_step(log) or 0  # fit resumes from the same step
    except BaseException:
        checkpointer.close()
        raise
    truncate_metrics(metrics_dir, resume_step)
    writer = MetricsWriter(
        metrics_dir,
        enabled=primary,
        sinks=cfg.metrics,
        params=flat_params(
            {k: v for k, v in cfg.model_dump(mode="json").items() if k not in ("metrics", "metrics_dir")}
        ),
        warn=log,
    )
    progress = None
    if cfg.progress and primary:
        progress = tqdm(
            total=cfg.steps, initial=resume_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
        )
    # The step's metrics line before its checkpoint: a run killed between the two resumes from
    # the previous checkpoint and logs the step again, never after a checkpoint whose line is
    # lost. The evaluation after it: a failing evaluation must not cost the step's checkpoint.
    trainer.add_hook(
        log_metrics(writer, tokens_per_step=tokens_per_step, progress=progress, keys=logged),
        every=cfg.log_every,
        resets_timer=True,
    )
    trainer.add_hook(
        save_checkpoint(checkpointer, source, checkpoint_meta(trainer, **(meta or {}))),
        every=cfg.checkpoint.every_steps,
        on_stop=True,
    )
    if evaluate is not None:
        trainer.add_hook(evaluate_held_out(writer, evaluate), every=cfg.eval_every or cfg.steps)
    if progress is not None:
        trainer.add_hook(advance_progress(progress))
    try:
        state, final = trainer.fit(source, checkpointer=checkpointer, log=log)
        if resume_step >= cfg.steps:  # the final checkpoint was there: finish what came after it
            final.update(finish_final_step(writer, metrics_dir, state, evaluate))
    finally:
        if progress is not None:
            progress.close()
        writer.close()
        checkpointer.close()
    final.update(
        steps=state.step,
        final_loss=final.get("loss"),
        num_params=cfg.model.num_params(),
        layout={"processes": jax.process_count(), "devices": jax.device_count(), "mesh": dict(trainer.mesh.shape)},
    )
    if tokens_per_step:
        peak, peak_source = peak_flops()
        final.update(tokens=state.step * tokens_per_step, peak_flops=peak, peak_flops_source=peak_source)
    return final
