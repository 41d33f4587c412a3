"""Reward models on the shared trainer: preference pairs in, a scalar scorer out.

A Bradley-Terry reward model as TRL's RewardTrainer defines it: the decoder at
checkpoint.init_from plus a scalar head, `score_d` (d_model,), transformers' `score` Linear
(d_model -> 1, no bias) of *ForSequenceClassification. A sequence's reward is the head applied
to the final-normed hidden state at its last token (transformers pools at the last
non-padding token). Per pair, with TRL's optional per-pair margin m (a `margin` column,
0 where absent):

    loss = mean(-log sigmoid(r_chosen - r_rejected - m)) + c * mean((r_chosen + r_rejected)^2)

c is `center_rewards_coefficient` (None: no term). Metrics are TRL's: accuracy (the chosen
scored higher), margin (mean r_chosen - r_rejected), mean/min/max reward; per step and on the
held-out pairs.

The params are the decoder's tree with the head as one more top-level leaf:
`{embed_vd, blocks, final_norm, [lm_head_dv], score_d}`, trained, checkpointed and restored
as one tree (`RewardTrainer`). With LoRA the trained tree is the adapter plus `score_d` (the
head always trains; the decoder's weights stay frozen). The checkpoint meta has
`reward_model` (REWARD_MODEL_FORMAT, the head's name and init); `load_reward_params` reads a
reward model back (an adapter folded into its base), `RewardScorer` scores rows on a mesh
(GRPO's `rewards: [{model: ...}]`).

Data is DPO's (engine/posttrain/dpo.py): the same TRL formats, truncation and pair rows (a
pair per row, chosen as segment 1, rejected right after it as segment 2). `reward_rows`
takes `pair_rows(whole=True)`: every token of each sequence, its last included, and where
each ends, so the reward reads the whole sequence, eos included, as TRL's RewardTrainer
scores it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from engine.config import ConfigError
from engine.contract import TOKENIZER_DIR
from engine.data.tokenizer import TokenizerBundle, load_saved
from engine.data.urls import existing_folder
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import LORA_SEED, dropout_rows
from engine.models.params import abstract_model_params, graphdef_of, init_params
from engine.ops.partitioning import logical_to_spec, use_mesh
from engine.parallel.mesh import global_array, replicated, to_host
from engine.posttrain.dpo import EpochIndices, Pair, load_pairs, pair_rows, tokenize_pair
from engine.posttrain.finetune import finetune_start
from engine.posttrain.process_reward import METRICS as PROCESS_METRICS
from engine.posttrain.process_reward import (
    StepBatches,
    StepScorer,
    load_step_examples,
    process_objective,
    step_rows,
)
from engine.posttrain.reward_config import RewardModelConfig
from engine.train.bucket_paths import checkpoint_path
from engine.train.cli import run_cli
from engine.train.config import TrainConfig, trainer_view
from engine.train.hooks import log_to_stderr, run_training
from engine.train.plan import InputModels, StepSpec, fine_tuned_model
from engine.train.reward_checkpoint import (
    HEAD,
    LABELS,
    PROCESS_HEAD,
    REWARD_MODEL_FORMAT,
    decoder_of,
    load_reward_params,
)
from engine.train.step import Objective, moe_metrics
from engine.train.trainer import Trainer, TrainState

METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")
EXTREMES = ("min_reward", "max_reward")


def train_config(cfg: RewardModelConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """The trainer's view: rows of 2 x max_length tokens, one pair each."""
    if cfg.data.max_length > model_cfg.max_seq_len:
        raise ConfigError(
            f"data.max_length ({cfg.data.max_length}) exceeds the model's max_seq_len ({model_cfg.max_seq_len})"
        )
    width = cfg.data.max_length if cfg.process is not None else 2 * cfg.data.max_length  # a PRM: one sequence a row
    rows = {"seq_len": width, "batch_size": cfg.data.batch_size, "seed": cfg.data.seed}
    return trainer_view(cfg, model_cfg, compute, rows, stage="reward_model")


