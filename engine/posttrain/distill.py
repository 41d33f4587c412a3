"""Knowledge distillation on the shared trainer (TRL's GKD): a student learns a frozen
teacher's next-token distributions.

    step s  ->  on-policy (a draw from (seed, s) below lmbda): the student samples completions
                of batch_size prompts of the data (engine/inference/sample.py, the live params)
            ->  else with seq_kd: the teacher samples them
            ->  else: SFT's packed rows of the data's own completions (engine/posttrain/sft.py)
            ->  the teacher's logits of those rows -> generalized JSD on the completion tokens

The loss is TRL GKD's generalized JSD (engine/posttrain/distill_loss.py: beta 0 forward KL,
1 reverse KL, between the JSD of the mixture; `loss_temperature` scales both softmaxes), a
mean over the batch's completion tokens. Held-out evaluation is on the data's own completions.
Metrics per step and held out: loss, jsd, nll/student and nll/teacher (per completion token,
at temperature 1); per step also on_policy and, when sampled, completion_length.

How the teacher enters the loss: as data. `Teacher`, beside the trainer, holds the frozen
teacher's params on the student's mesh (sharded by its own ModelConfig's logical axes, so it
may be wider or deeper than the student, or another family of the same vocabulary) and runs
its own jitted forward; the batch source puts its float32 logits into the batch
(`teacher_logits`, rows x seq_len x vocab), as DPO's Reference puts its log-probs there. The
step stays the trainer's step with one more batch array: the teacher's activations are gone
before the student's step runs, the teacher never enters the differentiated function, the
memory check and `trainflow plan` count its logits, and on-policy steps need the teacher's
forward on the student's samples anyway, which only the batch source has. The alternative,
the teacher's params as a frozen argument of the step, would keep only each micro-batch's
logits alive, but the step's one frozen argument is already a LoRA base's. Memory: the
teacher's params (in its param_dtype) stay resident beside the student's state, and each
batch carries batch_size x seq_len x vocab x 4 bytes of logits, split over the batch axes
(8 x 512 x 32,768 x 4 = 512 MiB), alive through the step beside the student's own logits.
Caching the teacher's top-k logits as a dataset artifact is not implemented.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ConfigError
from engine.data.tokenizer import TokenizerBundle
from engine.inference.sample import SampleOutput, Sampler, left_pad
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import LORA_SEED, dropout_rows
from engine.models.params import abstract_model_params, apply_model_with_aux, graphdef_of
from engine.ops.cross_entropy import log_z_and_target
from engine.ops.partitioning import use_mesh
from engine.posttrain.distill_config import DistillConfig
from engine.posttrain.distill_loss import generalized_jsd_loss
from engine.posttrain.finetune import finetune_start, frozen_model_of_same_vocab, tokenizer_dir
from engine.posttrain.grpo import PromptStream
from engine.posttrain.sft import Example, SFTBatches, eval_batches, load_examples, pack_rows
from engine.train.checkpoint import load_params
from engine.train.cli import run_cli
from engine.train.config import TrainConfig, trainer_view
from engine.train.hooks import log_to_stderr, run_training
from engine.train.plan import InputModels, StepSpec, fine_tuned_model, frozen_params_gib
from engine.train.step import Objective, moe_metrics, token_count
from engine.train.trainer import Trainer, TrainState, lm_batch

METRICS = ("jsd", "nll/student", "nll/teacher")


def train_config(cfg: DistillConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """The trainer's view: SFT's rows (a sampled completion fills one row the same size)."""
    data = cfg.data
    rows = {"seq_len": data.seq_len, "batch_size": data.batch_size, "seed": data.seed, "shuffle": data.shuffle}
    return trainer_view(cfg, model_cfg, compute, {**rows, "packing": data.packing}, stage="distill")


def batch_shapes(cfg: DistillConfig, vocab_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One step's batch: SFT's rows plus the teacher's logits of them."""
    rows, seq_len = cfg.data.batch_size, cfg.data.seq_len
    return {**lm_batch(rows, seq_len), "teacher_logits": jax.ShapeDtypeStruct((rows, seq_len, vocab_size), np.float32)}


# --------------------------------------------------------------------------- the teacher


