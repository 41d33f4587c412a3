"""GRPO and GSPO: sample G completions per prompt, score them, push the policy toward the
better ones of each group.

One step (a "rollout batch"):

    prompts_per_step prompts  -> G completions each (engine/inference/sample.py, the live params;
                                 one prefill per prompt, its cache shared by the G rows)
    -> rewards (rewards.py; a reward model's scores: reward_model.py)
    -> advantages (advantages.py, `advantage_estimator`)              = RolloutSource, the batches
    -> num_iterations (mu) optimizer updates on that batch            = policy_objective, the loss
                                 (policy_loss.py: `loss_type`, `loss_aggregation`)

With rollout_workers > 0 the completions come from worker processes (async_rollout.py) that
generate max_staleness batches ahead with weights sent after every update. Every batch carries
the sampler's own (behaviour) log-probs: each step logs their gap to the trainer's on the same
tokens (rollout_correction.py's mismatch metrics), and `rollout_correction` weights or masks the
loss by their importance ratios (logged whenever a batch is off-policy).

The old policy's log-probs are the current params' before the first update: with mu = 1
they equal the live ones (stop_gradient) and every ratio is exactly 1; with mu > 1 one
extra forward pass stores them. With beta > 0 a frozen copy of the initial params is the
reference model of the k3 KL penalty; with beta = 0 none is kept.

The choices where TRL and Tunix differ are config fields: `algorithm` grpo (token ratio) or
gspo with `gspo_variant` sequence (TRL's importance_sampling_level=sequence) or token
(Tunix's gspo-token); `loss_type`, a registered name (registry.py: TRL's grpo, bnpo, dr_grpo,
dapo, luspo, cispo; TRL's default dapo; Tunix's grpo aggregation is bnpo, its gspo-token
aggregation is grpo); `beta` (TRL 0.0, Tunix 0.04).

Everything else (mesh, shardings, optimizer, resume, checkpoints, SIGTERM, logging) is the
trainer's: GRPO is a batch source and an objective on the loop every stage shares.
"""

from __future__ import annotations

