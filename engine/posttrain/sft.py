"""Supervised fine-tuning: chat or prompt/completion examples, loss on the answer tokens.

Data is JSONL, one example per line, in either of TRL's formats:

    {"prompt": "2+2=", "completion": " 4"}                       prompt/completion (text)
    {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

Text is framed as in pretraining (the tokenizer's bos, if it adds one) with the eos token
appended to the completion; conversations are rendered with the tokenizer's chat template,
or engine/data/chat.py's default when it has none. `loss_on: completion` puts the loss on the
completion / the assistant turns only (TRL's completion_only_loss / assistant_only_loss);
`all` on every token.

Examples are packed into rows with segment ids (attention never crosses an example, so a
packed batch gives the loss the same examples give unpacked), and the rest is the trainer
(engine/train: checkpoints, resume, metrics, SIGTERM), minimising next-token cross-entropy
on the masked tokens. Training starts from the params of `checkpoint.init_from` with a
fresh optimizer.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.data.chat import assistant_spans, render
from engine.models.config import ComputeConfig, ModelConfig
from engine.posttrain.config import SFTConfig, SFTDataConfig
from engine.posttrain.finetune import finetune_start, read_jsonl
from engine.train.cli import run_cli
from engine.train.config import TrainConfig, trainer_view
from engine.train.hooks import log_to_stderr, run_training
from engine.train.plan import InputModels, StepSpec, fine_tuned_model
from engine.train.trainer import IteratorSource, Trainer

# --------------------------------------------------------------------------- config


def train_config(cfg: SFTConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """The trainer's view of an SFT run."""
    data = cfg.data
    rows = {"seq_len": data.seq_len, "batch_size": data.batch_size, "seed": data.seed, "shuffle": data.shuffle}
    return trainer_view(cfg, model_cfg, compute, {**rows, "packing": data.packing}, stage="sft")


# --------------------------------------------------------------------------- examples


@dataclass
class Example:
    ids: np.ndarray  # (n,) int32: the whole example, special tokens included
    loss: np.ndarray  # (n,) float32: 1 where token i is a target the loss counts


def _mask_from_offsets(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens that start inside one of the character spans."""
    starts = np.array([start for start, _ in offsets])
    mask = np.zeros(len(offsets), np.float32)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1.0
    return mask


def tokenize_example(record: dict, where: str, bundle, data: SFTDataConfig) -> Example:
    kind = data.format
    if kind == "auto":
        kind = "messages" if data.messages_field in record else "prompt_completion"
    fields = [data.messages_field] if kind == "messages" else [data.prompt_field, data.completion_field]
    for field in fields:
        if field not in record:
            raise ConfigError(f"{where}: no '{field}' key (the record has: {', '.join(record) or 'nothing'})")
    try:
        if kind == "messages":
            text, spans = assistant_spans(bundle, record[data.messages_field])
            encoding = bundle.tokenizer.encode(text, add_special_tokens=False)
            loss = _mask_from_offsets(encoding.offsets, spans)
            ids = list(encoding.ids)
        else:
            prompt, completion = record[data.prompt_field], record[data.completion_field]
            if isinstance(prompt, list) != isinstance(completion, list):
                raise ConfigError("prompt and completion must both be text or both be message lists")
            if isinstance(prompt, list):  # conversational prompt/completion
                before = render(bundle, prompt, add_generation_prompt=True)
                text = render(bundle, prompt + completion)
                if not text.startswith(before):
                    raise ConfigError("the chat template does not render the prompt as a prefix of the conversation")
                encoding = bundle.tokenizer.encode(text, add_special_tokens=False)
                ids, loss = list(encoding.ids), _mask_from_offsets(encoding.offsets, [(len(before), len(text))])
            else:
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise ConfigError("prompt and completion must be strings or message lists")
                encoding = bundle.tokenizer.encode(prompt + completion, add_special_tokens=True)
                # Specials the post-processor adds (bos) have offset (0, 0): they count as prompt.
                starts = np.array(
                    [
                        s if not special else -1
                        for (s, _), special in zip(encoding.offsets, encoding.special_tokens_mask)
                    ]
                )
                ids = list(encoding.ids) + [bundle.eos_id]
                loss = np.append((starts >= len(prompt)).astype(np.float32), 1.0)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if data.loss_on == "all":
        loss = np.ones(len(ids), np.float32)
    loss = np.asarray(loss, np.float32)
    loss[0] = 0.0  # the first token is never a target
    return Example(np.asarray(ids, np.int32), loss)


def load_examples(data: SFTDataConfig, bundle) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples, tokenized."""
    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of SFT examples")
    records = read_jsonl(data.path)
    examples = [tokenize_example(r, where, bundle, data) for where, r in records]
    if data.eval_path:
        held_out = [tokenize_example(r, where, bundle, data) for where, r in read_jsonl(data.eval_path)]
    else:
        n_eval = int(round(len(examples) * data.eval_fraction))
        examples, held_out = examples[: len(examples) - n_eval], examples[len(examples) - n_eval :]
    if not examples:
        raise ConfigError(f"data.path: {data.path} has no training examples")
    if not any(e.loss[1:].any() for e in examples):
        raise ConfigError(f"data.path: no example of {data.path} has a token to train on (empty completions?)")
    return examples, held_out


# --------------------------------------------------------------------------- rows and batches


def pack_rows(examples: list[Example], seq_len: int, packing: bool) -> dict[str, np.ndarray]:
    """Examples -> rows of tokens, targets, positions, segment_ids, loss_mask (rows, seq_len).

    Packing fills a row with whole examples in order (first fit, no splitting); an example
    longer than the row is truncated to it.
    """
    rows: list[list[Example]] = []
    used = seq_len
    for example in examples:
        n = min(len(example.ids) - 1, seq_len)  # an example of n + 1 tokens has n targets
        if n <= 0:
            continue
        if not packing or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += n
    out = {key: np.zeros((len(rows), seq_len), np.int32) for key in ("tokens", "targets", "positions", "segment_ids")}
    out["loss_mask"] = np.zeros((len(rows), seq_len), np.float32)
    for r, row in enumerate(rows):
        at = 0
        for segment, example in enumerate(row, 1):
            n = min(len(example.ids) - 1, seq_len)
            out["tokens"][r, at : at + n] = example.ids[:n]
            out["targets"][r, at : at + n] = example.ids[1 : n + 1]
            out["positions"][r, at : at + n] = np.arange(n)
            out["segment_ids"][r, at : at + n] = segment
            out["loss_mask"][r, at : at + n] = example.loss[1 : n + 1]
            at += n
    return out


class SFTBatches:
    """Endless batches over epochs, reshuffled each epoch; its state is (epoch, row).

    Every process packs the same rows; the trainer keeps the ones its devices hold.
    """

    def __init__(
        self, examples: list[Example], *, seq_len: int, batch_size: int, packing: bool, shuffle: bool, seed: int
    ):
        self.examples, self.seq_len, self.batch_size = examples, seq_len, batch_size
        self.packing, self.shuffle, self.seed = packing, shuffle, seed
        self.epoch, self.row = 0, 0
        self._rows: dict[str, np.ndarray] | None = None

    def _epoch_rows(self) -> dict[str, np.ndarray]:
        if self._rows is None:
            order = np.arange(len(self.examples))
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            self._rows = pack_rows([self.examples[i] for i in order], self.seq_len, self.packing)
        return self._rows

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        pieces = []
        needed = self.batch_size
        while needed:
            rows = self._epoch_rows()
            take = min(needed, len(rows["tokens"]) - self.row)
            pieces.append({k: v[self.row : self.row + take] for k, v in rows.items()})
            self.row += take
            needed -= take
            if self.row == len(rows["tokens"]):
                self.epoch, self.row, self._rows = self.epoch + 1, 0, None
        batch = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        return batch

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "row": self.row}

    def set_state(self, state: dict) -> None:
        self.epoch, self.row, self._rows = int(state["epoch"]), int(state["row"]), None