def teacher_model(
    cfg: DistillConfig, student: ModelConfig, student_bundle: TokenizerBundle, student_tokenizer: Path
) -> tuple[ModelConfig, ComputeConfig]:
    """The teacher's architecture and compute settings, once it is known to share the
    student's vocabulary (its vocab_size and its tokenizer's tokens and ids); else one sentence."""
    path = cfg.teacher.checkpoint
    if not path:
        raise ConfigError("teacher.checkpoint is required: the checkpoint to distil from")
    model_cfg, stored_compute = frozen_model_of_same_vocab(
        "teacher.checkpoint",
        path,
        "teacher",
        student,
        "student",
        cfg.checkpoint.init_from,
        student_bundle,
        "distillation compares next-token distributions over one vocabulary",
        tokenizer=cfg.teacher.tokenizer,
        tokenizer_key="teacher.tokenizer",
        trained_tokenizer=student_tokenizer,
    )
    return model_cfg, cfg.teacher.compute or stored_compute


class Teacher:
    """The frozen teacher on the trainer's mesh: its logits of rows, and (seq_kd) its samples."""

    def __init__(self, cfg: DistillConfig, trainer: Trainer, model_cfg: ModelConfig, compute: ComputeConfig):
        self.cfg, self.trainer, self.model_cfg = cfg, trainer, model_cfg
        self.abstract_params = abstract_model_params(model_cfg, compute, trainer.mesh)
        self.shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
        self._params = None
        graphdef = graphdef_of(model_cfg, compute)

        def logits(params, batch):
            logits_btv, _ = apply_model_with_aux(
                graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
            )
            return logits_btv.astype(jnp.float32)

        rows = trainer.batch_sharding
        self._logits = jax.jit(logits, in_shardings=(self.shardings, rows), out_shardings=rows)
        self.sampler = Sampler(model_cfg, compute, trainer.mesh, self.shardings) if cfg.seq_kd else None

    @property
    def params(self):
        if self._params is None:  # an adapter reads as its base with the adapter folded in
            self._params = load_params(self.cfg.teacher.checkpoint, self.abstract_params)[1]
        return self._params

    def logits(self, batch: dict[str, jax.Array]) -> jax.Array:
        """(rows, seq_len, vocab) float32, sharded as the batch's rows."""
        inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
        with use_mesh(self.trainer.mesh):
            return self._logits(self.params, inputs)


# --------------------------------------------------------------------------- the loss


def make_loss_fn(graphdef, cfg: DistillConfig):
    """loss_fn(params, batch, completion tokens of the batch) -> (loss, metrics): each metric
    this micro-batch's share of the batch's mean per completion token."""

    def loss_fn(params, batch, normaliser):
        with dropout_rows(batch.get(LORA_SEED)):  # a LoRA adapter's dropout, in training steps only
            logits_btv, moe = apply_model_with_aux(
                graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
            )
        mask_bt, teacher_btv = batch["loss_mask"], batch["teacher_logits"]
        jsd = generalized_jsd_loss(
            logits_btv, teacher_btv, mask_bt, beta=cfg.beta, temperature=cfg.loss_temperature, num_items=normaliser
        )

        def nll(logits):
            log_z_bt, target_bt = log_z_and_target(logits, batch["targets"])
            return jnp.sum((log_z_bt - target_bt) * mask_bt) / normaliser

        tokens = jnp.sum(mask_bt)
        metrics = {
            "jsd": jsd,
            "nll/student": jax.lax.stop_gradient(nll(logits_btv)),
            "nll/teacher": nll(teacher_btv),
            "tokens": tokens,
        }
        loss = jsd
        if moe:  # a mixture of experts keeps its router losses, weighted by this micro-batch's share of tokens
            share = tokens / normaliser
            loss = loss + share * moe["aux_loss"]
            metrics.update(moe_metrics(moe, share))
        return loss, {**metrics, "loss": loss}

    return loss_fn


def distill_objective(graphdef, cfg: DistillConfig) -> Objective:
    return Objective(make_loss_fn(graphdef, cfg), token_count)


# --------------------------------------------------------------------------- the batches


def on_policy(cfg: DistillConfig, step: int) -> bool:
    """Whether the batch after `step` completed steps is the student's own samples: a uniform
    draw from (seed, step) below lmbda (TRL: random.random() <= lmbda, unseeded)."""
    return bool(np.random.default_rng([cfg.seed, step, 0x6D6264]).random() < cfg.lmbda)


