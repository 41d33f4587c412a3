"""Preference losses against TRL itself (trl 1.16, torch CPU): for every DPO loss type the
engine's `per_pair_loss(...).mean()` is the loss `trl.DPOTrainer._compute_loss` returns, and
its gradient with respect to the per-token log-probabilities is torch autograd's through TRL;
likewise RPO (TRL's `loss_type=["sigmoid", "sft"]`) and SimPO (trl's `CPOTrainer.cpo_loss`);
the implicit rewards are the `rewards/*` TRL logs.

Method: TRL's own methods run unbound on a stand-in `self` that carries exactly the
attributes they read. DPO's model is a stand-in for TRL's fused LM head
(`trl.trainer.utils.add_fused_lm_head`): it returns per-token log-probs, a float64 leaf with
`requires_grad`, zeroed where the next-token label is -100, as the real head does. The engine
sees the same numbers as masked per-sequence sums and token counts, in float64 JAX, and
`jax.grad` goes through those sums. SimPO goes one step further back: TRL computes its mean
log-probs from logits with `CPOTrainer.get_batch_logps`, so there the leaf is the logits.

Held-out random batches: 5 pairs of 7 scored tokens (rows of 8), prompts of 1-3 tokens shared
by a pair, completions of different lengths per row, right padding, three seeds. Every row
starts with a prompt token, as real data does: TRL's `ipo` and `sigmoid_norm` count tokens on
the unshifted `completion_mask`, which equals the scored-token count only then.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
need("trl")

from trl import DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402

from engine.posttrain.preference_loss import per_pair_loss, preference_rewards  # noqa: E402

PAIRS, TOKENS, VOCAB = 5, 7, 17  # per-token arrays are (2 * PAIRS, TOKENS): rows [chosen..., rejected...]
SEEDS = (0, 1, 2)
TOLERANCE = 1e-6  # float64 on both sides


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


def random_batch(seed: int) -> SimpleNamespace:
    """Token ids, masks, per-token policy log-probs and reference sums of one batch of pairs."""
    rng = np.random.default_rng(seed)
    rows = 2 * PAIRS
    prompt_len = np.tile(rng.integers(1, 4, PAIRS), 2)
    completion_len = rng.integers(1, TOKENS + 2 - prompt_len)
    position = np.arange(TOKENS + 1)
    completion_mask = (position >= prompt_len[:, None]) & (position < (prompt_len + completion_len)[:, None])
    attention_mask = position < (prompt_len + completion_len)[:, None]
    mask_bt = completion_mask[:, 1:].astype(np.float64)  # which scored (next) tokens are completion
    log_probs_bt = -rng.exponential(1.0, (rows, TOKENS))
    # The reference differs from the policy by a few nats per completion, so sigmoids are not
    # saturated and hinge has pairs on both sides of its kink.
    ref_sums = (log_probs_bt * mask_bt).sum(-1) + rng.normal(0.0, 3.0, rows)
    return SimpleNamespace(
        input_ids=rng.integers(0, VOCAB, (rows, TOKENS + 1)),
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        mask_bt=mask_bt,
        log_probs_bt=log_probs_bt,
        ref_chosen_logps=ref_sums[:PAIRS],
        ref_rejected_logps=ref_sums[PAIRS:],
    )


# ---- TRL's side -------------------------------------------------------------------------------


def stand_in_accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


def fused_head_model(log_probs_bt):
    """What `_compute_loss` reads of TRL's fused LM head: per-token fields, zero where the label is -100."""

    def model(*, labels, fused_lm_head, **model_kwargs):
        assert fused_lm_head
        label_mask_bt = labels[:, 1:] != -100
        zeros_bt = torch.zeros_like(log_probs_bt)
        return SimpleNamespace(
            log_probs=log_probs_bt * label_mask_bt, entropy=zeros_bt, mean_logits=zeros_bt, is_top1=label_mask_bt
        )

    return model


