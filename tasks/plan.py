"""`trainflow plan PIPELINE.yaml --target NAME`: the preflight of every training stage.

Each pretrain, sft and grpo stage's engine config is built as the stage builds it (the
trainer's view of SFT and GRPO, GRPO's policy objective and rollout batch), and its step is
compiled for the target (engine/train/plan.py). A fine-tuning stage without a `model` trains
the model of its input checkpoint: that of the upstream training stage (also when it reads
one of its steps, `pretrain@2000`), or of the upstream artifact when it is already in the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from engine.config import ConfigError
from engine.models.config import ComputeConfig, ModelConfig
from engine.posttrain import distill, dpo, grpo, reward_model, sft
from engine.posttrain.config import DPOConfig, GRPOConfig
from engine.train.bucket_paths import is_url
from engine.train.checkpoint import stored_configs
from engine.train.plan import Plan, plan_step, report
from engine.train.targets import get_target

TRAINING_TASKS = ("pretrain", "sft", "grpo", "dpo", "reward_model", "distill")
_STEP_INPUT = re.compile(r"@\d+$")  # an input `stage@STEP` (flows/sweep.py), as a job names it


def grpo_batch(cfg: GRPOConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one GRPO update's batch: prompts x G rollouts (engine/posttrain/grpo.py)."""
    rows, prompt, completion = (
        cfg.prompts_per_step * cfg.num_generations,
        cfg.max_prompt_length,
        cfg.max_completion_length,
    )
    batch = {
        k: jax.ShapeDtypeStruct((rows, prompt + completion), np.int32) for k in ("tokens", "segment_ids", "positions")
    }
    batch["completion_mask"] = jax.ShapeDtypeStruct((rows, completion), np.float32)
    batch["advantages"] = jax.ShapeDtypeStruct((rows, 1), np.float32)
    if cfg.beta > 0:
        batch["ref_logps"] = jax.ShapeDtypeStruct((rows, completion), np.float32)
    if cfg.num_iterations > 1:
        batch["old_logps"] = jax.ShapeDtypeStruct((rows, completion), np.float32)
    return batch


def reward_batch(cfg) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one reward-model batch: a row per pair, where each sequence ends, margins."""
    rows, width = cfg.data.batch_size, 2 * cfg.data.max_length
    batch = {k: jax.ShapeDtypeStruct((rows, width), np.int32) for k in ("tokens", "positions", "segment_ids")}
    batch["last_bk"] = jax.ShapeDtypeStruct((rows, 2), np.int32)
    batch.update(
        margin=jax.ShapeDtypeStruct((rows, 1), np.float32), pair_mask=jax.ShapeDtypeStruct((rows, 1), np.float32)
    )
    return batch


def dpo_batch(cfg: DPOConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one DPO batch: a row per pair (chosen then rejected), and the reference's log-probs."""
    rows, width = cfg.data.batch_size, 2 * cfg.data.max_length
    batch = {
        k: jax.ShapeDtypeStruct((rows, width), np.int32) for k in ("tokens", "targets", "positions", "segment_ids")
    }
    batch["loss_mask"] = jax.ShapeDtypeStruct((rows, width), np.float32)
    if cfg.loss_type != "simpo":
        batch["ref_logps"] = jax.ShapeDtypeStruct((rows, 2), np.float32)
    return batch