def prompt_ids(example: Example) -> np.ndarray:
    """The tokens before the example's last run of target tokens: the prompt a sampled
    completion follows (a conversation's last assistant turn is what gets sampled, as GKD's)."""
    targets = np.flatnonzero(example.loss)
    if not targets.size:
        return example.ids
    breaks = np.flatnonzero(np.diff(targets) > 1)  # where one run of targets ends and another starts
    return example.ids[: targets[breaks[-1] + 1] if breaks.size else targets[0]]


def sampled_rows(prompt_tokens_bp, prompt_mask_bp, out: SampleOutput, seq_len: int) -> dict[str, np.ndarray]:
    """Left-padded prompts and their sampled completions as rows of seq_len (GRPO's layout,
    padded on the right): the completion tokens up to and including eos are the targets."""
    rows, prompt_len = prompt_tokens_bp.shape
    width = prompt_len + out.tokens.shape[1]
    assert width <= seq_len + 1, (width, seq_len)
    pad = ((0, 0), (0, seq_len + 1 - width))
    full = np.pad(np.concatenate([prompt_tokens_bp, out.tokens], 1), pad)
    present = np.pad(np.concatenate([prompt_mask_bp, out.mask], 1).astype(np.int32), pad)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    loss_mask[:, prompt_len - 1 : width - 1] = out.mask  # completion token j is the target at prompt_len - 1 + j
    positions = np.maximum(np.cumsum(present, 1) - 1, 0) * present
    return {
        "tokens": full[:, :-1].astype(np.int32),
        "targets": full[:, 1:].astype(np.int32),
        "positions": positions[:, :-1].astype(np.int32),
        "segment_ids": present[:, :-1],
        "loss_mask": loss_mask,
    }


class DistillBatches:
    """The trainer's batch source: each step's rows (the data's, or completions the student or
    the teacher samples for the data's prompts) and the teacher's logits of them. Its state is
    the data's (SFT's epoch and row) and the prompts' (epoch and index)."""

    def __init__(
        self,
        cfg: DistillConfig,
        trainer: Trainer,
        model_cfg: ModelConfig,
        bundle: TokenizerBundle,
        examples: list[Example],
        teacher: Teacher,
    ):
        self.cfg, self.trainer, self.bundle, self.teacher = cfg, trainer, bundle, teacher
        self.rows = SFTBatches(
            examples,
            seq_len=cfg.data.seq_len,
            batch_size=cfg.data.batch_size,
            packing=cfg.data.packing,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
        )
        self.prompts = PromptStream([{"ids": prompt_ids(e)} for e in examples], cfg.data.shuffle, cfg.data.seed)
        self.pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
        self.sampler = None
        if cfg.lmbda > 0:  # with LoRA the adapter and its frozen base side by side, never merged
            self.sampler = Sampler(
                model_cfg, trainer.cfg.compute, trainer.mesh, trainer.model_param_shardings(), lora=cfg.lora
            )

    def sample(self, state: TrainState, student: bool) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        cfg, start = self.cfg, time.perf_counter()
        prompts = [r["ids"][-cfg.prompt_length :] for r in self.prompts.take(cfg.data.batch_size)]
        tokens, mask = left_pad(prompts, pad_id=self.pad_id, length=cfg.prompt_length)
        sampler, params = (
            (self.sampler, self.trainer.model_params(state.params))
            if student
            else (self.teacher.sampler, self.teacher.params)
        )
        assert sampler is not None  # a sampler exists for what the mix samples from (lmbda > 0, seq_kd)
        seed = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), state.step), int(not student))
        out = sampler(
            params,
            tokens,
            mask,
            seed=seed,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            eos_ids=(self.bundle.eos_id,),
            pad_id=self.pad_id,
        )
        return sampled_rows(tokens, mask, out, cfg.data.seq_len), {
            "completion_length": float(out.lengths.mean()),
            "sample_seconds": time.perf_counter() - start,
        }

    def next_batch(self, state: TrainState):
        student = on_policy(self.cfg, state.step)
        metrics = {"on_policy": float(student)}
        if student or self.cfg.seq_kd:
            rows, sampled = self.sample(state, student)
            metrics.update(sampled)
        else:
            rows = next(self.rows)
        batch = self.trainer.global_batch(rows)  # every process made the whole batch
        batch["teacher_logits"] = self.teacher.logits(batch)
        return batch, metrics

    def get_state(self) -> dict:
        return {"rows": self.rows.get_state(), "prompts": self.prompts.get_state()}

    def set_state(self, state: dict) -> None:
        self.rows.set_state(state["rows"])
        self.prompts.set_state(state["prompts"])