def trl_dpo(batch, loss_types, loss_weights, *, beta, label_smoothing=0.0, discopop_tau=0.05):
    """TRL's loss, its gradient w.r.t. the per-token log-probs, and the metrics it logged."""
    trainer = SimpleNamespace(
        args=SimpleNamespace(discopop_tau=discopop_tau),
        beta=beta,
        loss_types=loss_types,
        loss_weights=loss_weights,
        f_divergence_type="reverse_kl",
        label_smoothing=label_smoothing,
        ld_alpha=None,
        precompute_ref_logps=True,
        use_weighting=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        accelerator=stand_in_accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    log_probs_bt = torch.tensor(batch.log_probs_bt, dtype=torch.float64, requires_grad=True)
    inputs = {
        "input_ids": torch.tensor(batch.input_ids),
        "attention_mask": torch.tensor(batch.attention_mask, dtype=torch.long),
        "completion_mask": torch.tensor(batch.completion_mask, dtype=torch.long),
        "ref_chosen_logps": torch.tensor(batch.ref_chosen_logps, dtype=torch.float64),
        "ref_rejected_logps": torch.tensor(batch.ref_rejected_logps, dtype=torch.float64),
    }
    loss = DPOTrainer._compute_loss(trainer, fused_head_model(log_probs_bt), inputs, return_outputs=False)
    (grad_bt,) = torch.autograd.grad(loss, log_probs_bt)
    return loss.item(), grad_bt.numpy(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


# ---- the engine's side ------------------------------------------------------------------------


def sequence_inputs(log_probs_bt, batch):
    """per_pair_loss's positional inputs: masked per-sequence sums, reference sums, token counts."""
    mask_bt = jnp.asarray(batch.mask_bt)
    sums, tokens = (log_probs_bt * mask_bt).sum(-1), mask_bt.sum(-1)
    return (
        sums[:PAIRS],
        sums[PAIRS:],
        jnp.asarray(batch.ref_chosen_logps),
        jnp.asarray(batch.ref_rejected_logps),
        tokens[:PAIRS],
        tokens[PAIRS:],
    )


def engine_dpo(batch, loss_type, *, beta, label_smoothing=0.0, discopop_tau=0.05):
    def loss_fn(log_probs_bt):
        return per_pair_loss(
            loss_type,
            *sequence_inputs(log_probs_bt, batch),
            beta=beta,
            label_smoothing=label_smoothing,
            discopop_tau=discopop_tau,
        ).mean()

    loss, grad_bt = jax.value_and_grad(loss_fn)(jnp.asarray(batch.log_probs_bt))
    return float(loss), np.asarray(grad_bt)


def assert_close(ours, theirs, what):
    diff = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
    assert diff <= TOLERANCE, f"{what}: max |engine - trl| = {diff:.3g}"


# ---- tests -------------------------------------------------------------------------------------

DPO_CASES = [
    pytest.param(loss_type, beta, 0.0, id=f"{loss_type}-beta{beta}")
    for loss_type in (
        *("sigmoid", "robust", "hinge", "ipo", "sppo_hard", "apo_zero", "apo_down", "sigmoid_norm"),
        *("nca_pair", "bco_pair", "aot", "aot_unpaired", "discopop"),
    )
    for beta in (0.1, 0.5)
]
DPO_CASES += [
    # TRL 1.16's sigmoid ignores label_smoothing (cDPO is gone from it); so must the engine's.
    pytest.param("sigmoid", 0.5, 0.2, id="sigmoid-beta0.5-smoothing0.2"),
    pytest.param("robust", 0.1, 0.2, id="robust-beta0.1-smoothing0.2"),
    pytest.param("robust", 0.5, 0.3, id="robust-beta0.5-smoothing0.3"),
    pytest.param("exo_pair", 0.1, 1e-3, id="exo_pair-beta0.1-smoothing0.001"),
    pytest.param("exo_pair", 0.5, 0.2, id="exo_pair-beta0.5-smoothing0.2"),
    pytest.param("aot", 0.5, 0.2, id="aot-beta0.5-smoothing0.2"),
    pytest.param("aot_unpaired", 0.1, 0.3, id="aot_unpaired-beta0.1-smoothing0.3"),
]


@pytest.mark.parametrize("loss_type,beta,label_smoothing", DPO_CASES)
def test_dpo_loss_and_gradient_match_trl(loss_type, beta, label_smoothing):
    for seed in SEEDS:
        batch = random_batch(seed)
        trl_loss, trl_grad, _ = trl_dpo(batch, [loss_type], [1.0], beta=beta, label_smoothing=label_smoothing)
        loss, grad = engine_dpo(batch, loss_type, beta=beta, label_smoothing=label_smoothing)
        assert_close(loss, trl_loss, f"{loss_type} loss, seed {seed}")
        assert_close(grad, trl_grad, f"{loss_type} gradient, seed {seed}")


def test_discopop_temperature_matches_trl():
    for seed in SEEDS:
        batch = random_batch(seed)
        trl_loss, trl_grad, _ = trl_dpo(batch, ["discopop"], [1.0], beta=0.5, discopop_tau=0.3)
        loss, grad = engine_dpo(batch, "discopop", beta=0.5, discopop_tau=0.3)
        assert_close(loss, trl_loss, f"discopop loss, seed {seed}")
        assert_close(grad, trl_grad, f"discopop gradient, seed {seed}")


@pytest.mark.parametrize(
    "loss_types,loss_weights",
    [
        (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]),  # MPO, TRL's example of a combination
        (["aot", "nca_pair", "ipo"], [1.0, 0.5, 0.25]),
        (["discopop", "exo_pair"], None),
    ],
)
def test_a_list_of_loss_types_with_weights_matches_trl(loss_types, loss_weights):
    """The stage's combination (DPOConfig.weighted_losses through dpo.weighted_loss, the code
    the training step runs) equals TRL's loss and gradient for the same list and weights."""
    from engine.posttrain.config import DPOConfig
    from engine.posttrain.dpo import weighted_loss

    smoothing = 0.1 if {"aot", "exo_pair"} & set(loss_types) else 0.0  # the config refuses it elsewhere
    cfg = DPOConfig.model_validate(
        {"loss_type": loss_types, "loss_weights": loss_weights, "beta": 0.3, "label_smoothing": smoothing}
        | {"checkpoint": {"init_from": "unused", "directory": "unused"}}
    )
    for seed in SEEDS:
        batch = random_batch(seed)
        weights = loss_weights or [1.0] * len(loss_types)
        trl_loss, trl_grad, _ = trl_dpo(batch, loss_types, weights, beta=0.3, label_smoothing=smoothing)

        def loss_fn(log_probs_bt):
            inputs = sequence_inputs(log_probs_bt, batch)  # noqa: B023
            chosen_mask_bt = jnp.asarray(batch.mask_bt[:PAIRS])  # noqa: B023
            valid = jnp.ones(PAIRS)
            return weighted_loss(cfg, inputs, valid, (float(PAIRS), chosen_mask_bt.sum()))[0]

        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(batch.log_probs_bt))
        assert_close(loss, trl_loss, f"{'+'.join(loss_types)} loss, seed {seed}")
        assert_close(grad, trl_grad, f"{'+'.join(loss_types)} gradient, seed {seed}")


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "sigmoid"])
def test_rows_without_a_pair_leave_the_loss_and_the_sorted_losses_unchanged(loss_type):
    """Held-out batches are filled up with rows that hold no pair (valid 0): the sum of the
    losses over the valid pairs is the loss of those pairs alone, also for aot, which sorts."""
    batch = random_batch(0)
    inputs = sequence_inputs(jnp.asarray(batch.log_probs_bt), batch)
    alone = per_pair_loss(loss_type, *inputs, beta=0.5, label_smoothing=0.1).sum()
    filler = 3
    padded = [jnp.concatenate([x, jnp.full(filler, v)]) for x, v in zip(inputs, (0.0, 0.0, 5.0, -5.0, 0.0, 0.0))]
    order = np.random.default_rng(1).permutation(PAIRS + filler)  # filler rows anywhere in the batch
    valid = jnp.concatenate([jnp.ones(PAIRS), jnp.zeros(filler)])[order]
    with_filler = per_pair_loss(loss_type, *[x[order] for x in padded], beta=0.5, label_smoothing=0.1, valid=valid)
    assert_close(with_filler.sum(), alone, f"{loss_type} with filler rows")


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_rpo_matches_trl_sigmoid_plus_sft(alpha):
    """RPO is TRL's ["sigmoid", "sft"] with weights [1, alpha]: the sft term is the NLL per chosen token."""
    beta = 0.1
    for seed in SEEDS:
        batch = random_batch(seed)
        trl_loss, trl_grad, _ = trl_dpo(batch, ["sigmoid", "sft"], [1.0, alpha], beta=beta)

        def loss_fn(log_probs_bt):
            chosen_mask_bt = jnp.asarray(batch.mask_bt[:PAIRS])  # noqa: B023
            chosen_nll = -(log_probs_bt[:PAIRS] * chosen_mask_bt).sum()
            return per_pair_loss("sigmoid", *sequence_inputs(log_probs_bt, batch), beta=beta).mean() + alpha * (  # noqa: B023
                chosen_nll / chosen_mask_bt.sum()
            )

        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(batch.log_probs_bt))
        assert_close(loss, trl_loss, f"rpo loss, seed {seed}")
        assert_close(grad, trl_grad, f"rpo gradient, seed {seed}")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_rewards_match_trl_metrics(loss_type):
    beta = 0.5
    for seed in SEEDS:
        batch = random_batch(seed)
        _, _, metrics = trl_dpo(batch, [loss_type], [1.0], beta=beta)
        inputs = sequence_inputs(jnp.asarray(batch.log_probs_bt), batch)
        chosen, rejected = preference_rewards(loss_type, *inputs, beta=beta)
        assert_close(chosen.mean(), metrics["rewards/chosen"], "rewards/chosen")
        assert_close(rejected.mean(), metrics["rewards/rejected"], "rewards/rejected")
        assert_close((chosen - rejected).mean(), metrics["rewards/margins"], "rewards/margins")
        assert float((chosen > rejected).mean()) == metrics["rewards/accuracies"]


