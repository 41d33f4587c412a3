"""GRPO and GSPO: sample G completions per prompt, score them, push the policy toward the
better ones of each group.

One step (a "rollout batch"):

    prompts_per_step prompts  -> G completions each (engine/sample.py, the current params)
    -> rewards (engine/rewards.py) -> group advantages (engine/policy_loss.py)
    -> num_iterations (mu) optimizer updates on that batch (engine/policy_loss.py objective)

The old policy's log-probs are the current params' before the first update: with mu = 1
they equal the live ones (stop_gradient) and every ratio is exactly 1; with mu > 1 one
extra forward pass stores them. With beta > 0 a frozen copy of the initial params is the
reference model of the k3 KL penalty; with beta = 0 none is kept.

The choices where TRL and Tunix differ are config fields: `algorithm` grpo (token ratio) or
gspo with `gspo_variant` sequence (TRL's importance_sampling_level=sequence) or token
(Tunix's gspo-token); `loss_type` grpo | bnpo | dr_grpo | dapo (TRL's default dapo; Tunix's
grpo aggregation is bnpo, its gspo-token aggregation is grpo); `beta` (TRL 0.0, Tunix 0.04).

Mesh, shardings, optimizer and checkpoints are the pretraining engine's (engine.train.Trainer).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from pydantic import Field, model_validator

from engine.config import (CheckpointConfig, ConfigError, MeshConfig, ModelConfig, OptimizerConfig, ScheduleConfig,
                           Strict, TrainConfig)
from engine.rewards import RewardSpec


class GRPODataConfig(Strict):
    """The prompts: JSONL, one record per line, `prompt` text or a message list plus any
    columns the reward functions read (e.g. `answer`)."""

    path: str | None = None
    """A JSONL file or a directory of *.jsonl files; required."""
    prompt_field: str = "prompt"
    shuffle: bool = True
    seed: int = 0


class GRPOConfig(Strict):
    """One GRPO/GSPO run."""

    algorithm: Literal["grpo", "gspo"] = "grpo"
    """grpo: token-level importance ratios; gspo: the length-normalised sequence ratio."""
    gspo_variant: Literal["sequence", "token"] = "sequence"
    """gspo only. sequence: one clipped ratio per sequence (TRL); token: GSPO-token, the
    sequence ratio's value with per-token gradients (Tunix's gspo-token)."""
    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6, weight_decay=0.0)
    schedule: ScheduleConfig = ScheduleConfig(kind="constant")
    data: GRPODataConfig = GRPODataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    """checkpoint.init_from (the policy to start from) and checkpoint.directory are required."""
    rewards: list[RewardSpec] = Field(min_length=1)
    """Reward terms; the reward of a completion is their weighted sum."""
    steps: int = Field(100, gt=0)
    """Rollout batches; each makes num_iterations optimizer updates."""
    prompts_per_step: int = Field(8, gt=0)
    num_generations: int = Field(8, ge=2)
    """G: completions per prompt, the group the advantages are relative to."""
    max_prompt_length: int = Field(256, gt=0)
    """Longer prompts keep their last tokens (TRL truncates on the left too)."""
    max_completion_length: int = Field(256, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    epsilon: float = Field(0.2, gt=0)
    """Clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = Field(None, gt=0)
    """None: epsilon. DAPO's clip-higher uses e.g. 0.28."""
    beta: float = Field(0.0, ge=0)
    """KL penalty weight to the frozen initial policy (k3 estimator); 0 keeps no reference model."""
    num_iterations: int = Field(1, gt=0)
    """mu: optimizer updates per rollout batch, each on the whole batch."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per update; prompts_per_step * num_generations must divide evenly."""
    seed: int = 0
    log_every: int = Field(1, gt=0)
    metrics_dir: str | None = None
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        rows = self.prompts_per_step * self.num_generations
        if rows % self.grad_accum:
            raise ValueError(f"prompts_per_step * num_generations ({rows}) must be divisible by grad_accum "
                             f"({self.grad_accum})")
        if self.gspo_variant != "sequence" and self.algorithm != "gspo":
            raise ValueError("gspo_variant applies to algorithm: gspo only")
        return self

    @property
    def importance_sampling_level(self) -> str:
        if self.algorithm == "grpo":
            return "token"
        return "sequence" if self.gspo_variant == "sequence" else "sequence_token"