# --------------------------------------------------------------------------- the run


def run_distill(cfg: DistillConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Distil the teacher into checkpoint.init_from for `cfg.steps` steps, resuming from
    checkpoint.directory if it has checkpoints."""
    log = log or log_to_stderr
    model_cfg, compute, bundle = finetune_start(cfg)
    teacher_cfg, teacher_compute = teacher_model(cfg, model_cfg, bundle, tokenizer_dir(cfg))
    train_examples, held_out = load_examples(cfg.data, bundle)
    if held_out and not pack_rows(held_out, cfg.data.seq_len, cfg.data.packing)["loss_mask"].any():
        raise ConfigError(
            f"data: the {len(held_out)} held-out examples give no completion token to evaluate "
            f"(empty completions, or cut off by data.seq_len {cfg.data.seq_len}); fix them, or hold out "
            "none"
        )
    log(
        f"distill: {len(train_examples)} training and {len(held_out)} held-out examples; a "
        f"{teacher_cfg.num_params():,}-parameter teacher into a {model_cfg.num_params():,}-parameter student, "
        f"beta {cfg.beta}, lmbda {cfg.lmbda}" + (", seq_kd" if cfg.seq_kd else "")
    )
    trainer = Trainer(train_config(cfg, model_cfg, compute), lambda graphdef: distill_objective(graphdef, cfg))
    teacher = Teacher(cfg, trainer, teacher_cfg, teacher_compute)
    source = DistillBatches(cfg, trainer, model_cfg, bundle, train_examples, teacher)
    evaluate = None
    if held_out:

        def evaluate(params) -> dict[str, float]:
            batches = eval_batches(
                held_out,
                seq_len=cfg.data.seq_len,
                rows_per_batch=cfg.data.batch_size // cfg.grad_accum,
                packing=cfg.data.packing,
            )
            if cfg.data.eval_batches:
                batches = (rows for _, rows in zip(range(cfg.data.eval_batches), batches))
            sums: dict[str, float] = {}
            for rows in batches:
                batch = trainer.global_batch(rows)
                batch["teacher_logits"] = teacher.logits(batch)
                aux = trainer.eval_step(params, batch)
                for key in ("loss", "tokens", *METRICS):
                    sums[key] = sums.get(key, 0.0) + float(aux[key])
            tokens = max(sums["tokens"], 1.0)
            return {
                "eval_loss": sums["loss"] / tokens,
                **{f"eval_{k}": sums[k] / tokens for k in METRICS},
                "eval_tokens": sums["tokens"],
            }

    result = run_training(
        trainer,
        source,
        log=log,
        evaluate=evaluate,
        meta={"stage": "distill", "distill_config": cfg.model_dump(mode="json")},
        logged=("loss", "grad_norm", *METRICS),
    )
    result.update(
        {
            "train_examples": len(train_examples),
            "eval_examples": len(held_out),
            "teacher_params": teacher_cfg.num_params(),
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.posttrain.distill", DistillConfig, run_distill)


def step_spec(cfg: DistillConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): the batch counts the teacher's logits; the teacher's
    parameters and sampling are beside the step."""
    model, compute = fine_tuned_model(cfg, models)
    count, size = frozen_params_gib(models, "teacher", cfg.teacher.compute)
    return StepSpec(
        train_config(cfg, model, compute),
        objective=lambda graphdef: distill_objective(graphdef, cfg),
        batch=batch_shapes(cfg, model.vocab_size),
        uncounted=lambda plan: [
            f"the batch counts the teacher's logits; the frozen teacher's parameters ({count:,}, {size:.2f} GiB "
            "in all, sharded over the same mesh) are held beside this step and not counted in it, nor is "
            "sampling (lmbda, seq_kd)"
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
