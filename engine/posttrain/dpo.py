"""DPO and its variants on the shared trainer: preference pairs in, a policy out.

Data is JSONL in TRL's preference formats (engine/posttrain/config.py: DPODataConfig). A
pair becomes one row: prompt + chosen as segment 1, then at once prompt + rejected as
segment 2 (padding-free within the row: attention never crosses them, positions restart;
the row's tail is padding), so a micro-batch always holds whole pairs and the row shards
like any other. A prompt longer than max_prompt_length keeps its last
tokens; a completion is cut to what max_length leaves it; eos closes text completions.

The loss (engine/posttrain/preference_loss.py, TRL's definitions) compares the policy's
summed completion log-probabilities with the reference's. The reference is frozen: another
checkpoint where `reference.checkpoint` names one (TRL's `ref_model`: any architecture of
the policy's vocabulary, sharded on the policy's mesh by its own logical axes), else the
start checkpoint: with LoRA the base with the adapter off (no copy of the weights),
otherwise a second copy of the start params. `precompute_ref` computes its log-probs for
every pair once up front and keeps no reference during training. Its log-probs join each
batch (`ref_logps`: (pairs, 2), chosen then rejected), computed by the batch source, as
GRPO's reference is. Metrics are TRL's: rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected, per step and on the held-out pairs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import ConfigError
from engine.data.chat import render
from engine.data.tokenizer import TokenizerBundle
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import LORA_SEED, dropout_rows
from engine.models.params import abstract_model_params, apply_model_with_aux, graphdef_of
from engine.ops.cross_entropy import log_z_and_target
from engine.ops.partitioning import use_mesh
from engine.posttrain.config import DPOConfig, DPODataConfig
from engine.posttrain.finetune import finetune_start, frozen_model_of_same_vocab, read_jsonl
from engine.posttrain.preference_loss import per_pair_loss, preference_rewards
from engine.train.checkpoint import load_params
from engine.train.cli import run_cli
from engine.train.config import TrainConfig, trainer_view
from engine.train.hooks import log_to_stderr, run_training
from engine.train.plan import InputModels, StepSpec, fine_tuned_model, frozen_params_gib
from engine.train.step import Objective, moe_metrics
from engine.train.trainer import Trainer, TrainState

CHOSEN, REJECTED = 1, 2  # the segment ids of a row's two sequences
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logps/accuracies",
    "ref_logps/accuracies",
)
"""TRL's metrics, plus how often the policy (logps/) and the reference (ref_logps/) give the
chosen completion the higher log-probability: a preference accuracy that needs no reference,
whose ref_ value is the reference's."""