@pytest.mark.parametrize("beta,simpo_gamma,label_smoothing", [(2.0, 0.5, 0.0), (2.5, 1.0, 0.1), (0.5, 0.3, 0.2)])
def test_simpo_matches_trl_cpo(beta, simpo_gamma, label_smoothing):
    """SimPO's loss, gradient w.r.t. the logits, and per-pair rewards, against CPO's from the same logits."""
    cpo = SimpleNamespace(
        loss_type="simpo",
        alpha=0.0,
        beta=beta,
        simpo_gamma=simpo_gamma,
        label_smoothing=label_smoothing,
        accelerator=stand_in_accelerator(),
    )
    for seed in SEEDS:
        batch = random_batch(seed)
        logits_btv = np.random.default_rng(100 + seed).normal(0.0, 2.0, (2 * PAIRS, TOKENS + 1, VOCAB))
        labels = np.where(batch.completion_mask, batch.input_ids, -100)

        trl_logits = torch.tensor(logits_btv, requires_grad=True)
        # CPOTrainer.concatenated_forward: simpo takes the mean log-prob per completion token.
        mean_logps = CPOTrainer.get_batch_logps(trl_logits, torch.tensor(labels), average_log_prob=True)
        losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(cpo, mean_logps[:PAIRS], mean_logps[PAIRS:])
        trl_loss = losses.mean()
        (trl_grad,) = torch.autograd.grad(trl_loss, trl_logits)

        def per_token_logps(logits):
            log_probs_btv = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            return jnp.take_along_axis(log_probs_btv, jnp.asarray(batch.input_ids[:, 1:, None]), axis=-1)[..., 0]  # noqa: B023

        def loss_fn(logits):
            return per_pair_loss(
                "simpo",
                *sequence_inputs(per_token_logps(logits), batch),  # noqa: B023
                beta=beta,
                label_smoothing=label_smoothing,
                simpo_gamma=simpo_gamma,
            ).mean()

        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logits_btv))
        assert_close(loss, trl_loss.item(), f"simpo loss, seed {seed}")
        assert_close(grad, trl_grad.numpy(), f"simpo gradient, seed {seed}")
        chosen, rejected = preference_rewards(
            "simpo", *sequence_inputs(per_token_logps(jnp.asarray(logits_btv)), batch), beta=beta
        )
        assert_close(chosen, trl_chosen.numpy(), "simpo chosen rewards")
        assert_close(rejected, trl_rejected.numpy(), "simpo rejected rewards")


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl_orpo(beta):
    """ORPO (loss_type orpo): the NLL of the chosen sequences (prompt included) minus beta x
    log sigmoid of the log odds ratio of the mean completion log-probs; its loss and gradient
    w.r.t. the logits equal trl's ORPOTrainer.concatenated_forward + odds_ratio_loss on the same
    logits, the engine's through dpo.chosen_sequence_nll_sum on rows in its segment layout."""
    from trl.experimental.orpo import ORPOTrainer

    from engine.posttrain.dpo import CHOSEN, REJECTED, chosen_sequence_nll_sum

    orpo = SimpleNamespace(
        beta=beta,
        is_encoder_decoder=False,
        padding_value=0,
        aux_loss_enabled=False,
        accelerator=stand_in_accelerator(),
        concatenated_inputs=ORPOTrainer.concatenated_inputs,
        get_batch_logps=ORPOTrainer.get_batch_logps,
    )
    for seed in SEEDS:
        batch = random_batch(seed)
        # Peaked distributions: mean log-probs near 0 exercise log1mexp's second branch too.
        logits_btv = np.random.default_rng(200 + seed).normal(0.0, 4.0, (2 * PAIRS, TOKENS + 1, VOCAB))
        ids = torch.tensor(batch.input_ids)
        labels = torch.where(torch.tensor(batch.completion_mask), ids, -100)
        attention = torch.tensor(batch.attention_mask, dtype=torch.long)
        trl_logits = torch.tensor(logits_btv, requires_grad=True)
        model = lambda *args, **kwargs: SimpleNamespace(logits=trl_logits)  # noqa: B023, E731
        trl_batch = {
            "chosen_input_ids": ids[:PAIRS],
            "chosen_attention_mask": attention[:PAIRS],
            "chosen_labels": labels[:PAIRS],
            "rejected_input_ids": ids[PAIRS:],
            "rejected_attention_mask": attention[PAIRS:],
            "rejected_labels": labels[PAIRS:],
        }
        chosen_logps, rejected_logps, _, _, nll = ORPOTrainer.concatenated_forward(orpo, model, trl_batch)
        losses, trl_chosen, trl_rejected, _, _ = ORPOTrainer.odds_ratio_loss(orpo, chosen_logps, rejected_logps)
        trl_loss = nll - losses.mean()
        (trl_grad,) = torch.autograd.grad(trl_loss, trl_logits)

        # The engine's rows: chosen rows segment 1, rejected rows segment 2 where a target exists.
        segment_ids = np.where(batch.attention_mask[:, 1:], np.repeat([CHOSEN, REJECTED], PAIRS)[:, None], 0)
        rows = {"targets": jnp.asarray(batch.input_ids[:, 1:]), "segment_ids": jnp.asarray(segment_ids)}

        def per_token_logps(logits):
            log_probs_btv = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            return jnp.take_along_axis(log_probs_btv, rows["targets"][..., None], axis=-1)[..., 0]  # noqa: B023

        def loss_fn(logits):
            pair_losses = per_pair_loss("orpo", *sequence_inputs(per_token_logps(logits), batch), beta=beta)  # noqa: B023
            nll_sum = chosen_sequence_nll_sum(logits[:, :-1], rows)  # noqa: B023
            return nll_sum / np.sum(segment_ids == CHOSEN) + pair_losses.mean()  # noqa: B023

        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logits_btv))
        assert_close(loss, trl_loss.item(), f"orpo loss, seed {seed}")
        assert_close(grad, trl_grad.numpy(), f"orpo gradient, seed {seed}")
        chosen, rejected = preference_rewards(
            "orpo", *sequence_inputs(per_token_logps(jnp.asarray(logits_btv)), batch), beta=beta
        )
        assert_close(chosen, trl_chosen.numpy(), "orpo chosen rewards")
        assert_close(rejected, trl_rejected.numpy(), "orpo rejected rewards")


