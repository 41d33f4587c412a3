"""Process reward models (PRMs) on the reward-model stage: step-labelled reasoning in, a
per-step scorer out (TRL's PRMTrainer; Uesato et al. 2022, Lightman et al. 2023).

An example is a prompt, its completion as a list of steps and one label per step (true: the
step is correct). As TRL's `PRMTrainer.tokenize_row` does, every step gets `step_separator`
appended, the row is bos + prompt + the steps, and a step's label sits on its last token (the
separator's); the prompt is truncated on the left to max_prompt_length, the steps' tokens to
max_completion_length, the whole to max_length. The head is a token classifier with two
labels, `score_dl` (d_model, 2), on the final-normed hidden states (transformers'
*ForTokenClassification `score`, no bias); the loss is the cross-entropy over the labelled
positions (transformers' token-classification loss, a mean over the batch's labelled steps).
Metrics: accuracy (argmax = label over labelled steps) and the number of steps.

As a GRPO reward (`rewards: [{model: <this artifact>}]`): each completion is split into steps
at the separator and re-tokenized the training way after the rollout's prompt tokens; the
reward is `process.aggregate` over the steps of P(label 1): the min by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ConfigError
from engine.data.tokenizer import TokenizerBundle
from engine.models.lora import LORA_SEED, dropout_rows
from engine.ops.partitioning import use_mesh
from engine.parallel.mesh import global_array, replicated, to_host
from engine.posttrain.dpo import EpochIndices
from engine.posttrain.finetune import read_jsonl
from engine.posttrain.reward_config import ProcessRewardConfig, RewardModelConfig
from engine.train.reward_checkpoint import PROCESS_HEAD
from engine.train.step import Objective, moe_metrics
from engine.train.trainer import Trainer, TrainState

IGNORE = -100
METRICS = ("accuracy",)


@dataclass
class StepExample:
    ids: np.ndarray  # (n,) int32: bos, prompt, steps with separators
    labels: np.ndarray  # (n,) int32: the step's label at its last token, IGNORE elsewhere


def step_row(
    bundle: TokenizerBundle,
    prompt_ids: list[int],
    steps: list[str],
    labels: list[int],
    process: ProcessRewardConfig,
    max_length: int,
) -> StepExample:
    """TRL's PRMTrainer.tokenize_row after the prompt: each step + the separator's ids, its
    label on the step's last token; the steps cut to max_completion_length, the row to max_length."""
    separator = bundle.tokenizer.encode(process.step_separator, add_special_tokens=False).ids
    step_ids = [bundle.tokenizer.encode(step, add_special_tokens=False).ids + separator for step in steps]
    completion = list(chain(*step_ids))
    completion_labels = list(chain(*([IGNORE] * (len(ids) - 1) + [label] for ids, label in zip(step_ids, labels))))
    if process.max_completion_length is not None:
        completion = completion[: process.max_completion_length]
        completion_labels = completion_labels[: process.max_completion_length]
    ids = (list(prompt_ids) + completion)[:max_length]
    row_labels = ([IGNORE] * len(prompt_ids) + completion_labels)[:max_length]
    return StepExample(np.asarray(ids, np.int32), np.asarray(row_labels, np.int32))


def prompt_ids_of(bundle: TokenizerBundle, prompt: str, max_prompt_length: int) -> list[int]:
    """bos (where the tokenizer has one) + the prompt without special tokens, its last tokens kept."""
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False).ids
    bos = [bundle.bos_id] if bundle.bos_id is not None else []
    return (bos + list(ids))[-max_prompt_length:]