def train_config(cfg: DPOConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """The trainer's view: rows of 2 x max_length tokens, one pair each."""
    seq_len = 2 * cfg.data.max_length
    if cfg.data.max_length > model_cfg.max_seq_len:
        raise ConfigError(
            f"data.max_length ({cfg.data.max_length}) exceeds the model's max_seq_len ({model_cfg.max_seq_len})"
        )
    rows = {"seq_len": seq_len, "batch_size": cfg.data.batch_size, "seed": cfg.data.seed}
    return trainer_view(cfg, model_cfg, compute, rows, stage="dpo")


# --------------------------------------------------------------------------- pairs


@dataclass
class Pair:
    prompt: np.ndarray  # (n,) int32, special tokens included
    chosen: np.ndarray  # completion tokens
    rejected: np.ndarray


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _encode_completion(bundle, prompt, completion, where: str, field: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a text or conversational prompt/completion."""
    if isinstance(prompt, list) != isinstance(completion, list):
        raise ConfigError(f"{where}: prompt and {field} must both be text or both be message lists")
    if isinstance(prompt, list):
        before = render(bundle, prompt, add_generation_prompt=True)
        text = render(bundle, prompt + completion)
        if not text.startswith(before):
            raise ConfigError(f"{where}: the chat template does not render the prompt as a prefix of the conversation")
        prompt_ids = bundle.tokenizer.encode(before, add_special_tokens=False).ids
        return list(prompt_ids), list(bundle.tokenizer.encode(text[len(before) :], add_special_tokens=False).ids)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(f"{where}: prompt and {field} must be strings or message lists")
    prompt_ids = bundle.tokenizer.encode(prompt, add_special_tokens=True).ids
    return list(prompt_ids), list(bundle.tokenizer.encode(completion, add_special_tokens=False).ids) + [bundle.eos_id]


def tokenize_pair(record: dict, where: str, bundle, data: DPODataConfig) -> Pair:
    for field in (data.chosen_field, data.rejected_field):
        if field not in record:
            raise ConfigError(f"{where}: no '{field}' key (the record has: {', '.join(record) or 'nothing'})")
    chosen, rejected = record[data.chosen_field], record[data.rejected_field]
    if data.prompt_field in record:
        prompt = record[data.prompt_field]
    elif isinstance(chosen, list) and isinstance(rejected, list):  # implicit prompt: the shared messages
        shared = _common_prefix(chosen, rejected)
        if shared == 0:
            raise ConfigError(
                f"{where}: no '{data.prompt_field}' key, and {data.chosen_field} and "
                f"{data.rejected_field} share no leading message to take as the prompt"
            )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        raise ConfigError(f"{where}: no '{data.prompt_field}' key (an implicit prompt needs message lists)")
    prompt_ids, chosen_ids = _encode_completion(bundle, prompt, chosen, where, data.chosen_field)
    _, rejected_ids = _encode_completion(bundle, prompt, rejected, where, data.rejected_field)
    prompt_ids = prompt_ids[-data.max_prompt_length :]  # keep the prompt's end
    room = data.max_length - len(prompt_ids)
    return Pair(
        np.asarray(prompt_ids, np.int32),
        np.asarray(chosen_ids[:room], np.int32),
        np.asarray(rejected_ids[:room], np.int32),
    )


def load_pairs(
    data: DPODataConfig, bundle, log: Callable[[str], None], *, make_pair: Callable = tokenize_pair, stage: str = "dpo"
) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out) pairs, tokenized by `make_pair(record, where, bundle, data)`; pairs
    whose chosen and rejected are the same are counted, reported and left out (they carry no
    preference)."""
    if not data.path:
        raise ConfigError("data.path is required: a JSONL file of preference pairs")

    def read(path: str) -> list[Pair]:
        pairs, same = [], []
        for where, record in read_jsonl(path):
            pair = make_pair(record, where, bundle, data)
            if np.array_equal(pair.chosen, pair.rejected):
                same.append(where)
            else:
                pairs.append(pair)
        if same:
            log(
                f"{stage}: {len(same)} pair(s) of {path} have identical chosen and rejected completions and are "
                f"left out (first: {same[0]})"
            )
        return pairs

    pairs = read(data.path)
    if data.eval_path:
        held_out = read(data.eval_path)
    else:
        n_eval = int(round(len(pairs) * data.eval_fraction))
        pairs, held_out = pairs[: len(pairs) - n_eval], pairs[len(pairs) - n_eval :]
    if not pairs:
        raise ConfigError(f"data.path: {data.path} has no preference pair to train on")
    return pairs, held_out


def pair_rows(pairs: Sequence[Pair], max_length: int, *, whole: bool = False) -> dict[str, np.ndarray]:
    """One row per pair, padding-free within it: prompt + chosen as segment 1, then at once
    prompt + rejected as segment 2, the rest of the 2 x max_length row padding (segment 0).
    tokens, targets, positions, segment_ids, loss_mask (pairs, 2 x max_length).

    A sequence of n tokens takes its first n - 1 as inputs of next-token targets; `whole`
    takes all n (a reward model reads each sequence's last token) and adds `last_bk`
    (pairs, 2): where each sequence ends."""
    n, width = len(pairs), 2 * max_length
    out = {k: np.zeros((n, width), np.int32) for k in ("tokens", "targets", "positions", "segment_ids")}
    out["loss_mask"] = np.zeros((n, width), np.float32)
    if whole:
        out["last_bk"] = np.zeros((n, 2), np.int32)
    for r, pair in enumerate(pairs):
        at = 0
        for k, (segment, completion) in enumerate(((CHOSEN, pair.chosen), (REJECTED, pair.rejected))):
            ids = np.concatenate([pair.prompt, completion])
            m = len(ids) if whole else len(ids) - 1
            out["tokens"][r, at : at + m] = ids[:m]
            out["targets"][r, at : at + len(ids) - 1] = ids[1:]
            out["positions"][r, at : at + m] = np.arange(m)
            out["segment_ids"][r, at : at + m] = segment
            out["loss_mask"][r, at + len(pair.prompt) - 1 : at + len(ids) - 1] = 1.0  # the completion's targets
            if whole:
                out["last_bk"][r, k] = at + m - 1
            at += m
    return out


# --------------------------------------------------------------------------- log-probs and the loss


def sequence_logps(logits_btv, batch):
    """(log p of the chosen completion, of the rejected, their token counts, chosen-token NLL
    sum), each (pairs,): summed over the completion tokens of each segment."""
    log_z, target = log_z_and_target(logits_btv, batch["targets"])
    logp_bt = (target - log_z) * batch["loss_mask"]
    chosen_bt, rejected_bt = batch["segment_ids"] == CHOSEN, batch["segment_ids"] == REJECTED
    mask = batch["loss_mask"]
    return (
        jnp.sum(logp_bt * chosen_bt, 1),
        jnp.sum(logp_bt * rejected_bt, 1),
        jnp.sum(mask * chosen_bt, 1),
        jnp.sum(mask * rejected_bt, 1),
    )


def make_logps_fn(graphdef):
    """logps(params, batch) -> (pairs, 2): the summed completion log-probs, chosen then rejected."""

    def logps(params, batch):
        logits, _ = apply_model_with_aux(graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        chosen, rejected, _, _ = sequence_logps(logits, batch)
        return jnp.stack([chosen, rejected], axis=1)

    return logps


def pairs_and_chosen_tokens(batch):
    """The normalisers of a batch: its pairs (rows with a chosen completion), chosen completion
    tokens, and chosen sequence tokens (prompt too: ORPO's NLL)."""
    chosen_bt = batch["segment_ids"] == CHOSEN
    chosen = batch["loss_mask"] * chosen_bt
    pairs = jnp.maximum(jnp.sum(jnp.any(chosen > 0, axis=1)), 1.0)
    return pairs, jnp.maximum(jnp.sum(chosen), 1.0), jnp.maximum(jnp.sum(chosen_bt), 1.0)


def weighted_loss(cfg: DPOConfig, inputs: tuple, valid, normaliser: tuple) -> tuple[jax.Array, jax.Array]:
    """(loss, pair loss) of cfg.loss_type's terms: sum_k weight_k x the mean over the batch's
    pairs of term k, the `sft` term (or rpo_alpha) the NLL per chosen completion token of the
    batch. `inputs`: per_pair_loss's six (pairs,) arrays; normaliser: (pairs, chosen tokens)."""
    pairs, chosen_tokens_total = normaliser
    pair_loss = jnp.zeros((), inputs[0].dtype)
    for loss_type, weight in cfg.weighted_losses:
        if loss_type == "sft":
            continue
        losses = per_pair_loss(
            loss_type,
            *inputs,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            simpo_gamma=cfg.simpo_gamma,
            discopop_tau=cfg.discopop_tau,
            valid=valid,
        )
        pair_loss = pair_loss + weight * jnp.sum(losses) / pairs
    sft_weight = dict(cfg.weighted_losses).get("sft", 0.0) + (cfg.rpo_alpha or 0.0)
    if not sft_weight:
        return pair_loss, pair_loss
    nll_sum = -jnp.sum(inputs[0] * valid)  # TRL's `sft` term (RPO)
    return pair_loss + sft_weight * nll_sum / chosen_tokens_total, pair_loss


def make_loss_fn(graphdef, cfg: DPOConfig):
    """loss_fn(params, batch, (pairs, chosen tokens, chosen sequence tokens)) -> (loss, metrics):
    each metric a sum over the micro-batch / the batch's pairs, so micro-batches add up to the
    batch's means. The loss is weighted_loss's, plus ORPO's NLL for loss_type orpo."""
    orpo = "orpo" in cfg.loss_types
    reward_type = cfg.loss_types[0]

    def loss_fn(params, batch, normaliser):
        if isinstance(normaliser, tuple):
            pairs, chosen_tokens_total, chosen_sequence_tokens = normaliser
        else:
            pairs = chosen_tokens_total = chosen_sequence_tokens = normaliser
        with dropout_rows(batch.get(LORA_SEED)):  # a LoRA adapter's dropout, in training steps only
            logits, moe = apply_model_with_aux(
                graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
            )
        chosen, rejected, chosen_tokens, rejected_tokens = sequence_logps(logits, batch)
        valid = (chosen_tokens > 0).astype(jnp.float32)
        ref = batch.get("ref_logps")
        ref_chosen, ref_rejected = (0.0, 0.0) if ref is None else (ref[:, 0], ref[:, 1])
        inputs = (chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
        loss, pair_loss = weighted_loss(cfg, inputs, valid, (pairs, chosen_tokens_total))
        nll_sum = -jnp.sum(chosen * valid)
        chosen_sequence_nll = chosen_sequence_nll_sum(logits, batch) if orpo else jnp.zeros(())
        if orpo:  # ORPO's NLL: every token of the chosen sequences, prompt included (trl's ORPOTrainer)
            loss = loss + chosen_sequence_nll / chosen_sequence_tokens
        reward_chosen, reward_rejected = preference_rewards(reward_type, *inputs, cfg.beta)
        share = lambda x: jnp.sum(x * valid) / pairs  # noqa: E731
        metrics = {
            "loss": loss,
            "pair_loss": pair_loss,
            "pairs": jnp.sum(valid),
            "chosen_nll_sum": jax.lax.stop_gradient(nll_sum),
            "chosen_tokens": jnp.sum(chosen_tokens * valid),
            "chosen_sequence_nll_sum": jax.lax.stop_gradient(chosen_sequence_nll),
            "chosen_sequence_tokens": jnp.sum(batch["segment_ids"] == CHOSEN).astype(jnp.float32),
            "rewards/chosen": share(reward_chosen),
            "rewards/rejected": share(reward_rejected),
            "rewards/margins": share(reward_chosen - reward_rejected),
            "rewards/accuracies": share((reward_chosen > reward_rejected).astype(jnp.float32)),
            "logps/chosen": share(jax.lax.stop_gradient(chosen)),
            "logps/rejected": share(jax.lax.stop_gradient(rejected)),
            "logps/accuracies": share((chosen > rejected).astype(jnp.float32)),
            "ref_logps/accuracies": share((ref_chosen > ref_rejected) * jnp.ones_like(chosen)),
        }
        if moe:  # a mixture of experts keeps its router losses, weighted by this micro-batch's share
            part = jnp.sum(valid) / pairs
            loss = loss + part * moe["aux_loss"]
            metrics.update(moe_metrics(moe, part))
        return loss, metrics

    return loss_fn


def chosen_sequence_nll_sum(logits_btv, batch):
    """The NLL summed over every target of the chosen sequences, prompt tokens included."""
    log_z, target = log_z_and_target(logits_btv, batch["targets"])
    return jnp.sum((log_z - target) * (batch["segment_ids"] == CHOSEN))


HELD_OUT_SUMS = (
    "pair_loss",
    "pairs",
    "chosen_nll_sum",
    "chosen_tokens",
    "chosen_sequence_nll_sum",
    "chosen_sequence_tokens",
    *METRICS,
)
"""What the held-out evaluation adds up over its batches (the loss's aux with normaliser 1)."""


def held_out_metrics(sums: dict[str, float], cfg: DPOConfig) -> dict[str, float]:
    """eval_ metrics from batch sums: the training loss's definition over all held-out pairs
    (their weighted pair losses, plus the sft / rpo_alpha weight x the NLL per chosen completion
    token, plus ORPO's NLL per chosen sequence token), and the metrics' means over pairs."""
    pairs = max(sums["pairs"], 1.0)
    sft_weight = dict(cfg.weighted_losses).get("sft", 0.0) + (cfg.rpo_alpha or 0.0)
    loss = sums["pair_loss"] / pairs + sft_weight * sums["chosen_nll_sum"] / max(sums["chosen_tokens"], 1.0)
    if "orpo" in cfg.loss_types:
        loss += sums["chosen_sequence_nll_sum"] / max(sums["chosen_sequence_tokens"], 1.0)
    return {"eval_loss": loss, **{f"eval_{k}": sums[k] / pairs for k in METRICS}, "eval_pairs": sums["pairs"]}


def dpo_objective(graphdef, cfg: DPOConfig) -> Objective:
    return Objective(make_loss_fn(graphdef, cfg), pairs_and_chosen_tokens)


# --------------------------------------------------------------------------- the reference and the batches


def reference_model(cfg: DPOConfig, policy: ModelConfig, bundle: TokenizerBundle) -> tuple[ModelConfig, ComputeConfig]:
    """reference.checkpoint's architecture and compute settings, once it is known to score the
    policy's token ids (the same vocab_size, and the same tokens and ids where a tokenizer/ is
    beside it); else one sentence."""
    path = cfg.reference.checkpoint
    assert path
    model_cfg, stored_compute = frozen_model_of_same_vocab(
        "reference.checkpoint",
        path,
        "reference",
        policy,
        "policy",
        cfg.checkpoint.init_from,
        bundle,
        "DPO compares the log-probabilities of the same token ids",
    )
    return model_cfg, cfg.reference.compute or stored_compute


class Reference:
    """The frozen reference's log-probs of pair rows: reference.checkpoint's model, else the
    base without the adapter (LoRA) or a copy of the start params; None for a reference-free
    loss. `precompute` fills a table for given rows once and lets the reference go."""

    def __init__(self, cfg: DPOConfig, trainer: Trainer, model_cfg: ModelConfig, bundle: TokenizerBundle):
        self.trainer, self.table = trainer, None
        self.enabled = not cfg.reference_free
        if not self.enabled:
            return
        rows = trainer.batch_sharding
        loaded: dict = {}
        if cfg.reference.checkpoint:  # another model (TRL's ref_model), on the policy's mesh by its own axes
            reference: str = cfg.reference.checkpoint
            ref_cfg, ref_compute = reference_model(cfg, model_cfg, bundle)
            abstract = abstract_model_params(ref_cfg, ref_compute, trainer.mesh)
            fn = make_logps_fn(graphdef_of(ref_cfg, ref_compute))
            self._params = lambda: loaded.setdefault("p", load_params(reference, abstract)[1])
            shardings = jax.tree.map(lambda a: a.sharding, abstract)
        elif cfg.lora is not None:  # the base, through the model without adapters
            fn = make_logps_fn(graphdef_of(model_cfg, trainer.cfg.compute))
            self._params = lambda: trainer._base_args()[0]
            shardings = trainer.base_shardings
        else:
            init_from = cfg.checkpoint.init_from
            assert init_from is not None  # required: finetune.stored_model refuses a config without it
            fn = make_logps_fn(trainer.graphdef)
            self._params = lambda: loaded.setdefault("p", load_params(init_from, trainer.abstract_params)[1])
            shardings = trainer.param_shardings
        self._fn = jax.jit(fn, in_shardings=(shardings, rows), out_shardings=rows)

    def __call__(self, rows: dict[str, np.ndarray]) -> jax.Array:
        """The reference's log-probabilities of `rows`; asked only of an enabled reference."""
        assert self.enabled, "reference_free: there is no reference to ask"
        with use_mesh(self.trainer.mesh):
            return self._fn(self._params(), self.trainer.global_batch(rows))


class EpochIndices:
    """Endless batches of indices into `n` items over epochs, reshuffled each epoch from
    (seed, epoch); the state is (epoch, index). The batch sources of pairs share it."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int):
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0

    def _order(self) -> np.ndarray:
        order = np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(order) if self.shuffle else order

    def take(self) -> list[int]:
        chosen: list[int] = []
        while len(chosen) < self.batch_size:
            order = self._order()
            take = min(self.batch_size - len(chosen), len(order) - self.index)
            chosen += order[self.index : self.index + take].tolist()
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return chosen

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))


Rows = Callable[[Sequence[Pair], int], dict[str, np.ndarray]]
"""A preference stage's rows of a list of pairs at a max_length (pair_rows; KTO's add its labels)."""


class PairBatches:
    """The trainer's batch source: endless batches of pair rows over epochs (EpochIndices),
    with the reference's log-probs."""

    def __init__(
        self,
        pairs: Sequence[Pair],
        cfg: DPOConfig,
        trainer: Trainer,
        reference: Reference,
        table: np.ndarray | None = None,
        rows: Rows | None = None,
    ):
        self.pairs, self.cfg, self.trainer, self.reference, self.table = pairs, cfg, trainer, reference, table
        self.rows = rows or pair_rows
        self.indices = EpochIndices(len(pairs), cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)

    def next_batch(self, state: TrainState):
        chosen = self.indices.take()
        rows = self.rows([self.pairs[i] for i in chosen], self.cfg.data.max_length)
        batch = self.trainer.global_batch(rows)
        if self.table is not None:
            batch["ref_logps"] = self.trainer.global_batch({"r": self.table[chosen]})["r"]
        elif self.reference.enabled:
            batch["ref_logps"] = self.reference(rows)
        return batch, {}

    def get_state(self) -> dict:
        return self.indices.get_state()

    def set_state(self, state: dict) -> None:
        self.indices.set_state(state)


def reference_table(pairs: Sequence[Pair], cfg: DPOConfig, reference: Reference, rows_per_batch: int) -> np.ndarray:
    """The reference's (chosen, rejected) log-probs of every pair, in batches of whole rows."""
    out = []
    for start in range(0, len(pairs), rows_per_batch):
        chunk = list(pairs[start : start + rows_per_batch])
        rows = pair_rows(chunk + [chunk[-1]] * (rows_per_batch - len(chunk)), cfg.data.max_length)
        out.append(np.asarray(jax.device_get(reference(rows)))[: len(chunk)])
    return np.concatenate(out).astype(np.float32)


# --------------------------------------------------------------------------- the run


def run_dpo(cfg: DPOConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `cfg.steps` batches of pairs, resuming from checkpoint.directory if it has one."""
    log = log or log_to_stderr
    model_cfg, compute, bundle = finetune_start(cfg)
    train_pairs, held_out = load_pairs(cfg.data, bundle, log)
    log(f"dpo: {len(train_pairs)} training and {len(held_out)} held-out pairs, loss {cfg.loss_name}, beta {cfg.beta}")
    trainer = Trainer(train_config(cfg, model_cfg, compute), lambda graphdef: dpo_objective(graphdef, cfg))
    return run_preference(
        cfg,
        trainer,
        Reference(cfg, trainer, model_cfg, bundle),
        train_pairs,
        held_out,
        stage="dpo",
        unit="pairs",
        rows=pair_rows,
        held_out_sums=HELD_OUT_SUMS,
        held_out_metrics=lambda sums, batches: held_out_metrics(sums, cfg),
        metrics=METRICS,
        log=log,
    )


def run_preference(
    cfg: DPOConfig,
    trainer: Trainer,
    reference: Reference,
    train: Sequence[Pair],
    held_out: Sequence[Pair],
    *,
    stage: str,
    unit: str,
    rows: Rows,
    held_out_sums: Sequence[str],
    held_out_metrics: Callable[[dict[str, float], int], dict[str, float]],
    metrics: Sequence[str],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """A preference stage's training over its pair rows (DPO's; KTO's examples), with the
    reference's log-probs precomputed or asked batch by batch, and its held-out evaluation:
    the eval step's `held_out_sums` summed over the held-out batches, made metrics by
    `held_out_metrics(sums, batches)`."""
    rows_per_batch = cfg.data.batch_size // cfg.grad_accum
    table = held_out_table = None
    if cfg.precompute_ref:
        table = reference_table(train, cfg, reference, cfg.data.batch_size)
        held_out_table = reference_table(held_out, cfg, reference, rows_per_batch) if held_out else None
        log(f"{stage}: the reference's log-probs of {len(train) + len(held_out)} {unit} precomputed")
    source = PairBatches(train, cfg, trainer, reference, table, rows)
    evaluate = None
    if held_out:

        def evaluate(params) -> dict[str, float]:
            sums = dict.fromkeys(held_out_sums, 0.0)
            batches = math.ceil(len(held_out) / rows_per_batch)
            if cfg.data.eval_batches:
                batches = min(batches, cfg.data.eval_batches)
            for b in range(batches):
                chunk = held_out[b * rows_per_batch : (b + 1) * rows_per_batch]
                filler = rows_per_batch - len(chunk)  # rows without a completion carry no pair
                batch_rows = rows(chunk, cfg.data.max_length)
                batch_rows = {
                    k: np.concatenate([v, np.zeros((filler, *v.shape[1:]), v.dtype)]) for k, v in batch_rows.items()
                }
                batch = trainer.global_batch(batch_rows)
                if held_out_table is not None:
                    ref = held_out_table[b * rows_per_batch : (b + 1) * rows_per_batch]
                    batch["ref_logps"] = trainer.global_batch(
                        {"r": np.concatenate([ref, np.zeros((filler, 2), np.float32)])}
                    )["r"]
                elif reference.enabled:
                    batch["ref_logps"] = reference(batch_rows)
                aux = trainer.eval_step(params, batch)
                for key in held_out_sums:
                    sums[key] += float(aux[key])
            return held_out_metrics(sums, batches)

    result = run_training(
        trainer,
        source,
        log=log,
        evaluate=evaluate,
        meta={"stage": stage, f"{stage}_config": cfg.model_dump(mode="json")},
        logged=("loss", "grad_norm", *metrics),
    )
    result.update({f"train_{unit}": len(train), f"eval_{unit}": len(held_out)})
    return result


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "engine.posttrain.dpo", DPOConfig, run_dpo)


def batch_shapes(cfg: DPOConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one DPO batch: a row per pair (chosen then rejected), and the reference's log-probs."""
    rows, width = cfg.data.batch_size, 2 * cfg.data.max_length
    batch = {
        k: jax.ShapeDtypeStruct((rows, width), np.int32) for k in ("tokens", "targets", "positions", "segment_ids")
    }
    batch["loss_mask"] = jax.ShapeDtypeStruct((rows, width), np.float32)
    if not cfg.reference_free:
        batch["ref_logps"] = jax.ShapeDtypeStruct((rows, 2), np.float32)
    return batch


def step_spec(cfg: DPOConfig, models: InputModels) -> StepSpec:
    """The planner hook (`trainflow plan`): the DPO objective over pair rows; the frozen
    reference's parameters are held beside the step."""

    def uncounted(plan) -> list[str]:
        if cfg.reference_free or cfg.precompute_ref:
            return []
        if "reference" in models:
            count, size = frozen_params_gib(models, "reference", cfg.reference.compute)
            return [
                f"the frozen reference's parameters ({count:,}, {size:.2f} GiB in all, sharded over the same mesh) "
                "are held beside this step and not counted in it (precompute_ref: true holds none)"
            ]
        if cfg.lora is None:
            return [
                f"the frozen reference's parameters, a second copy of {plan.memory.parameters / 2**30:.2f} GiB per "
                "device, are held beside this step and not counted in it (lora: or precompute_ref: true hold none)"
            ]
        return []

    return StepSpec(
        train_config(cfg, *fine_tuned_model(cfg, models)),
        objective=lambda graphdef: dpo_objective(graphdef, cfg),
        batch=batch_shapes(cfg),
        uncounted=uncounted,
    )


if __name__ == "__main__":
    sys.exit(main())