import hashlib
import json
import math
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
from engine.inference.sample import decode_completions, prompt_positions
from engine.models.config import ModelConfig
from engine.models.lora import LORA_SEED, dropout_rows
from engine.models.params import apply_model_with_aux, graphdef_of
from engine.models.router_replay import ROUTER_EXPERTS, replaying
from engine.ops.partitioning import use_mesh
from engine.posttrain.async_rollout import (
    RolloutWorkerError,
    RolloutWorkers,
    episode_runner,
    generate_batch,
    replays_routes,
    rollout_sampler,
)
from engine.posttrain.config import GRPOConfig, GRPODataConfig, train_config
from engine.posttrain.environments import EnvironmentFailure
from engine.posttrain.finetune import finetune_start, read_jsonl
from engine.posttrain.policy_loss import completion_logps, policy_loss, sapo
from engine.posttrain.procedural_tasks import prompt_records
from engine.posttrain.registry import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from engine.posttrain.reward_model import RewardScorer
from engine.posttrain.rewards import RewardError, compute_rewards, load_reward, nan_stats, total_reward
from engine.posttrain.rollout import Rollout
from engine.posttrain.rollout_correction import divergence_summary, mismatch_metrics, rollout_correction
from engine.posttrain.rollout_server import ROLLOUT_ENTRY_POINT
from engine.train.checkpoint import load_params, verify_step
from engine.train.cli import run_cli
from engine.train.hooks import log_to_stderr, run_training
from engine.train.metrics import read_metrics
from engine.train.plan import InputModels, StepSpec, fine_tuned_model
from engine.train.step import Objective, moe_metrics
from engine.train.trainer import Trainer, TrainState

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
            out += [self.records[i] for i in order[self.index : self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    @property
    def identity(self) -> str:
        """The records' content (sha256 of their canonical JSON): what the cursor counts in."""
        text = json.dumps(self.records, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def set_state(self, state: dict) -> None:
        self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))


def load_prompts(data: GRPODataConfig) -> list[dict]:
    if data.reasoning_gym is not None:  # generated by reasoning-gym, not read
        return prompt_records(data.reasoning_gym, data.prompt_field)
    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of prompts (or data.reasoning_gym)")
    records = []
    for where, record in read_jsonl(data.path):
        prompt = record.get(data.prompt_field)
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise ConfigError(f"{where}: '{data.prompt_field}' must be non-empty text or a message list")
        records.append(record)
    return records


# --------------------------------------------------------------------------- the objective

# How policy metrics combine over micro-batches: each micro-batch's loss is already scaled to
# its share of the batch (policy_loss's accumulation_steps), the rest are per-micro-batch means.
POLICY_REDUCE = {
    "loss": "sum",
    "ratio_max": "max",
    "ratio_min": "min",
    "is_ratio_max": "max",
    "is_ratio_min": "min",
    "sampling/sampling_logp_difference/max": "max",
    "rollout_corr/rollout_is_max": "max",
    "rollout_corr/rollout_is_min": "min",
}


def completion_tokens(batch) -> jax.Array:
    """The normaliser of dapo: completion tokens of the whole rollout batch."""
    return jnp.sum(batch["completion_mask"])


def policy_objective(loss_fn: Callable, normaliser: Callable = completion_tokens) -> Objective:
    """An Objective from `loss_fn(params, batch, total_tokens) -> (loss, policy metrics)`."""

    def with_loss(params, batch, total_tokens):
        loss, metrics = loss_fn(params, batch, total_tokens)
        return loss, {**metrics, "loss": loss}

    return Objective(with_loss, normaliser, reduce=POLICY_REDUCE, default="mean")


def corrected(cfg: GRPOConfig, batch) -> tuple[jax.Array, jax.Array | None, dict]:
    """(the loss's mask, importance weights or None, their metrics) of an off-policy batch
    (`rollout_correction`, or stale rollouts: their ratios logged, uncorrected). Row by row, so a
    micro-batch's are the whole batch's rows."""
    mask = batch["completion_mask"]
    if not cfg.off_policy:
        return mask, None, {}
    correction = cfg.rollout_correction
    weights, keep, metrics = rollout_correction(
        batch["old_logps"],
        batch["behaviour_logps"],
        mask,
        correction.mode if correction else "token_truncate",
        correction.clip_min if correction else None,
        correction.clip_max if correction else None,
    )
    if correction is None:
        return mask, None, metrics
    return (mask if keep is None else keep), weights, metrics


def loss_tokens(cfg: GRPOConfig) -> Callable:
    """The normaliser of token_mean: the completion tokens the loss keeps (a correction such as
    icepop removes some), over the whole rollout batch."""
    return lambda batch: jnp.sum(corrected(cfg, batch)[0])


def make_logps_fn(graphdef, prompt_len: int, temperature: float, *, with_aux: bool = False):
    """logps(params, batch) -> (log p of the completion tokens, entropy), (b, completion_len);
    with_aux: ((log p, entropy), aux), aux a mixture of experts' router losses (empty if dense).
    A batch with the rollout's routes (router replay) sends each token to the experts it was
    sampled with."""

    def logps(params, batch):
        # LoRA's dropout rows are set in training steps only: never in the rollout's log-probs.
        with dropout_rows(batch.get(LORA_SEED)), replaying(batch.get(ROUTER_EXPERTS)):
            logits, aux = apply_model_with_aux(
                graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
            )
        completion = batch["tokens"][:, prompt_len:]
        out = completion_logps(logits[:, prompt_len - 1 : -1], completion, temperature)
        return (out, aux) if with_aux else out

    return logps


def resolve_objective(cfg: GRPOConfig) -> tuple[Callable, Callable]:
    """The run's (policy loss, aggregation) functions; a user's module:function that cannot be
    imported is a ConfigError naming it."""
    try:
        loss = POLICY_LOSSES.resolve(cfg.loss_type)
        if cfg.loss_type == "sapo":  # the run's gate temperatures
            loss = sapo(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        aggregation = cfg.loss_aggregation or getattr(loss, "aggregation", "token_mean")
        return loss, LOSS_AGGREGATIONS.resolve(aggregation)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_loss_fn(graphdef, cfg: GRPOConfig, prompt_len: int):
    """loss_fn(params, batch, total_tokens) -> (loss, metrics) of one micro-batch."""
    logps_fn = make_logps_fn(graphdef, prompt_len, cfg.temperature, with_aux=True)
    loss_def, aggregate = resolve_objective(cfg)

    def loss_fn(params, batch, total_tokens):
        (logp, entropy), moe = logps_fn(params, batch)
        sampled = batch["completion_mask"]
        mask, is_weights, is_metrics = corrected(cfg, batch)
        loss, metrics = policy_loss(
            logp,
            batch.get("old_logps"),
            batch["advantages"][:, 0],
            mask,
            ref_logp_bt=batch.get("ref_logps"),
            level=cfg.importance_sampling_level,
            epsilon_low=cfg.epsilon,
            epsilon_high=cfg.epsilon_high or cfg.epsilon,
            beta=cfg.beta,
            loss_type=loss_def,
            aggregation=aggregate,
            max_completion_length=cfg.max_completion_length,
            total_tokens=total_tokens,
            accumulation_steps=cfg.grad_accum,
            is_weights=is_weights,
        )
        metrics.update(is_metrics)
        if "behaviour_logps" in batch:
            # The rollout/trainer gap, every step: the sampler's log-probs against the trainer's
            # policy the update starts from (with mu = 1 and no correction, this forward's own).
            trainer_logp = batch.get("old_logps", jax.lax.stop_gradient(logp))
            metrics.update(mismatch_metrics(trainer_logp, batch["behaviour_logps"], sampled))
        metrics["entropy"] = jnp.sum(entropy * sampled) / jnp.maximum(jnp.sum(sampled), 1.0)
        if moe:
            # A mixture of experts keeps its router losses, weighted by compute.moe_balance_loss
            # and moe_router_z_loss (0 turns each off), as in pretraining and SFT. (TRL adds
            # router_aux_loss_coef * the balancing loss when the model is set to output its
            # router logits, and no z-loss.) Each micro-batch's share is 1/grad_accum, like its
            # policy loss; the statistics cover prompt and completion tokens, not the left padding.
            loss = loss + moe["aux_loss"] / cfg.grad_accum
            metrics.update(moe_metrics(moe, 1.0))
        return loss, metrics

    return loss_fn


# --------------------------------------------------------------------------- the batches


class RolloutSource:
    """The trainer's batch source: prompts -> G completions each (`generate`, the rollout seam)
    -> rewards -> advantages, plus the old policy's (mu > 1, or an off-policy rollout) and the
    reference's (beta > 0) log-probs. Every process samples the whole batch and passes on its rows.

    With rollout_workers > 0 the completions come from worker processes (async_rollout.py) that
    generate `max_staleness` batches ahead with weights sent after each update (`weights_hook`);
    with 0 this process generates each batch with the live params, on-policy."""

    def __init__(self, cfg: GRPOConfig, trainer: Trainer, model_cfg: ModelConfig, bundle: TokenizerBundle, log=None):
        self.cfg, self.trainer, self.bundle, self.log = cfg, trainer, bundle, log or log_to_stderr
        self.prompts = PromptStream(load_prompts(cfg.data), cfg.data.shuffle, cfg.data.seed)
        self.dataset = self.prompts.identity  # the prompt cursor is only valid over these records
        self.reward_fns = [(*load_reward(spec), spec) for spec in cfg.rewards if spec.model is None]
        self.weights = [spec.weight for spec in cfg.rewards]
        self.pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
        try:
            self.advantage_fn = ADVANTAGE_ESTIMATORS.resolve(cfg.advantage_estimator)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # The rollout is off-policy (its sampler's log-probs differ from the trainer's) when it is
        # stale or when a correction is asked for (e.g. bf16 rollouts): the batch then carries the
        # behaviour log-probs and the old policy's, and the loss logs their ratios.
        self.off_policy = cfg.off_policy
        # A mixture of experts sampled by the engine: its routes are replayed in every forward
        # over the rollout (the policy loss's, the old policy's, the reference's).
        self.replay = replays_routes(cfg, model_cfg)
        # Reward models score the rollout's rows on the mesh, as they are (same tokenizer), by column.
        self.function_columns = [j for j, spec in enumerate(cfg.rewards) if spec.model is None]
        self.reward_models = {
            j: RewardScorer(
                spec.model,
                trainer.mesh,
                trainer.batch_sharding,
                policy_tokenizer=bundle,
                max_length=cfg.max_prompt_length + cfg.max_completion_length,
                where=f"rewards.{j}.model",
            )
            for j, spec in enumerate(cfg.rewards)
            if spec.model is not None
        }
        names = iter(name for name, _, _ in self.reward_fns)
        self.reward_names = [
            (spec.name or "reward_model") if spec.model is not None else next(names) for spec in cfg.rewards
        ]
        # With LoRA the sampler and the log-probs read the adapter and the frozen base side by
        # side (trainer.model_params), never a merged copy. Workers have their own samplers.
        self.sampler = None  # a rollout server's sampler is set by run_grpo
        if cfg.rollout_workers == 0 and cfg.rollout is None:
            self.sampler = rollout_sampler(cfg, model_cfg, trainer)
        # An environment's episodes replace the single completion (multiturn.py); the workers
        # run their own (a bad factory fails here, before any worker starts).
        self.episodes = episode_runner(cfg, bundle, self.pad_id, self.log)
        self.workers: RolloutWorkers | None = None
        self.stream_states: dict[int, dict] = {}  # the prompt stream before batch j was taken
        self.submitted = 0  # batches handed to the workers
        self.consumed = 0  # batches trained on
        rows = trainer.batch_sharding
        logps = make_logps_fn(trainer.graphdef, cfg.max_prompt_length, cfg.temperature)
        self.logps = jax.jit(
            lambda p, b: logps(p, b)[0], in_shardings=(trainer.model_param_shardings(), rows), out_shardings=rows
        )
        self.ref_logps, self.ref_params = self.logps, None
        if cfg.beta != 0.0 and cfg.lora is not None:
            # The reference is the base with the adapter switched off: the same arrays the
            # policy reads, through the model without adapters (no second copy; TRL, Tunix).
            base_logps = make_logps_fn(
                graphdef_of(model_cfg, trainer.cfg.compute), cfg.max_prompt_length, cfg.temperature
            )
            self.ref_logps = jax.jit(
                lambda p, b: base_logps(p, b)[0], in_shardings=(trainer.base_shardings, rows), out_shardings=rows
            )
        elif cfg.beta != 0.0:  # the reference is the policy the run started from
            self.ref_params = load_params(cfg.checkpoint.init_from, trainer.abstract_params)[1]

    # ---- the rollout seam: prompts -> completions, masks and behaviour log-probs

    def generate(self, params, records: list[dict], step: int) -> Rollout:
        """G completions of each record's prompt from `params` (this process's sampler); with an
        environment, G episodes of each record."""
        assert self.sampler is not None
        return generate_batch(
            self.cfg, self.sampler, self.bundle, params, records, step=step, pad_id=self.pad_id, episodes=self.episodes
        )

    def _take(self, step: int) -> list[dict]:
        self.stream_states[step] = self.prompts.get_state()
        return self.prompts.take(self.cfg.prompts_per_step)

    def _submit_until(self, last: int) -> None:
        """Hand batches up to `last` (and below cfg.steps) to the workers."""
        while self.submitted <= min(last, self.cfg.steps - 1):
            self.workers.submit(self.submitted, self._take(self.submitted))
            self.submitted += 1

    def _regenerate_in_flight(self, state: TrainState) -> None:
        """After a resume at step k, the batches that were in flight (k .. k + max_staleness - 1)
        are generated again as they were the first time: each with the weights of update
        b - max_staleness (that step's checkpoint; the initial policy before the first update),
        the same prompts and the same seeds, so the resumed run equals the uninterrupted one.
        Where those weights are not kept (checkpoint.keep, every_steps, a LoRA run's initial
        adapter) the batch comes from the restored weights instead, as the log says."""
        s, workers = self.cfg.max_staleness, self.workers
        assert workers is not None
        for b in range(state.step, min(state.step + s, self.cfg.steps)):
            version = max(b - s, 0)
            params = self._weights_of(version)
            if params is None:
                self.log(
                    f"resume: the weights of update {version} are not kept in {self.cfg.checkpoint.directory}; "
                    f"batches {b + 1} to {state.step + s} are generated with update {state.step}'s"
                )
                return
            workers.push(version, params)
            workers.submit(b, self._take(b))
            self.submitted = b + 1

    def _weights_of(self, version: int):
        """The policy's params after `version` updates, from its checkpoint (0: init_from), or None."""
        if self.cfg.lora is not None:  # the adapter's own start is not stored
            return None
        init_from, directory = self.cfg.checkpoint.init_from, self.cfg.checkpoint.directory
        assert init_from and directory  # finetune_start checked both
        if version == 0:
            return load_params(init_from, self.trainer.abstract_params)[1]
        if verify_step(directory, version):  # not there, or not intact
            return None
        return load_params(directory, self.trainer.abstract_params, version)[1]

    def weights_hook(self, info) -> None:
        """After each update: the new weights to the workers (with LoRA the adapter alone: each
        worker holds the frozen base), then the batch that may use them (max_staleness ahead of
        the one the trainer takes next). Not when stopping: no batch follows."""
        if self.workers is not None and not info.last and not info.stopping:
            self.workers.push(info.step, info.state.params)
            self._submit_until(info.step + self.cfg.max_staleness)

    def next_batch(self, state: TrainState) -> tuple[dict[str, jax.Array], dict[str, float]]:
        cfg = self.cfg
        t0 = time.perf_counter()
        if cfg.rollout_workers == 0:
            records = self._take(state.step)
            rollout = self.generate(self.trainer.model_params(state.params), records, state.step)
            rollout.weights_version = state.step
        else:
            if self.workers is None:  # started here, once the (restored) weights are known
                self.workers = RolloutWorkers(cfg, self.log)
                self.submitted = state.step
                if state.step > 0:
                    self._regenerate_in_flight(state)
                self.workers.push(state.step, state.params)
                self._submit_until(state.step + cfg.max_staleness)
            records, rollout = self.workers.result(state.step)
        waited = time.perf_counter() - t0  # the trainer's idle time: generating, or waiting for a worker
        self.consumed = state.step + 1
        self.stream_states = {j: v for j, v in self.stream_states.items() if j > state.step}
        batch, values = self.score(state, records, rollout)
        values["rollout_seconds"] = rollout.seconds if cfg.rollout_workers else waited
        values["rollout_wait_seconds"] = waited
        values["rollout_staleness"] = float(state.step - rollout.weights_version)
        return batch, values

    def score(self, state: TrainState, records: list[dict], rollout: Rollout):
        """Rewards, advantages and the log-probs the loss needs, as one global batch."""
        cfg, bundle = self.cfg, self.bundle
        prompt_inputs = [r[cfg.data.prompt_field] for r in records]
        G, C = cfg.num_generations, cfg.max_completion_length
        out = rollout.output
        loss_mask = out.mask if rollout.loss_mask is None else rollout.loss_mask
        tokens = np.concatenate([rollout.prompt_tokens, out.tokens], 1)
        segments = np.concatenate([rollout.prompt_mask, out.mask.astype(np.int32)], 1)
        rows = {
            "tokens": tokens,
            "segment_ids": segments,
            "positions": np.asarray(prompt_positions(segments)),
            "completion_mask": loss_mask.astype(np.float32),
            # The sampler's own log-probs of its tokens (engine sampler, workers, vLLM): the
            # rollout/trainer gap is measured on them every step, and corrected when off-policy.
            "behaviour_logps": out.logprobs.astype(np.float32),
        }
        if self.replay:
            assert out.experts is not None, "router replay: the rollout did not record its experts"
            rows[ROUTER_EXPERTS] = out.experts.astype(np.int32)
        batch = self.trainer.global_batch(rows)  # every process sampled the whole rollout

        # ---- rewards (functions on the host, reward models on the mesh) and advantages
        completions = decode_completions(bundle, out)
        completion_ids = [row[mask].tolist() for row, mask in zip(out.tokens, out.mask)]
        names = dict.fromkeys(k for r in records for k in r if k != cfg.data.prompt_field)
        columns = {k: [r.get(k) for r in records for _ in range(G)] for k in names}
        per_function = np.full((len(completions), len(cfg.rewards)), np.nan)
        per_function[:, self.function_columns] = compute_rewards(
            self.reward_fns,
            prompts=[p for p in prompt_inputs for _ in range(G)],
            completions=completions,
            completion_ids=completion_ids,
            columns=columns,
            max_completion_length=C,
            step=state.step,
        )
        for j, scorer in self.reward_models.items():
            per_function[:, j] = scorer(batch, completions)  # a process reward model reads the steps' text
        weights = self.weights
        if rollout.rewards is not None:  # an environment's episode rewards; a failed episode is unscored
            per_function[np.isnan(rollout.rewards)] = np.nan
            per_function, weights = np.column_stack([per_function, rollout.rewards]), [*weights, 1.0]
        rewards, valid = total_reward(per_function, weights)
        lengths = loss_mask.sum(1).astype(float)
        advantages, scale_std = self.advantage_fn(rewards, valid, lengths, G, cfg.scale_rewards)
        batch["advantages"] = self.trainer.global_batch({"advantages": np.asarray(advantages)[:, None]})["advantages"]
        with use_mesh(self.trainer.mesh):
            if self.cfg.beta != 0.0:
                reference = self.ref_params if self.cfg.lora is None else self.trainer._base_args()[0]
                batch["ref_logps"] = self.ref_logps(reference, batch)
            if cfg.num_iterations > 1 or self.off_policy:
                # The policy the updates start from (its log-probs before the first update moves it);
                # an off-policy rollout's own (behaviour) log-probs are corrected towards it.
                batch["old_logps"] = self.logps(self.trainer.model_params(state.params), batch)

        lengths = out.lengths.astype(float)
        values = {
            "reward": float(rewards[valid].mean()) if valid.any() else math.nan,
            "reward_std": nan_stats(np.where(valid, rewards, np.nan))[1],
            "frac_reward_zero_std": float(np.mean(np.isclose(scale_std, 0.0))),
            "reward_invalid": float((~valid).sum()),
            "completion_length": float(lengths.mean()),
            "completion_length_min": float(lengths.min()),
            "completion_length_max": float(lengths.max()),
            "completion_clipped_ratio": float(np.mean(~np.isin(out.tokens, [bundle.eos_id]).any(1))),
        }
        for j, name in enumerate(self.reward_names):
            values[f"reward/{name}/mean"], values[f"reward/{name}/std"] = nan_stats(per_function[:, j])
        if rollout.rewards is not None:
            values["reward/environment/mean"], values["reward/environment/std"] = nan_stats(rollout.rewards)
        values["router_replay"] = float(self.replay)
        values.update(rollout.metrics)
        return batch, values

    def get_state(self) -> dict:
        """The prompt stream as of the next batch to train on (batches the workers hold beyond
        it are generated again after a resume), and the identity of the records it counts in."""
        return {**self.stream_states.get(self.consumed, self.prompts.get_state()), "dataset": self.dataset}

    def set_state(self, state: dict) -> None:
        saved = state.get("dataset")
        if saved is not None and saved != self.dataset:
            raise ConfigError(
                f"data.path: {self.cfg.data.path} is not the prompt set this run's checkpoint was taken "
                f"over (records sha256 {self.dataset[:12]}, checkpoint's {saved[:12]}); resuming would skip or "
                "repeat prompts: restore that file, or train the new one in a new checkpoint.directory"
            )
        self.prompts.set_state(state)
        self.stream_states = {}

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None


# --------------------------------------------------------------------------- the run


def run_grpo(cfg: GRPOConfig, log: Callable[[str], None] | None = None, sampler_factory=None) -> dict[str, Any]:
    """Train `cfg.steps` rollout batches, resuming from checkpoint.directory if it has one.
    `sampler_factory(cfg, trainer, model_cfg, bundle)`: the sampler of `cfg.rollout`'s server
    (engine/posttrain/vllm_rollout.py, whose entry point passes it)."""
    log = log or log_to_stderr
    if cfg.algorithm == "gspo" and cfg.loss_type != "grpo":
        log(
            f"note: algorithm gspo with loss_type {cfg.loss_type}: the GSPO paper's objective is loss_type grpo "
            f"(a mean over sequences); {cfg.loss_type} weights each sequence by its length"
        )
    model_cfg, compute, bundle = finetune_start(cfg)
    trainer = Trainer(
        train_config(cfg, model_cfg, compute),
        lambda graphdef: policy_objective(make_loss_fn(graphdef, cfg, cfg.max_prompt_length), loss_tokens(cfg)),
        updates_per_batch=cfg.num_iterations,
    )
    source = RolloutSource(cfg, trainer, model_cfg, bundle, log)
    if cfg.rollout is not None:  # an inference server samples, holding the weights pushed to it
        if sampler_factory is None:
            raise ConfigError(ROLLOUT_ENTRY_POINT)
        source.sampler = sampler_factory(cfg, trainer, model_cfg, bundle)
    if cfg.rollout_workers:
        trainer.add_hook(source.weights_hook)  # before the checkpoint's: the workers start sooner
    try:
        final = run_training(
            trainer, source, log=log, meta={"stage": "grpo", "grpo_config": cfg.model_dump(mode="json")}
        )
        # The run's worst rollout/trainer gap, for a pipeline gate (rollout_correction.py).
        metrics_dir = trainer.cfg.metrics_dir or Path(str(trainer.cfg.checkpoint.directory)).parent
        final.update(divergence_summary(read_metrics(metrics_dir)))
        return final
    finally:  # also on SIGTERM (Preempted) and failures: no worker outlives its stage
        source.close()


def main(argv: list[str] | None = None) -> int:
    failures = (RewardError, RolloutWorkerError, EnvironmentFailure)
    return run_cli(argv, "engine.posttrain.grpo", GRPOConfig, run_grpo, failures=failures)


def batch_shapes(cfg: GRPOConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one GRPO update's batch: prompts x G rollouts."""
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


def step_spec(cfg: GRPOConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): the policy objective over one rollout batch, mu updates each."""
    model_cfg, compute = fine_tuned_model(cfg, models)
    batch = batch_shapes(cfg)
    if replays_routes(cfg, model_cfg):  # router replay: each token's experts at each layer
        rows, length = batch["tokens"].shape
        experts = (rows, model_cfg.num_layers, length, model_cfg.moe.experts_per_token)
        batch[ROUTER_EXPERTS] = jax.ShapeDtypeStruct(experts, np.int32)
    return StepSpec(
        train_config(cfg, model_cfg, compute),
        objective=lambda graphdef: policy_objective(make_loss_fn(graphdef, cfg, cfg.max_prompt_length)),
        batch=batch,
        updates_per_batch=cfg.num_iterations,
        uncounted=lambda plan: [
            "the plan is of its train step; rollout sampling and the KL reference's parameters are not counted"
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