def tokenize_steps(record: dict, where: str, bundle: TokenizerBundle, cfg: RewardModelConfig, is_eval: bool):
    process, data = cfg.process, cfg.data
    assert process is not None
    for field in (data.prompt_field, process.completions_field, process.labels_field):
        if field not in record:
            raise ConfigError(f"{where}: no '{field}' key (the record has: {', '.join(record) or 'nothing'})")
    prompt, steps, labels = record[data.prompt_field], record[process.completions_field], record[process.labels_field]
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: '{data.prompt_field}' must be text for a process reward model")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        raise ConfigError(f"{where}: '{process.completions_field}' must be a non-empty list of step texts")
    if not isinstance(labels, list) or len(labels) != len(steps) or not all(isinstance(x, bool) for x in labels):
        raise ConfigError(f"{where}: '{process.labels_field}' must list one true/false per step ({len(steps)} steps)")
    targets = [int(x) for x in labels]
    if process.train_on_last_step_only and not is_eval:
        targets = [IGNORE] * (len(targets) - 1) + targets[-1:]
    prompt_ids = prompt_ids_of(bundle, prompt, data.max_prompt_length)
    return step_row(bundle, prompt_ids, steps, targets, process, data.max_length)


def load_step_examples(cfg: RewardModelConfig, bundle: TokenizerBundle, log: Callable[[str], None]):
    """(train, held-out) examples; one whose labelled steps were all cut off is left out, counted."""
    data = cfg.data
    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of step-labelled examples")

    def read(path: str, is_eval: bool) -> list[StepExample]:
        examples = [tokenize_steps(r, w, bundle, cfg, is_eval) for w, r in read_jsonl(path)]
        kept = [e for e in examples if np.any(e.labels != IGNORE)]
        if len(kept) < len(examples):
            log(f"reward_model: {len(examples) - len(kept)} example(s) of {path} keep no labelled step in max_length")
        return kept

    examples = read(data.path, False)
    if data.eval_path:
        held_out = read(data.eval_path, True)
    else:
        n_eval = int(round(len(examples) * data.eval_fraction))
        held_out = examples[len(examples) - n_eval :]
        examples = examples[: len(examples) - n_eval]
    if not examples:
        raise ConfigError(f"data.path: {data.path} has no step-labelled example to train on")
    return examples, held_out


def step_rows(examples: list[StepExample], width: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """tokens, positions, segment_ids, step_labels (rows, width); empty rows pad up to `rows`."""
    n = max(len(examples), rows or 0)
    out = {k: np.zeros((n, width), np.int32) for k in ("tokens", "positions", "segment_ids")}
    out["step_labels"] = np.full((n, width), IGNORE, np.int32)
    for r, e in enumerate(examples):
        m = len(e.ids)
        out["tokens"][r, :m], out["positions"][r, :m], out["segment_ids"][r, :m] = e.ids, np.arange(m), 1
        out["step_labels"][r, :m] = e.labels
    return out


# --------------------------------------------------------------------------- the loss


def step_logits(hidden_btd, head_dl):
    """(b, t, 2) float32 logits of the token classifier."""
    return jnp.einsum("btd,dl->btl", hidden_btd.astype(jnp.float32), head_dl.astype(jnp.float32))


def step_loss_terms(logits_btl, labels_bt):
    """(cross-entropy summed over labelled positions, their count, correct predictions)."""
    labelled = labels_bt != IGNORE
    safe = jnp.where(labelled, labels_bt, 0)
    log_p = jax.nn.log_softmax(logits_btl, axis=-1)
    nll = -jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits_btl, axis=-1) == safe) & labelled
    return jnp.sum(nll * labelled), jnp.sum(labelled).astype(jnp.float32), jnp.sum(correct).astype(jnp.float32)


def labelled_steps(batch) -> jax.Array:
    """The normaliser: the batch's labelled steps (at least 1)."""
    return jnp.maximum(jnp.sum(batch["step_labels"] != IGNORE).astype(jnp.float32), 1.0)