def eval_batches(examples: list[Example], *, seq_len: int, rows_per_batch: int, packing: bool):
    """Held-out rows in order, the last batch filled with empty rows (which carry no loss)."""
    rows = pack_rows(examples, seq_len, packing)
    n = len(rows["tokens"])
    padded = math.ceil(n / rows_per_batch) * rows_per_batch
    rows = {k: np.concatenate([v, np.zeros((padded - n, *v.shape[1:]), v.dtype)]) for k, v in rows.items()}
    for start in range(0, padded, rows_per_batch):
        yield {k: v[start : start + rows_per_batch] for k, v in rows.items()}


# --------------------------------------------------------------------------- the run


def run_sft(cfg: SFTConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fine-tune `checkpoint.init_from` for `cfg.steps` steps (resuming if checkpoints exist)."""
    log = log or log_to_stderr
    model_cfg, compute, bundle = finetune_start(cfg)
    train_examples, held_out = load_examples(cfg.data, bundle)
    log(f"sft: {len(train_examples)} training and {len(held_out)} held-out examples")
    if held_out and not pack_rows(held_out, cfg.data.seq_len, cfg.data.packing)["loss_mask"].any():
        where = (
            f"data.eval_path: {cfg.data.eval_path}"
            if cfg.data.eval_path
            else f"data.eval_fraction: the last {len(held_out)} examples of {cfg.data.path}"
        )
        raise ConfigError(  # caught before step 1, not at the first evaluation
            f"{where}: the held-out examples give no token to evaluate (empty completions or assistant turns, "
            f"or cut off by data.seq_len {cfg.data.seq_len}); fix them, or hold out none"
        )
    tcfg = train_config(cfg, model_cfg, compute)
    trainer = Trainer(tcfg)
    batches = SFTBatches(
        train_examples,
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        packing=cfg.data.packing,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
    )
    evaluate = None
    if held_out:

        def evaluate(params) -> dict[str, float]:
            rows = eval_batches(
                held_out,
                seq_len=cfg.data.seq_len,
                rows_per_batch=cfg.data.batch_size // cfg.grad_accum,
                packing=cfg.data.packing,
            )
            if cfg.data.eval_batches:
                rows = (batch for i, batch in zip(range(cfg.data.eval_batches), rows))
            return trainer.held_out_loss(params, rows)

    result = run_training(
        trainer,
        IteratorSource(trainer, batches),
        log=log,
        evaluate=evaluate,
        meta={"stage": "sft", "sft_config": cfg.model_dump(mode="json")},
        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
        logged=("loss", "grad_norm"),
    )
    result.update({"train_examples": len(train_examples), "eval_examples": len(held_out)})
    return result


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.posttrain.sft", SFTConfig, run_sft)


def step_spec(cfg: SFTConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): language modelling over the examples' rows."""
    return StepSpec(train_config(cfg, *fine_tuned_model(cfg, models)))


if __name__ == "__main__":
    sys.exit(main())