# ---- a separate reference: the engine's DPO stage against DPOTrainer with a ref_model --------

PREFERENCES = [
    ("2 + 3 =", " 5", " 6"),
    ("the sky is", " blue", " green and red"),
    ("4 + 4 =", " 8", " 9"),
    ("the fox jumps over the", " lazy dog", " moon"),
    ("1 + 1 =", " 2", " 11"),
    ("grass is", " green", " blue"),
    ("3 + 4 =", " 7", " 8 or so"),
    ("the sun is", " yellow", " cold"),
]


def tiny_model_artifact(root, bundle, seed: int, outputs: tuple[str, ...] = ("log_probs",)):
    """A checkpoint artifact (checkpoint/ + tokenizer/) of a random tiny model, and its
    Hugging Face export as transformers loads it (float64, with TRL's fused LM head computing
    `outputs`, as DPOTrainer patches its model and its ref_model)."""
    from flax import nnx
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from engine.data.tokenizer import save_tokenizer
    from engine.interop.hf.export import export_hf
    from engine.models.config import ComputeConfig, ModelConfig
    from engine.models.transformer import Transformer
    from engine.train.checkpoint import save_params

    cfg = ModelConfig(
        vocab_size=bundle.vocab_size,
        d_model=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        mlp_dim=24,
        max_seq_len=64,
        init_std=0.3,  # peaked distributions: the two models' log-probs differ by nats
    )
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]))()
    meta = {"step": 0, "model": cfg.model_dump(mode="json"), "compute": ComputeConfig().model_dump(mode="json")}
    save_params(root / "checkpoint", 0, jax.tree.map(np.asarray, params), meta)
    save_tokenizer(bundle, root / "tokenizer")
    export_hf(root / "checkpoint", root / "hf")
    model = AutoModelForCausalLM.from_pretrained(root / "hf").double().eval()
    add_fused_lm_head(model, outputs=outputs)
    return model