def plan_pipeline(plan, target_name: str) -> tuple[list[Plan], list[str]]:
    """(a Plan of every training stage of a loaded pipeline (flows.spec.load_plan) for the
    target, notes on what the plans leave out)."""
    target = get_target(target_name)
    models: dict[str, tuple[ModelConfig, ComputeConfig]] = {}
    plans: list[Plan] = []
    notes: list[str] = []
    for name, planned in plan.stages.items():
        job, task = planned.job, planned.job.kind.task
        if task not in TRAINING_TASKS:
            continue
        cfg = job.config
        if task == "pretrain":
            models[name] = (cfg.model, cfg.compute)
            # Without an `init` input it trains from random weights: no adapter to offer.
            plans.append(plan_step(cfg, target, stage=name, from_scratch="init" not in planned.refs))
            continue
        model_cfg, compute = _input_model(plan, name, models)
        model_cfg, compute = cfg.model or model_cfg, cfg.compute or compute
        models[name] = (model_cfg, compute)
        if task == "sft":
            plans.append(plan_step(sft.train_config(cfg, model_cfg, compute), target, stage=name))
        elif task == "reward_model":
            plans.append(
                plan_step(
                    reward_model.train_config(cfg, model_cfg, compute),
                    target,
                    stage=name,
                    objective=lambda graphdef, cfg=cfg: reward_model.reward_objective(graphdef, cfg),
                    batch=reward_batch(cfg),
                    make_trainer=lambda c, o, devices, cfg=cfg: reward_model.RewardTrainer(
                        c, o, cfg.head_init, devices=devices
                    ),
                )
            )
        elif task == "dpo":
            plans.append(
                plan_step(
                    dpo.train_config(cfg, model_cfg, compute),
                    target,
                    stage=name,
                    objective=lambda graphdef, cfg=cfg: dpo.dpo_objective(graphdef, cfg),
                    batch=dpo_batch(cfg),
                )
            )
            if cfg.loss_type != "simpo" and "reference" in plan.stages[name].job.inputs and not cfg.precompute_ref:
                reference, reference_compute = _input_model(plan, name, models, "reference")
                reference_compute = cfg.reference.compute or reference_compute
                size = reference.num_params() * jax.numpy.dtype(reference_compute.param_dtype).itemsize / 2**30
                notes.append(
                    f"note: stage {name} (dpo): the frozen reference's parameters ({reference.num_params():,}, "
                    f"{size:.2f} GiB in all, sharded over the same mesh) are held beside this step and not counted "
                    "in it (precompute_ref: true holds none)"
                )
            elif cfg.loss_type != "simpo" and cfg.lora is None and not cfg.precompute_ref:
                notes.append(
                    f"note: stage {name} (dpo): the frozen reference's parameters, a second copy of "
                    f"{plans[-1].memory.parameters / 2**30:.2f} GiB per device, are held beside this step "
                    "and not counted in it (lora: or precompute_ref: true hold none)"
                )
        elif task == "distill":
            plans.append(
                plan_step(
                    distill.train_config(cfg, model_cfg, compute),
                    target,
                    stage=name,
                    objective=lambda graphdef, cfg=cfg: distill.distill_objective(graphdef, cfg),
                    batch=distill.batch_shapes(cfg, model_cfg.vocab_size),
                )
            )
            teacher, teacher_compute = _input_model(plan, name, models, "teacher")
            teacher_compute = cfg.teacher.compute or teacher_compute
            size = teacher.num_params() * jax.numpy.dtype(teacher_compute.param_dtype).itemsize / 2**30
            notes.append(
                f"note: stage {name} (distill): the batch counts the teacher's logits; the frozen teacher's "
                f"parameters ({teacher.num_params():,}, {size:.2f} GiB in all, sharded over the same mesh) "
                "are held beside this step and not counted in it, nor is sampling (lmbda, seq_kd)"
            )
        else:
            plans.append(
                plan_step(
                    grpo.train_config(cfg, model_cfg, compute),
                    target,
                    stage=name,
                    objective=lambda graphdef, cfg=cfg: grpo.policy_objective(
                        grpo.make_loss_fn(graphdef, cfg, cfg.max_prompt_length)
                    ),
                    batch=grpo_batch(cfg),
                    updates_per_batch=cfg.num_iterations,
                )
            )
            notes.append(
                f"note: stage {name} (grpo): the plan is of its train step; rollout sampling and the KL "
                "reference's parameters are not counted"
            )
    return plans, notes


def print_pipeline_plan(plan, target_name: str, print_fn: Callable[[str], None] = print) -> dict:
    """`trainflow plan`: print each training stage's plan; raises engine.train.plan.DoesNotFit
    when a stage does not fit the target."""
    plans, notes = plan_pipeline(plan, target_name)
    if not plans:
        print_fn(f"pipeline {plan.name} has no training stage ({', '.join(TRAINING_TASKS)}): nothing to plan")
        return {}
    try:
        return report(plans, print_fn)
    finally:
        for note in notes:
            print_fn(note)


def _input_model(plan, name: str, models: dict, input_name: str = "checkpoint") -> tuple[ModelConfig, ComputeConfig]:
    """The model (and compute settings) of stage `name`'s input checkpoint (or other model input)."""
    upstream, artifact_id = plan.stages[name].job.inputs[input_name]
    # `pretrain@2000` reads a step of pretrain (its snapshot artifact `pretrain@2000/<id>`):
    # the model is pretrain's, planned above or stored in either artifact.
    stage = _STEP_INPUT.sub("", upstream)
    if stage in models:
        return models[stage]
    for stored in dict.fromkeys((upstream, stage)):
        path = plan.store.checkpoint_location(stored, artifact_id)  # a directory, or the bucket's URL
        if plan.store.state(stored, artifact_id) == "complete" and (is_url(path) or Path(path).is_dir()):
            return stored_configs(path)
    raise ConfigError(
        f"{plan.source}: stages.{name}: its model is the checkpoint of stage '{upstream}', which "
        f"is not in the store yet; run that stage first, or set stages.{name}.config.model"
    )