NON_SEMANTIC_FIELDS = ("log_every", "progress", "metrics_dir", "checkpoint.async_save")


def train_config(cfg: GRPOConfig, model_cfg: ModelConfig) -> TrainConfig:
    """The pretraining engine's view: rows = prompts x G, optimizer steps = steps x mu."""
    seq_len = cfg.max_prompt_length + cfg.max_completion_length
    if seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"max_prompt_length + max_completion_length ({seq_len}) exceeds the model's max_seq_len "
                          f"({model_cfg.max_seq_len})")
    tree = cfg.model_dump(include={"mesh", "optimizer", "schedule", "checkpoint", "grad_accum", "seed",
                                   "metrics_dir", "progress"})
    tree.update(model=model_cfg.model_dump(), steps=cfg.steps * cfg.num_iterations, log_every=cfg.log_every,
                data={"seq_len": max(seq_len, 2), "batch_size": cfg.prompts_per_step * cfg.num_generations})
    return TrainConfig.model_validate(tree)


# --------------------------------------------------------------------------- prompts


class PromptStream:
    """Endless prompt records over epochs, reshuffled each epoch; state is (epoch, index)."""

    def __init__(self, records: list[dict], shuffle: bool, seed: int):
        self.records, self.shuffle, self.seed = records, shuffle, seed
        self.epoch, self.index = 0, 0

    def _order(self) -> np.ndarray:
        order = np.arange(len(self.records))
        return np.random.default_rng([self.seed, self.epoch]).permutation(order) if self.shuffle else order

    def take(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            order = self._order()
            take = min(n - len(out), len(order) - self.index)
            out += [self.records[i] for i in order[self.index:self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))


def load_prompts(data: GRPODataConfig) -> list[dict]:
    from engine.sft import read_jsonl

    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of prompts")
    records = []
    for where, record in read_jsonl(data.path):
        prompt = record.get(data.prompt_field)
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise ConfigError(f"{where}: '{data.prompt_field}' must be non-empty text or a message list")
        records.append(record)
    return records


# --------------------------------------------------------------------------- jitted pieces


def make_logps_fn(graphdef, prompt_len: int, temperature: float):
    """logps(params, batch) -> (log p of the completion tokens, entropy), (b, completion_len)."""
    from engine.policy_loss import completion_logps
    from engine.train import apply_model

    def logps(params, batch):
        logits = apply_model(graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        completion = batch["tokens"][:, prompt_len:]
        return completion_logps(logits[:, prompt_len - 1:-1], completion, temperature)

    return logps


def make_loss_fn(graphdef, cfg: GRPOConfig, prompt_len: int):
    """loss_fn(params, batch, total_tokens) -> (loss, metrics) of one micro-batch."""
    import jax.numpy as jnp

    from engine.policy_loss import policy_loss

    logps_fn = make_logps_fn(graphdef, prompt_len, cfg.temperature)

    def loss_fn(params, batch, total_tokens):
        logp, entropy = logps_fn(params, batch)
        mask = batch["completion_mask"]
        loss, metrics = policy_loss(
            logp, batch.get("old_logps"), batch["advantages"][:, 0], mask, ref_logp_bt=batch.get("ref_logps"),
            level=cfg.importance_sampling_level, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high or cfg.epsilon,
            beta=cfg.beta, loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
            total_tokens=total_tokens, accumulation_steps=cfg.grad_accum,
        )
        metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return loss, metrics

    return loss_fn


def make_update_step(loss_fn: Callable, tx, grad_accum: int):
    """update(params, opt_state, batch) -> (params, opt_state, metrics), micro-batches summed
    as in engine.train.make_train_step (rows i, i+A, ... so each stays evenly sharded)."""
    import jax
    import jax.numpy as jnp
    import optax

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update(params, opt_state, batch):
        total_tokens = jnp.sum(batch["completion_mask"])
        if grad_accum == 1:
            (loss, metrics), grads = grad_fn(params, batch, total_tokens)
        else:
            micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                                 batch)
            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(grad_fn, params, first, total_tokens)
            start = {"ratio_max": -jnp.inf, "ratio_min": jnp.inf}
            zeros = jax.tree_util.tree_map_with_path(
                lambda path, s: jnp.full(s.shape, start.get(getattr(path[-1], "key", None), 0.0), s.dtype), shapes)
            combine = {"ratio_max": jnp.maximum, "ratio_min": jnp.minimum}

            def body(carry, mb):
                (loss, metrics), grads = carry
                (mb_loss, mb_metrics), mb_grads = grad_fn(params, mb, total_tokens)
                metrics = {k: combine.get(k, jnp.add)(v, mb_metrics[k]) for k, v in metrics.items()}
                return ((loss + mb_loss, metrics), jax.tree.map(jnp.add, grads, mb_grads)), None

            ((loss, metrics), grads), _ = jax.lax.scan(body, zeros, micro)
            # Other metrics are per-micro-batch means: average them.
            metrics = {k: v if k in combine else v / grad_accum for k, v in metrics.items()}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}

    return update


