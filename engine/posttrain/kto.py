"""KTO on the shared trainer: unpaired desirable / undesirable completions in, a policy out
(TRL's KTOTrainer definitions; Ethayarajh et al. 2024).

Data is JSONL of (prompt, completion, label) (engine/posttrain/kto_config.py). KTO's value
function compares each completion's log-ratio (policy - reference, summed over its tokens)
with a reference point z0, the batch's KL estimate:

    desirable    lambda_D (1 - sigmoid(beta (logratio - z0)))
    undesirable  lambda_U (1 - sigmoid(beta (z0 - logratio)))
    z0           max(0, mean over the micro-batch of (log pi(y'|x) - log pi_ref(y'|x))), no gradient,

where y' is a mismatched completion: as TRL does, the completions are rotated by one within
each group of `micro-batch` consecutive examples of the file, (x_1, y_n), (x_2, y_1), ...,
so a micro-batch's KL completions are the outputs of the same part of the data paired with
other prompts. The loss is the mean over the batch's examples. `apo_zero_unpaired` drops z0
and the KL completions: 1 - sigmoid(beta logratio) for a desirable one, sigmoid(beta
logratio) for an undesirable one.

Rows are DPO's (engine/posttrain/dpo.py): an example is a Pair whose `chosen` is its
completion and whose `rejected` is its KL completion, both after the same prompt in one row,
so the reference (another checkpoint, the LoRA base, or a copy; precomputed or not), the
batch source and the resume state are DPO's. Its label joins the row (`label`: (rows, 1)).
Metrics are TRL's: kl, rewards/{chosen, rejected, margins}, logps/{chosen, rejected}.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ConfigError
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import LORA_SEED, dropout_rows
from engine.models.params import apply_model_with_aux
from engine.posttrain.dpo import (
    Pair,
    Reference,
    _encode_completion,
    pair_rows,
    run_preference,
    sequence_logps,
)
from engine.posttrain.dpo import batch_shapes as pair_batch_shapes
from engine.posttrain.finetune import finetune_start, read_jsonl
from engine.posttrain.kto_config import KTOConfig, KTODataConfig
from engine.train.cli import run_cli
from engine.train.config import TrainConfig, trainer_view
from engine.train.hooks import log_to_stderr
from engine.train.plan import InputModels, StepSpec, fine_tuned_model, frozen_params_gib
from engine.train.step import Objective, moe_metrics
from engine.train.trainer import Trainer

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
"""TRL's KTO metrics: chosen = desirable examples, rejected = undesirable ones."""


