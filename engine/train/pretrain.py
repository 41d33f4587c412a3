"""Pretraining: token shards in, checkpoints out (`python -m engine.train CONFIG.yaml`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from engine.config import ConfigError
from engine.data.pipeline import make_dataset
from engine.data.shards import read_meta
from engine.train.cli import run_cli
from engine.train.config import TrainConfig
from engine.train.hooks import log_to_stderr, run_training
from engine.train.plan import DoesNotFit, plan_train
from engine.train.step import Objective
from engine.train.trainer import IteratorSource, Trainer


def check_splits(cfg: TrainConfig, meta: dict) -> bool:
    """Refuse, before anything compiles, splits that would fail or mean nothing later: a train
    split too small for one batch, an evaluation split too small for one row. Returns whether
    to evaluate (the split exists and data.eval_batches > 0). Sizes come from meta.json."""
    data = cfg.data

    def size(split: str) -> tuple[int | None, int | None]:
        """(documents, target tokens) of a split; None where meta.json does not say."""
        info = meta["splits"][split]
        if not info.get("shards"):
            return 0, 0
        documents, tokens = info.get("documents"), info.get("tokens")
        return documents, None if documents is None or tokens is None else tokens - documents

    if "train" not in meta["splits"]:
        raise ConfigError(f"data.path: dataset {data.path} has no 'train' split (has: {', '.join(meta['splits'])})")
    documents, targets = size("train")
    if documents == 0:
        raise ConfigError(f"data.path: the 'train' split of {data.path} has no documents; tokenize more input")
    batch_tokens = data.batch_size * data.seq_len
    if data.packing and targets is not None and targets < batch_tokens:
        raise ConfigError(
            f"data.path: the 'train' split of {data.path} holds {targets} tokens to predict, fewer than one batch "
            f"(data.batch_size {data.batch_size} x data.seq_len {data.seq_len} = {batch_tokens}); tokenize more "
            "input or make the batch smaller"
        )
    if not data.packing and documents is not None and documents < data.batch_size:
        raise ConfigError(
            f"data.path: the 'train' split of {data.path} has {documents} documents, fewer than one batch's rows "
            f"(data.batch_size {data.batch_size}, data.packing false); tokenize more input or make the batch smaller"
        )

    if data.eval_split not in meta["splits"] or data.eval_batches == 0:
        return False
    documents, targets = size(data.eval_split)
    fix = "set data.eval_batches=0 to train without evaluation, or re-tokenize with a larger validation_fraction"
    if documents == 0:
        raise ConfigError(
            f"data.path: the '{data.eval_split}' split of {data.path} has no documents, but "
            f"evaluation is configured (data.eval_batches={data.eval_batches}); {fix}"
        )
    row_tokens = data.seq_len if data.packing else 1
    if targets is not None and targets < row_tokens:
        raise ConfigError(
            f"data.path: the '{data.eval_split}' split of {data.path} holds {targets} tokens to predict, fewer "
            f"than one evaluation row (data.seq_len {data.seq_len}); {fix}"
        )
    return True


def run_pretrain(
    cfg: TrainConfig, log: Callable[[str], None] | None = None, objective: Callable[[Any], Objective] | None = None
) -> dict[str, Any]:
    """Train `cfg.steps` steps, resuming from the latest checkpoint in checkpoint.directory.

    Returns the final metrics. Raises ConfigError for bad input (before anything compiles:
    see `check_splits`), TrainingError for a non-finite loss (naming the step), Preempted
    after SIGTERM (a checkpoint is saved).
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
    evaluating = check_splits(cfg, meta)
    trainer = Trainer(cfg, objective)
    train_data = make_dataset(
        cfg.data.path,
        "train",
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
        packing=cfg.data.packing,
        prefetch=cfg.data.worker_buffer,
    )
    evaluate = None
    if evaluating:

        def evaluate(params):
            rows = iter(
                make_dataset(
                    cfg.data.path,
                    cfg.data.eval_split,
                    seq_len=cfg.data.seq_len,
                    batch_size=cfg.data.batch_size // cfg.grad_accum,
                    shuffle=False,
                    packing=cfg.data.packing,
                    repeat=True,
                )
            )
            metrics = trainer.held_out_loss(params, (next(rows) for _ in range(cfg.data.eval_batches)))
            return {k: metrics[k] for k in ("eval_loss", "eval_perplexity")}

    return run_training(
        trainer,
        IteratorSource(trainer, iter(train_data)),
        log=log,
        evaluate=evaluate,
        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
        logged=("loss", "grad_norm"),
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.train", TrainConfig, run_pretrain, failures=(DoesNotFit,), plan=plan_train)


if __name__ == "__main__":
    sys.exit(main())