# --------------------------------------------------------------------------- the run


def _gather(x):
    """Rollout outputs as host numpy arrays on every process."""
    import jax

    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_grpo(cfg: GRPOConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `cfg.steps` rollout batches, resuming from checkpoint.directory if it has one."""
    import jax

    from engine.checkpoint import Checkpointer, load_params
    from engine.metrics import MetricsWriter
    from engine.policy_loss import group_advantages
    from engine.rewards import compute_rewards, load_reward, nan_stats, total_reward
    from engine.sample import Sampler, decode_completions, encode_prompts, left_pad, prompt_positions
    from engine.sft import finetune_start
    from engine.sharding import replicated, use_mesh
    from engine.train import Preempted, Trainer, TrainingError, _install_sigterm, _truncate_metrics, log_to_stderr

    log = log or log_to_stderr
    model_cfg, bundle = finetune_start(cfg)
    reward_fns = [(*load_reward(spec), spec) for spec in cfg.rewards]
    weights = [spec.weight for spec in cfg.rewards]
    prompts = PromptStream(load_prompts(cfg.data), cfg.data.shuffle, cfg.data.seed)
    tcfg = train_config(cfg, model_cfg)
    trainer = Trainer(tcfg)
    mesh = trainer.mesh
    G, P, C = cfg.num_generations, cfg.max_prompt_length, cfg.max_completion_length
    pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id

    sampler = Sampler(model_cfg, mesh, trainer.param_shardings)
    rows = trainer.batch_sharding
    shard_all = lambda fn, out: jax.jit(fn, in_shardings=(trainer.param_shardings, rows), out_shardings=out)  # noqa: E731
    logps = shard_all(lambda p, b: make_logps_fn(trainer.graphdef, P, cfg.temperature)(p, b)[0], rows)
    update = jax.jit(make_update_step(make_loss_fn(trainer.graphdef, cfg, P), trainer.tx, cfg.grad_accum),
                     in_shardings=(trainer.param_shardings, trainer.opt_shardings, rows),
                     out_shardings=(trainer.param_shardings, trainer.opt_shardings, replicated(mesh)),
                     donate_argnums=(0, 1))

    ckpt = Checkpointer(cfg.checkpoint.directory, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    metrics_dir = cfg.metrics_dir or str(Path(cfg.checkpoint.directory).parent)
    step = ckpt.latest_step()
    if step is not None:
        params, opt_state, _, data_state = ckpt.restore(step, trainer.abstract_params, trainer.abstract_opt_state)
        prompts.set_state(data_state)
        log(f"resumed from checkpoint step {step} in {cfg.checkpoint.directory}")
    else:
        step = 0
        state = trainer.init_state()
        params, opt_state = state.params, state.opt_state
    ref_params = None
    if cfg.beta != 0.0:  # the reference is the policy the run started from
        ref_params = load_params(cfg.checkpoint.init_from, trainer.abstract_params)[1]
    _truncate_metrics(metrics_dir, step)
    writer = MetricsWriter(metrics_dir, enabled=jax.process_index() == 0)
    stop = _install_sigterm()
    meta = {"config": tcfg.model_dump(mode="json"), "model": model_cfg.model_dump(mode="json"), "seed": cfg.seed,
            "format": "trainflow.checkpoint/1", "stage": "grpo", "grpo_config": cfg.model_dump(mode="json")}
    final: dict[str, Any] = {}
    try:
        while step < cfg.steps:
            # ---- rollout
            t0 = time.perf_counter()
            records = prompts.take(cfg.prompts_per_step)
            prompt_inputs = [r[cfg.data.prompt_field] for r in records]
            prompt_tokens, prompt_mask = left_pad(encode_prompts(bundle, prompt_inputs), pad_id=pad_id, length=P)
            prompt_tokens, prompt_mask = np.repeat(prompt_tokens, G, 0), np.repeat(prompt_mask, G, 0)
            out = sampler(params, prompt_tokens, prompt_mask, seed=jax.random.fold_in(jax.random.key(cfg.seed), step),
                          max_new_tokens=C, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                          eos_ids=(bundle.eos_id,), pad_id=pad_id)
            rollout_seconds = time.perf_counter() - t0

            # ---- rewards and advantages (on the host)
            completions = decode_completions(bundle, out)
            completion_ids = [row[mask].tolist() for row, mask in zip(out.tokens, out.mask)]
            names = dict.fromkeys(k for r in records for k in r if k != cfg.data.prompt_field)
            columns = {k: [r.get(k) for r in records for _ in range(G)] for k in names}
            per_function = compute_rewards(
                reward_fns, prompts=[p for p in prompt_inputs for _ in range(G)], completions=completions,
                completion_ids=completion_ids, columns=columns, max_completion_length=C, step=step)
            rewards, valid = total_reward(per_function, weights)
            advantages, group_std = group_advantages(rewards, valid, G, cfg.scale_rewards)

            # ---- mu updates on this batch
            t1 = time.perf_counter()
            tokens = np.concatenate([prompt_tokens, out.tokens], 1)
            segments = np.concatenate([prompt_mask, out.mask.astype(np.int32)], 1)
            batch = {"tokens": tokens, "segment_ids": segments, "positions": np.asarray(prompt_positions(segments)),
                     "completion_mask": out.mask.astype(np.float32), "advantages": advantages[:, None]}
            batch = trainer.global_batch(  # every process holds the whole rollout: each passes its rows
                {k: np.array_split(v, jax.process_count())[jax.process_index()] for k, v in batch.items()})
            with use_mesh(mesh):
                if ref_params is not None:
                    batch["ref_logps"] = logps(ref_params, batch)
                if cfg.num_iterations > 1:
                    batch["old_logps"] = logps(params, batch)
                for _ in range(cfg.num_iterations):
                    params, opt_state, update_metrics = update(params, opt_state, batch)
            update_metrics = {k: float(v) for k, v in jax.device_get(update_metrics).items()}
            update_seconds = time.perf_counter() - t1
            step += 1
            if not math.isfinite(update_metrics["loss"]):
                ckpt.wait()
                raise TrainingError(f"non-finite loss at step {step}; stopped. The last good checkpoint "
                                    f"(step {ckpt.latest_step()}) in {cfg.checkpoint.directory} is intact")

            # ---- metrics and checkpoints
            lengths = out.lengths.astype(float)
            values = {
                "reward": float(rewards[valid].mean()) if valid.any() else math.nan,
                "reward_std": nan_stats(np.where(valid, rewards, np.nan))[1],
                "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                "reward_invalid": float((~valid).sum()),
                "completion_length": float(lengths.mean()),
                "completion_length_min": float(lengths.min()), "completion_length_max": float(lengths.max()),
                "completion_clipped_ratio": float(np.mean(~np.isin(out.tokens, [bundle.eos_id]).any(1))),
                "rollout_seconds": rollout_seconds, "update_seconds": update_seconds,
                "learning_rate": float(trainer.schedule(step * cfg.num_iterations - 1)),
                **update_metrics,
            }
            for j, (name, _, _) in enumerate(reward_fns):
                values[f"reward/{name}/mean"], values[f"reward/{name}/std"] = nan_stats(per_function[:, j])
            if step % cfg.log_every == 0 or step == cfg.steps:
                writer.write(step, values)
            final.update(values)
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or stop["stop"]:
                ckpt.save(step, params, opt_state, {**meta, "step": step}, prompts.get_state())
            if stop["stop"]:
                ckpt.close()
                raise Preempted(f"SIGTERM: saved checkpoint at step {step} in {cfg.checkpoint.directory}")
    finally:
        writer.close()
        ckpt.close()
    final.update({"steps": step, "num_params": model_cfg.num_params()})
    return final


def main(argv: list[str] | None = None) -> int:
    from engine.rewards import RewardError
    from engine.train import run_cli

    return run_cli(argv, "engine.grpo", GRPOConfig, run_grpo, failures=(RewardError,))


if __name__ == "__main__":
    sys.exit(main())