def train_config(cfg: KTOConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """The trainer's view: rows of 2 x max_length tokens, one example and its KL completion each."""
    if cfg.data.max_length > model_cfg.max_seq_len:
        raise ConfigError(
            f"data.max_length ({cfg.data.max_length}) exceeds the model's max_seq_len ({model_cfg.max_seq_len})"
        )
    rows = {"seq_len": 2 * cfg.data.max_length, "batch_size": cfg.data.batch_size, "seed": cfg.data.seed}
    return trainer_view(cfg, model_cfg, compute, rows, stage="kto")


# --------------------------------------------------------------------------- examples


@dataclass
class Example(Pair):
    """An unpaired example as a DPO row: `chosen` its completion, `rejected` its KL completion."""

    label: bool = True


def tokenize_example(record: dict, where: str, bundle, data: KTODataConfig) -> tuple[list[int], list[int], bool]:
    """(prompt ids, completion ids, label) of one record, truncated by DPO's rules."""
    for field in (data.prompt_field, data.completion_field, data.label_field):
        if field not in record:
            raise ConfigError(f"{where}: no '{field}' key (the record has: {', '.join(record) or 'nothing'})")
    label = record[data.label_field]
    if not isinstance(label, bool):
        raise ConfigError(
            f"{where}: '{data.label_field}' must be true (desirable) or false (undesirable), not {label!r}"
        )
    prompt_ids, completion_ids = _encode_completion(
        bundle, record[data.prompt_field], record[data.completion_field], where, data.completion_field
    )
    prompt_ids = prompt_ids[-data.max_prompt_length :]
    return prompt_ids, completion_ids[: data.max_length - len(prompt_ids)], label


def with_kl_completions(examples: list, group: int, calculate_kl: bool, max_length: int) -> list[Example]:
    """Examples as rows: each (prompt, completion, label) with the completion of the previous
    example of its group of `group` consecutive ones as its KL completion (the last one's for
    the first: TRL's rotation), cut to what max_length leaves after the prompt; with
    calculate_kl false, none."""
    out = []
    for start in range(0, len(examples), group):
        chunk = examples[start : start + group]
        for i, (prompt, completion, label) in enumerate(chunk):
            kl = chunk[i - 1][1][: max_length - len(prompt)] if calculate_kl else []
            out.append(
                Example(np.asarray(prompt, np.int32), np.asarray(completion, np.int32), np.asarray(kl, np.int32), label)
            )
    return out


def load_examples(cfg: KTOConfig, bundle, log: Callable[[str], None]) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples with their KL completions, rotated within micro-batch groups."""
    data = cfg.data
    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of (prompt, completion, label) examples")
    read = lambda path: [tokenize_example(r, w, bundle, data) for w, r in read_jsonl(path)]  # noqa: E731
    examples = read(data.path)
    if data.eval_path:
        held_out = read(data.eval_path)
    else:
        n_eval = int(round(len(examples) * data.eval_fraction))
        examples, held_out = examples[: len(examples) - n_eval], examples[len(examples) - n_eval :]
    if not examples:
        raise ConfigError(f"data.path: {data.path} has no example to train on")
    desirable = sum(label for _, _, label in examples)
    if cfg.calculate_kl and (desirable == 0 or desirable == len(examples)):
        log(f"kto: every training example is {'desirable' if desirable else 'undesirable'}")
    ratio = cfg.desirable_weight * max(desirable, 1) / (cfg.undesirable_weight * max(len(examples) - desirable, 1))
    log(
        f"kto: {desirable} desirable and {len(examples) - desirable} undesirable examples; lambda_D n_D / "
        f"(lambda_U n_U) = {ratio:.2f} (KTO's paper keeps it in [1, 4/3])"
    )
    group = data.batch_size // cfg.grad_accum
    return (
        with_kl_completions(examples, group, cfg.calculate_kl, data.max_length),
        with_kl_completions(held_out, group, cfg.calculate_kl, data.max_length),
    )


def example_rows(examples: list[Example], max_length: int) -> dict[str, np.ndarray]:
    """DPO's pair rows (segment 1 the example, segment 2 its KL completion) plus `label` (rows, 1)."""
    rows = pair_rows(examples, max_length)
    rows["label"] = np.asarray([[float(e.label)] for e in examples], np.float32).reshape(-1, 1)
    return rows


# --------------------------------------------------------------------------- the loss


def kto_losses(
    logps, kl_logps, ref_logps, ref_kl_logps, label, valid, *, beta, loss_type, desirable_weight, undesirable_weight
):
    """((rows,) weighted losses, zero where a row holds no example; the KL estimate z0)."""
    if loss_type == "kto":
        kl = jnp.sum((kl_logps - ref_kl_logps) * valid) / jnp.maximum(jnp.sum(valid), 1.0)
        kl = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
    else:
        kl = jnp.zeros((), logps.dtype)
    logratio = logps - ref_logps
    if loss_type == "kto":
        desirable = 1 - jax.nn.sigmoid(beta * (logratio - kl))
        undesirable = 1 - jax.nn.sigmoid(beta * (kl - logratio))
    else:  # apo_zero_unpaired
        desirable = 1 - jax.nn.sigmoid(beta * logratio)
        undesirable = jax.nn.sigmoid(beta * logratio)
    losses = jnp.where(label > 0, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses * valid, kl


def examples_and_labels(batch):
    """The normalisers of a batch: its examples, desirable ones, undesirable ones (each >= 1)."""
    valid = jnp.any((batch["loss_mask"] > 0) & (batch["segment_ids"] == 1), axis=1).astype(jnp.float32)
    desirable = jnp.sum(valid * batch["label"][:, 0])
    return jnp.maximum(jnp.sum(valid), 1.0), jnp.maximum(desirable, 1.0), jnp.maximum(jnp.sum(valid) - desirable, 1.0)


def make_loss_fn(graphdef, cfg: KTOConfig):
    """loss_fn(params, batch, (examples, desirable, undesirable)) -> (loss, metrics), sums that
    add up over micro-batches to the batch's means (kl: a mean over micro-batches)."""

    def loss_fn(params, batch, normaliser):
        examples, n_desirable, n_undesirable = normaliser if isinstance(normaliser, tuple) else (normaliser,) * 3
        with dropout_rows(batch.get(LORA_SEED)):
            logits, moe = apply_model_with_aux(
                graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
            )
        logps, kl_logps, tokens, _ = sequence_logps(logits, batch)
        kl_logps = jax.lax.stop_gradient(kl_logps)  # TRL computes them without a gradient
        valid = (tokens > 0).astype(jnp.float32)
        label = batch["label"][:, 0]
        ref = batch["ref_logps"]
        losses, kl = kto_losses(
            logps,
            kl_logps,
            ref[:, 0],
            ref[:, 1],
            label,
            valid,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            desirable_weight=cfg.desirable_weight,
            undesirable_weight=cfg.undesirable_weight,
        )
        loss = jnp.sum(losses) / examples
        rewards = jax.lax.stop_gradient(cfg.beta * (logps - ref[:, 0]))
        desirable, undesirable = valid * label, valid * (1 - label)
        chosen_reward = jnp.sum(rewards * desirable) / n_desirable
        rejected_reward = jnp.sum(rewards * undesirable) / n_undesirable
        metrics = {
            "loss": loss,
            "examples": jnp.sum(valid),
            "desirable": jnp.sum(desirable),
            "undesirable": jnp.sum(undesirable),
            "kl": kl,
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/margins": chosen_reward - rejected_reward,
            "logps/chosen": jnp.sum(jax.lax.stop_gradient(logps) * desirable) / n_desirable,
            "logps/rejected": jnp.sum(jax.lax.stop_gradient(logps) * undesirable) / n_undesirable,
        }
        if moe:
            part = jnp.sum(valid) / examples
            loss = loss + part * moe["aux_loss"]
            metrics.update(moe_metrics(moe, part))
        return loss, metrics

    return loss_fn


def kto_objective(graphdef, cfg: KTOConfig) -> Objective:
    return Objective(make_loss_fn(graphdef, cfg), examples_and_labels, reduce={"kl": "mean"})


HELD_OUT_SUMS = ("loss", "examples", "desirable", "undesirable", *METRICS)


def held_out_metrics(sums: dict[str, float], batches: int) -> dict[str, float]:
    """eval_ metrics from batch sums (normaliser 1): means over all held-out examples, of the
    desirable ones and of the undesirable ones; kl the mean of the batches' estimates."""
    n, d, u = (max(sums[k], 1.0) for k in ("examples", "desirable", "undesirable"))
    chosen, rejected = sums["rewards/chosen"] / d, sums["rewards/rejected"] / u
    return {
        "eval_loss": sums["loss"] / n,
        "eval_kl": sums["kl"] / max(batches, 1),
        "eval_rewards/chosen": chosen,
        "eval_rewards/rejected": rejected,
        "eval_rewards/margins": chosen - rejected,
        "eval_logps/chosen": sums["logps/chosen"] / d,
        "eval_logps/rejected": sums["logps/rejected"] / u,
        "eval_examples": sums["examples"],
    }


# --------------------------------------------------------------------------- the run


def run_kto(cfg: KTOConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `cfg.steps` batches of examples, resuming from checkpoint.directory if it has one."""
    log = log or log_to_stderr
    model_cfg, compute, bundle = finetune_start(cfg)
    train_examples, held_out = load_examples(cfg, bundle, log)
    log(f"kto: {len(train_examples)} training and {len(held_out)} held-out examples, loss {cfg.loss_type}")
    trainer = Trainer(train_config(cfg, model_cfg, compute), lambda graphdef: kto_objective(graphdef, cfg))
    # DPO's run over example rows; KTO's reference is always enabled, so every batch has ref_logps.
    return run_preference(
        cfg,  # type: ignore[arg-type]  # DPO's data and reference fields
        trainer,
        Reference(cfg, trainer, model_cfg, bundle),  # type: ignore[arg-type]
        train_examples,
        held_out,
        stage="kto",
        unit="examples",
        rows=example_rows,  # type: ignore[arg-type]  # examples are the pairs it is given
        held_out_sums=HELD_OUT_SUMS,
        held_out_metrics=held_out_metrics,
        metrics=METRICS,
        log=log,
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.posttrain.kto", KTOConfig, run_kto)


def batch_shapes(cfg: KTOConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one KTO batch: DPO's rows with the reference's log-probs, and each row's label."""
    batch = pair_batch_shapes(cfg)  # type: ignore[arg-type]  # DPO's data fields; KTO is never reference-free
    batch["label"] = jax.ShapeDtypeStruct((cfg.data.batch_size, 1), np.float32)
    return batch


def step_spec(cfg: KTOConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): the KTO objective over example rows; the frozen
    reference's parameters are held beside the step."""

    def uncounted(plan) -> list[str]:
        if cfg.precompute_ref:
            return []
        if "reference" in models:
            count, size = frozen_params_gib(models, "reference", cfg.reference.compute)
            return [f"the frozen reference's parameters ({count:,}, {size:.2f} GiB) are held beside this step"]
        if cfg.lora is None:
            return [f"the frozen reference, a second copy of {plan.memory.parameters / 2**30:.2f} GiB per device"]
        return []

    return StepSpec(
        train_config(cfg, *fine_tuned_model(cfg, models)),
        objective=lambda graphdef: kto_objective(graphdef, cfg),
        batch=batch_shapes(cfg),
        uncounted=uncounted,
    )


if __name__ == "__main__":
    sys.exit(main())