# --------------------------------------------------------------------------- pairs and rows


@dataclass
class RewardPair(Pair):
    margin: float = 0.0
    """TRL's optional per-pair margin: the loss asks r_chosen - r_rejected to exceed it."""


def reward_pair(record: dict, where: str, bundle: TokenizerBundle, data) -> RewardPair:
    """dpo.tokenize_pair's pair with its `margin` (0 where the record has none)."""
    pair = tokenize_pair(record, where, bundle, data)
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ConfigError(f"{where}: 'margin' must be a finite number, got {margin!r}")
    return RewardPair(pair.prompt, pair.chosen, pair.rejected, float(margin))


def load_reward_pairs(data, bundle: TokenizerBundle, log: Callable[[str], None]) -> tuple[list, list]:
    """(train, held-out) pairs as dpo.load_pairs makes them (identical pairs counted and left
    out; the held-out split), each with its `margin`."""
    return load_pairs(data, bundle, log, make_pair=reward_pair, stage="reward_model")


def reward_rows(pairs: list[RewardPair], max_length: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """pair_rows(whole=True)'s tokens, positions and segment_ids (every token of each sequence,
    its last included) and `last_bk` (rows, 2): where each sequence ends (its reward is read
    there); `margin` and `pair_mask` (rows, 1). `rows` pads with empty rows (pair_mask 0)."""
    full = pair_rows(pairs, max_length, whole=True)
    out = {k: full[k] for k in ("tokens", "positions", "segment_ids", "last_bk")}
    out["margin"] = np.asarray([[p.margin] for p in pairs], np.float32).reshape(-1, 1)
    out["pair_mask"] = np.ones((len(pairs), 1), np.float32)
    if rows is not None and rows > len(pairs):
        out = {k: np.concatenate([v, np.zeros((rows - len(pairs), *v.shape[1:]), v.dtype)]) for k, v in out.items()}
    return out


# --------------------------------------------------------------------------- scores and the loss


def hidden_and_aux(graphdef, params, tokens_bt, positions_bt, segment_ids_bt):
    """(final-normed hidden states (b, t, d), MoE aux) of the reward model's decoder."""
    return nnx.merge(graphdef, decoder_of(params)).hidden_states(tokens_bt, positions_bt, segment_ids_bt)


def score_at(hidden_btd, score_d, index_bk):
    """(b, k) float32 rewards: the head applied to the hidden states at `index_bk`."""
    picked_bkd = jnp.take_along_axis(hidden_btd, index_bk[..., None], axis=1)
    return jnp.einsum("bkd,d->bk", picked_bkd.astype(jnp.float32), score_d.astype(jnp.float32))


def last_token(segment_ids_bt):
    """(b, 1) the index of each row's last non-padding (segment != 0) token, right or left padded."""
    t = segment_ids_bt.shape[1]
    return (t - 1 - jnp.argmax(jnp.flip(segment_ids_bt != 0, axis=1), axis=1))[:, None].astype(jnp.int32)


def sequence_scores(graphdef, params, tokens_bt, positions_bt, segment_ids_bt):
    """(b,) float32: each row's reward, read at its last non-padding token (a row is one sequence)."""
    hidden, _ = hidden_and_aux(graphdef, params, tokens_bt, positions_bt, segment_ids_bt)
    return score_at(hidden, params[HEAD], last_token(segment_ids_bt))[:, 0]


def pair_count(batch) -> jax.Array:
    """The normaliser: the batch's pairs (at least 1)."""
    return jnp.maximum(jnp.sum(batch["pair_mask"]), 1.0)


def pair_losses(chosen, rejected, margin, center_rewards_coefficient: float | None):
    """TRL RewardTrainer.compute_loss's terms per pair: -log sigmoid(r_c - r_r - m), plus
    c * (r_c + r_r)^2, whose means over the batch are its loss."""
    losses = -jax.nn.log_sigmoid(chosen - rejected - margin)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * jnp.square(chosen + rejected)
    return losses


def make_loss_fn(graphdef, cfg: RewardModelConfig):
    """loss_fn(params, batch, pairs) -> (loss, metrics): sums over the micro-batch's pairs /
    the batch's pairs (min/max rewards over its pairs), so micro-batches add up to the batch."""

    def loss_fn(params, batch, pairs):
        with dropout_rows(batch.get(LORA_SEED)):  # a LoRA adapter's dropout, in training steps only
            hidden, moe = hidden_and_aux(graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        rewards_bk = score_at(hidden, params[HEAD], batch["last_bk"])
        chosen, rejected = rewards_bk[:, 0], rewards_bk[:, 1]
        valid = batch["pair_mask"][:, 0]
        loss = (
            jnp.sum(pair_losses(chosen, rejected, batch["margin"][:, 0], cfg.center_rewards_coefficient) * valid)
            / pairs
        )
        share = lambda x: jnp.sum(jax.lax.stop_gradient(x) * valid) / pairs  # noqa: E731
        seen = valid[:, None] > 0
        metrics = {
            "loss": loss,
            "pairs": jnp.sum(valid),
            "accuracy": share((chosen > rejected).astype(jnp.float32)),
            "margin": share(chosen - rejected),
            "mean_reward": share((chosen + rejected) / 2),
            "rewards/chosen": share(chosen),
            "rewards/rejected": share(rejected),
            "min_reward": jnp.min(jnp.where(seen, rewards_bk, jnp.inf)),
            "max_reward": jnp.max(jnp.where(seen, rewards_bk, -jnp.inf)),
        }
        if moe:  # a mixture of experts keeps its router losses, weighted by this micro-batch's share
            part = jnp.sum(valid) / pairs
            loss = loss + part * moe["aux_loss"]
            metrics.update(moe_metrics(moe, part))
        return loss, metrics

    return loss_fn


def reward_objective(graphdef, cfg: RewardModelConfig) -> Objective:
    return Objective(make_loss_fn(graphdef, cfg), pair_count, reduce={"min_reward": "min", "max_reward": "max"})


# --------------------------------------------------------------------------- the trainer with a head


def head_abstract(model_cfg: ModelConfig, dtype, mesh, process: bool = False) -> jax.ShapeDtypeStruct:
    """The head's shape, dtype and sharding (the `embed` axis, as the embeddings' columns): a
    PRM's token classifier is (d_model, 2)."""
    if process:
        spec = logical_to_spec(("embed", None), mesh=mesh)
        return jax.ShapeDtypeStruct((model_cfg.d_model, LABELS), dtype, sharding=NamedSharding(mesh, spec))
    return jax.ShapeDtypeStruct(
        (model_cfg.d_model,), dtype, sharding=NamedSharding(mesh, logical_to_spec(("embed",), mesh=mesh))
    )


class RewardTrainer(Trainer):
    """The shared trainer whose trained params are the decoder's (or, with LoRA, the
    adapter's) plus the head: the optimizer, its state's shardings, the train step and the
    checkpoints all cover `score_d`. The head starts as `head_init` says (transformers'
    N(0, initializer_range^2) with std model.init_std, or zero); the decoder from
    checkpoint.init_from (with LoRA: the frozen base and a fresh adapter)."""

    def __init__(self, cfg: TrainConfig, objective, head_init: str, *, devices=None, process: bool = False):
        self.head_init, self.head = head_init, PROCESS_HEAD if process else HEAD
        super().__init__(cfg, objective, devices=devices)

    def extra_trainable_params(self) -> dict[str, jax.ShapeDtypeStruct]:
        dtype = jax.tree.leaves(self.abstract_params)[0].dtype
        return {self.head: head_abstract(self.cfg.model, dtype, self.mesh, process=self.head == PROCESS_HEAD)}

    def init_head(self) -> jax.Array:
        want = self.abstract_params[self.head]
        std = 0.0 if self.head_init == "zero" else self.cfg.model.init_std
        init = lambda: (std * jax.random.normal(jax.random.key(self.cfg.seed), want.shape)).astype(want.dtype)  # noqa: E731
        with use_mesh(self.mesh):
            return jax.jit(init, out_shardings=want.sharding)()

    def init_state(self) -> TrainState:
        cfg = self.cfg
        if not cfg.checkpoint.init_from:
            raise ConfigError("checkpoint.init_from is required: the decoder the reward model starts from")
        if cfg.lora is not None:
            self._base_args()
            decoder = init_params(cfg.model, cfg.compute, self.mesh, cfg.seed, cfg.lora, adapter_only=True)
        else:
            decoder = self._load_init_from(decoder_of(self.abstract_params))
        params = {**decoder, self.head: self.init_head()}
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return TrainState(0, params, opt_state)


class RewardPairBatches:
    """The trainer's batch source: endless batches of reward rows over epochs, reshuffled
    each epoch; its state is (epoch, index)."""

    def __init__(self, pairs: list[RewardPair], cfg: RewardModelConfig, trainer: Trainer):
        self.pairs, self.cfg, self.trainer = pairs, cfg, trainer
        self.indices = EpochIndices(len(pairs), cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)

    def next_batch(self, state: TrainState):
        rows = reward_rows([self.pairs[i] for i in self.indices.take()], self.cfg.data.max_length)
        return self.trainer.global_batch(rows), {}

    def get_state(self) -> dict:
        return self.indices.get_state()

    def set_state(self, state: dict) -> None:
        self.indices.set_state(state)


def tokenizer_fingerprint(bundle: TokenizerBundle) -> dict:
    """What makes two tokenizers the same: the model (vocabulary, merges), added tokens,
    normalizer and pre-tokenizer, and the special tokens."""
    tree = json.loads(bundle.tokenizer.to_str())
    return {
        **{k: tree.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")},
        "special": (bundle.bos_token, bundle.eos_token, bundle.pad_token),
    }


class RewardScorer:
    """A reward model on a mesh: `scorer(batch)` -> (rows,) float64 rewards of the rows of a
    global batch (tokens, positions, segment_ids; segment 0 is padding, left or right), each
    read at its last non-padding token. Jitted once per batch shape."""

    def __init__(
        self,
        directory: str | Path,
        mesh,
        rows_sharding,
        *,
        policy_tokenizer: TokenizerBundle,
        max_length: int,
        where: str = "rewards.model",
    ):
        directory = checkpoint_path(directory)
        tokenizer = existing_folder(str(directory.parent / TOKENIZER_DIR))  # a bucket's: cached here
        if tokenizer is None or not any(tokenizer.iterdir()):
            raise ConfigError(
                f"{where}: no {TOKENIZER_DIR}/ beside the reward model {directory}; its tokenizer must be the policy's"
            )
        if tokenizer_fingerprint(load_saved(tokenizer)) != tokenizer_fingerprint(policy_tokenizer):
            raise ConfigError(
                f"{where}: the reward model {directory} was trained with another tokenizer than the "
                "policy's; a reward model must share the policy's tokenizer"
            )
        model_cfg, compute, host, _, meta = load_reward_params(directory, allow_process=True)
        if max_length > model_cfg.max_seq_len:
            raise ConfigError(
                f"{where}: prompt + completion ({max_length} tokens) exceeds the reward model's "
                f"max_seq_len ({model_cfg.max_seq_len})"
            )
        process = meta["reward_model"].get("process")
        head = PROCESS_HEAD if process is not None else HEAD
        abstract = {
            **abstract_model_params(model_cfg, compute, mesh),
            head: head_abstract(model_cfg, host[head].dtype, mesh, process=process is not None),
        }
        self.mesh = mesh
        self.params = jax.tree.map(
            lambda a, want: global_array(np.asarray(a, want.dtype), want.sharding), host, abstract
        )
        graphdef = graphdef_of(model_cfg, compute)
        shardings = jax.tree.map(lambda a: a.sharding, abstract)
        self.steps = None
        if process is not None:  # a PRM: the completion's steps re-tokenized, read per step
            width = min(model_cfg.max_seq_len, 2 * max_length)  # room for the separators added
            self.steps = StepScorer(
                graphdef, self.params, shardings, mesh, rows_sharding, policy_tokenizer, process, width, hidden_and_aux
            )
            return
        fn = lambda p, b: sequence_scores(graphdef, p, b["tokens"], b["positions"], b["segment_ids"])  # noqa: E731
        self._fn = jax.jit(fn, in_shardings=(shardings, rows_sharding), out_shardings=replicated(mesh))

    def __call__(self, batch: dict[str, jax.Array], completions: list[str] | None = None) -> np.ndarray:
        """Each row's reward; a process reward model also reads the completions' text."""
        if self.steps is not None:
            assert completions is not None, "a process reward model scores the completions' text"
            return self.steps(batch, completions)
        rows = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
        with use_mesh(self.mesh):
            return to_host(self._fn(self.params, rows)).astype(np.float64)  # every process: all rows


# --------------------------------------------------------------------------- the run


def run_reward_model(cfg: RewardModelConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `cfg.steps` batches of pairs, resuming from checkpoint.directory if it has one."""
    log = log or log_to_stderr
    if cfg.process is not None:
        return run_process_reward_model(cfg, log)
    model_cfg, compute, bundle = finetune_start(cfg)
    train_pairs, held_out = load_reward_pairs(cfg.data, bundle, log)
    log(
        f"reward_model: {len(train_pairs)} training and {len(held_out)} held-out pairs, head {cfg.head_init}"
        + (
            f", center_rewards_coefficient {cfg.center_rewards_coefficient}"
            if cfg.center_rewards_coefficient is not None
            else ""
        )
    )
    trainer = RewardTrainer(
        train_config(cfg, model_cfg, compute), lambda graphdef: reward_objective(graphdef, cfg), cfg.head_init
    )
    source = RewardPairBatches(train_pairs, cfg, trainer)
    rows_per_batch = cfg.data.batch_size // cfg.grad_accum
    evaluate = None
    if held_out:

        def evaluate(params) -> dict[str, float]:
            sums: dict[str, float] = {}
            low, high = math.inf, -math.inf
            batches = math.ceil(len(held_out) / rows_per_batch)
            if cfg.data.eval_batches:
                batches = min(batches, cfg.data.eval_batches)
            for b in range(batches):
                chunk = held_out[b * rows_per_batch : (b + 1) * rows_per_batch]
                aux = trainer.eval_step(
                    params, trainer.global_batch(reward_rows(chunk, cfg.data.max_length, rows_per_batch))
                )
                for key in ("loss", "pairs", *METRICS):
                    sums[key] = sums.get(key, 0.0) + float(aux[key])
                low, high = min(low, float(aux["min_reward"])), max(high, float(aux["max_reward"]))
            pairs = max(sums["pairs"], 1.0)
            return {
                "eval_loss": sums["loss"] / pairs,
                **{f"eval_{k}": sums[k] / pairs for k in METRICS},
                "eval_min_reward": low,
                "eval_max_reward": high,
                "eval_pairs": sums["pairs"],
            }

    meta = {
        "stage": "reward_model",
        "reward_model_config": cfg.model_dump(mode="json"),
        "reward_model": {
            "format": REWARD_MODEL_FORMAT,
            "head": HEAD,
            "head_init": cfg.head_init,
            "pooling": "last_token",
        },
    }
    result = run_training(
        trainer, source, log=log, evaluate=evaluate, meta=meta, logged=("loss", "grad_norm", *METRICS, *EXTREMES)
    )
    result.update({"train_pairs": len(train_pairs), "eval_pairs": len(held_out)})
    return result


def run_process_reward_model(cfg: RewardModelConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """A process reward model (engine/posttrain/process_reward.py) on the reward-model trainer."""
    assert cfg.process is not None
    model_cfg, compute, bundle = finetune_start(cfg)
    train_examples, held_out = load_step_examples(cfg, bundle, log)
    log(f"reward_model: process reward model, {len(train_examples)} training and {len(held_out)} held-out examples")
    trainer = RewardTrainer(
        train_config(cfg, model_cfg, compute),
        lambda graphdef: process_objective(graphdef, hidden_and_aux),
        cfg.head_init,
        process=True,
    )
    rows_per_batch = cfg.data.batch_size // cfg.grad_accum
    evaluate = None
    if held_out:

        def evaluate(params) -> dict[str, float]:
            sums = {"loss": 0.0, "steps": 0.0, "accuracy": 0.0}
            batches = math.ceil(len(held_out) / rows_per_batch)
            if cfg.data.eval_batches:
                batches = min(batches, cfg.data.eval_batches)
            for b in range(batches):
                chunk = held_out[b * rows_per_batch : (b + 1) * rows_per_batch]
                batch = trainer.global_batch(step_rows(chunk, cfg.data.max_length, rows_per_batch))
                aux = trainer.eval_step(params, batch)
                for key in sums:
                    sums[key] += float(aux[key])
            steps = max(sums["steps"], 1.0)
            return {"eval_loss": sums["loss"] / steps, "eval_accuracy": sums["accuracy"] / steps, "eval_steps": steps}

    meta = {
        "stage": "reward_model",
        "reward_model_config": cfg.model_dump(mode="json"),
        "reward_model": {
            "format": REWARD_MODEL_FORMAT,
            "head": PROCESS_HEAD,
            "head_init": cfg.head_init,
            "pooling": "step_ends",
            "process": cfg.process.model_dump(mode="json"),
        },
    }
    result = run_training(
        trainer,
        StepBatches(train_examples, cfg, trainer),
        log=log,
        evaluate=evaluate,
        meta=meta,
        logged=("loss", "grad_norm", *PROCESS_METRICS),
    )
    result.update({"train_examples": len(train_examples), "eval_examples": len(held_out)})
    return result


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.posttrain.reward_model", RewardModelConfig, run_reward_model)


def batch_shapes(cfg: RewardModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one reward-model batch: a row per pair, where each sequence ends, margins
    (a PRM: a row per example, its step labels)."""
    if cfg.process is not None:
        shape = (cfg.data.batch_size, cfg.data.max_length)
        names = ("tokens", "positions", "segment_ids", "step_labels")
        return {k: jax.ShapeDtypeStruct(shape, np.int32) for k in names}
    rows, width = cfg.data.batch_size, 2 * cfg.data.max_length
    batch = {k: jax.ShapeDtypeStruct((rows, width), np.int32) for k in ("tokens", "positions", "segment_ids")}
    batch["last_bk"] = jax.ShapeDtypeStruct((rows, 2), np.int32)
    batch.update(
        margin=jax.ShapeDtypeStruct((rows, 1), np.float32), pair_mask=jax.ShapeDtypeStruct((rows, 1), np.float32)
    )
    return batch


def step_spec(cfg: RewardModelConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): the Bradley-Terry loss, the head trained beside the decoder."""
    process = cfg.process is not None
    return StepSpec(
        train_config(cfg, *fine_tuned_model(cfg, models)),
        objective=lambda graphdef: (
            process_objective(graphdef, hidden_and_aux) if process else reward_objective(graphdef, cfg)
        ),
        batch=batch_shapes(cfg),
        make_trainer=lambda train_cfg, objective, devices: RewardTrainer(
            train_cfg, objective, cfg.head_init, devices=devices, process=process
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