def test_dpo_with_a_separate_reference_matches_trl_with_that_ref_model(tmp_path):
    """The engine's first DPO step (policy = the start checkpoint, reference = another model)
    has the loss `DPOTrainer._compute_loss` computes with `ref_model` set to that model's
    Hugging Face export, on the same token rows; with the start policy as its own reference
    the loss would be log 2."""
    import json

    from engine.data.tokenizer import TokenizerConfig, train_tokenizer
    from engine.posttrain.config import DPOConfig
    from engine.posttrain.dpo import load_pairs, run_dpo

    with jax.enable_x64(False):  # the engine as it runs (the module's float64 is for the loss tests)
        texts = [" ".join(p + c + r for p, c, r in PREFERENCES) * 5]
        bundle = train_tokenizer(TokenizerConfig(vocab_size=300), texts, add_bos=True)
        policy = tiny_model_artifact(
            tmp_path / "policy", bundle, seed=0, outputs=("log_probs", "entropy", "mean_logits", "is_top1")
        )
        reference = tiny_model_artifact(tmp_path / "reference", bundle, seed=1)
        data = tmp_path / "prefs.jsonl"
        data.write_text("".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), p))) + "\n" for p in PREFERENCES))
        cfg = DPOConfig.model_validate(
            {
                "checkpoint": {
                    "init_from": str(tmp_path / "policy" / "checkpoint"),
                    "directory": str(tmp_path / "run" / "checkpoint"),
                    "async_save": False,
                },
                "reference": {"checkpoint": str(tmp_path / "reference" / "checkpoint")},
                "data": {"path": str(data), "max_prompt_length": 8, "max_length": 16, "batch_size": 8}
                | {"shuffle": False},
                "beta": 0.5,
                "steps": 1,
                "log_every": 1,
                "progress": False,
            }
        )
        engine_loss = run_dpo(cfg, log=lambda message: None)["final_loss"]
        pairs, _ = load_pairs(cfg.data, bundle, lambda message: None)

    # TRL's rows: chosen sequences, then rejected ones, right-padded; the completion marked.
    sequences = [np.concatenate([p.prompt, p.chosen]) for p in pairs] + [
        np.concatenate([p.prompt, p.rejected]) for p in pairs
    ]
    prompt_lengths = [len(p.prompt) for p in pairs] * 2
    width = max(map(len, sequences))
    input_ids = np.zeros((len(sequences), width), np.int64)
    attention_mask = np.zeros_like(input_ids)
    completion_mask = np.zeros_like(input_ids)
    for row, (ids, prompt) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = ids, 1
        completion_mask[row, prompt : len(ids)] = 1
    inputs = {
        "input_ids": torch.tensor(input_ids),
        "attention_mask": torch.tensor(attention_mask),
        "completion_mask": torch.tensor(completion_mask),
    }

    def trl_loss(ref_model):
        trainer = SimpleNamespace(
            beta=0.5,
            loss_types=["sigmoid"],
            loss_weights=[1.0],
            f_divergence_type="reverse_kl",
            label_smoothing=0.0,
            ld_alpha=None,
            precompute_ref_logps=False,
            use_weighting=False,
            aux_loss_enabled=False,
            model=policy,
            ref_model=ref_model,
            args=SimpleNamespace(gradient_checkpointing_kwargs=None),
            accelerator=stand_in_accelerator(),
            _metrics=defaultdict(lambda: defaultdict(list)),
            _total_train_tokens=0,
            _tp_size=1,
        )
        with torch.no_grad():
            return DPOTrainer._compute_loss(trainer, policy, inputs, return_outputs=False).item()

    theirs = trl_loss(reference)
    print(f"\nDPO with a separate reference: engine loss {engine_loss:.6f}, TRL's {theirs:.6f}")
    assert abs(engine_loss - theirs) <= 1e-4 * max(1.0, abs(theirs)), (engine_loss, theirs)
    assert abs(theirs - np.log(2.0)) > 0.05, theirs  # the reference is not the policy
    assert abs(trl_loss(policy) - np.log(2.0)) < 1e-6  # TRL with the start policy as its own reference
