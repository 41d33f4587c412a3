"""Pretraining: token shards in, checkpoints out (`python -m engine.train CONFIG.yaml`)."""

from __future__ import annotations

import sys
from typing import Any, Callable

import jax

from engine.config import ConfigError
from engine.data.pipeline import make_dataset
from engine.data.shards import read_meta
from engine.train.cli import run_cli
from engine.train.config import TrainConfig
from engine.train.hooks import log_to_stderr, run_training
from engine.train.step import Objective
from engine.train.trainer import IteratorSource, Trainer


def run_pretrain(cfg: TrainConfig, log: Callable[[str], None] | None = None,
                 objective: Callable[[Any], Objective] | None = None) -> dict[str, Any]:
    """Train `cfg.steps` steps, resuming from the latest checkpoint in checkpoint.directory.

    Returns the final metrics. Raises ConfigError for bad input, TrainingError for a
    non-finite loss (naming the step), Preempted after SIGTERM (a checkpoint is saved).
    `objective(graphdef)` replaces next-token cross-entropy.
    """
    log = log or log_to_stderr
    if not cfg.data.path:
        raise ConfigError("data.path is required: a token dataset directory written by the tokenize stage")
    if not cfg.checkpoint.directory:
        raise ConfigError("checkpoint.directory is required")
    meta = read_meta(cfg.data.path)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({meta['vocab_size']}) of dataset {cfg.data.path}"
        )
    trainer = Trainer(cfg, objective)
    train_data = make_dataset(
        cfg.data.path, "train", seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
        seed=cfg.data.seed, shuffle=cfg.data.shuffle, packing=cfg.data.packing,
        process_index=jax.process_index(), process_count=jax.process_count(), prefetch=cfg.data.worker_buffer,
    )
    evaluate = None
    if cfg.data.eval_split in meta["splits"] and cfg.data.eval_batches > 0:
        def evaluate(params):
            rows = iter(make_dataset(
                cfg.data.path, cfg.data.eval_split, seq_len=cfg.data.seq_len,
                batch_size=cfg.data.batch_size // cfg.grad_accum, shuffle=False, packing=cfg.data.packing,
                repeat=True, process_index=jax.process_index(), process_count=jax.process_count()))
            metrics = trainer.held_out_loss(params, (next(rows) for _ in range(cfg.data.eval_batches)))
            return {k: metrics[k] for k in ("eval_loss", "eval_perplexity")}
    return run_training(trainer, IteratorSource(trainer, iter(train_data)), log=log, evaluate=evaluate,
                        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len, logged=("loss", "grad_norm"))


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.train", TrainConfig, run_pretrain)


if __name__ == "__main__":
    sys.exit(main())