def make_loss_fn(graphdef, hidden_and_aux: Callable):
    def loss_fn(params, batch, steps):
        with dropout_rows(batch.get(LORA_SEED)):
            hidden, moe = hidden_and_aux(graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        nll_sum, count, correct = step_loss_terms(step_logits(hidden, params[PROCESS_HEAD]), batch["step_labels"])
        loss = nll_sum / steps
        metrics = {"loss": loss, "steps": count, "accuracy": correct / steps}
        if moe:
            part = count / steps
            loss = loss + part * moe["aux_loss"]
            metrics.update(moe_metrics(moe, part))
        return loss, metrics

    return loss_fn


def process_objective(graphdef, hidden_and_aux: Callable) -> Objective:
    return Objective(make_loss_fn(graphdef, hidden_and_aux), labelled_steps)


class StepBatches:
    """The trainer's batch source over step-labelled examples (epochs reshuffled, as DPO's)."""

    def __init__(self, examples: list[StepExample], cfg: RewardModelConfig, trainer: Trainer):
        self.examples, self.cfg, self.trainer = examples, cfg, trainer
        self.indices = EpochIndices(len(examples), cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)

    def next_batch(self, state: TrainState):
        chosen = [self.examples[i] for i in self.indices.take()]
        return self.trainer.global_batch(step_rows(chosen, self.cfg.data.max_length)), {}

    def get_state(self) -> dict:
        return self.indices.get_state()

    def set_state(self, state: dict) -> None:
        self.indices.set_state(state)


# --------------------------------------------------------------------------- scoring rollouts


def aggregate_steps(p_correct: np.ndarray, how: str) -> float:
    """A completion's reward from its steps' P(correct): min, product or last; NaN without steps."""
    if p_correct.size == 0:
        return float("nan")
    if how == "min":
        return float(p_correct.min())
    if how == "product":
        return float(np.prod(p_correct))
    return float(p_correct[-1])


class StepScorer:
    """A PRM scoring GRPO's rollouts: each completion's text split into steps at the separator,
    re-tokenized after its prompt tokens as in training, P(label 1) read at each step's last
    token, aggregated per completion (process.aggregate)."""

    def __init__(self, graphdef, params, shardings, mesh, rows_sharding, bundle, process: dict, width: int, hidden_fn):
        self.process = ProcessRewardConfig.model_validate(process)
        self.bundle, self.mesh, self.params, self.width, self.rows_sharding = bundle, mesh, params, width, rows_sharding

        def p_correct(p, b):
            hidden, _ = hidden_fn(graphdef, p, b["tokens"], b["positions"], b["segment_ids"])
            return jax.nn.softmax(step_logits(hidden, p[PROCESS_HEAD]), axis=-1)[..., 1]

        self._fn = jax.jit(p_correct, in_shardings=(shardings, rows_sharding), out_shardings=replicated(mesh))

    def __call__(self, batch: dict[str, jax.Array], completions: list[str]) -> np.ndarray:
        tokens, segments = to_host(batch["tokens"]), to_host(batch["segment_ids"])
        prompt_width = tokens.shape[1] - batch["completion_mask"].shape[1]  # rows: prompt (left-padded), completion
        examples = []
        for row, text in enumerate(completions):
            steps = [s for s in text.split(self.process.step_separator)]
            steps = steps[:-1] if len(steps) > 1 and not steps[-1].strip() else steps  # a trailing separator
            prompt = tokens[row, :prompt_width][segments[row, :prompt_width] != 0].tolist()
            examples.append(step_row(self.bundle, prompt, steps, [1] * len(steps), self.process, self.width))
        rows = step_rows(examples, self.width, rows=tokens.shape[0])
        with use_mesh(self.mesh):
            arrays = {k: global_array(rows[k], self.rows_sharding) for k in ("tokens", "positions", "segment_ids")}
            p_bt = to_host(self._fn(self.params, arrays))
        return np.asarray(
            [
                aggregate_steps(p_bt[r, : len(e.labels)][e.labels != IGNORE], self.process.aggregate)
                for r, e in enumerate(examples)
            ],
            np.float64,
        )
