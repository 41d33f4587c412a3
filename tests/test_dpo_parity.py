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


def trl_dpo(batch, loss_types, loss_weights, *, beta, label_smoothing=0.0):
    """TRL's loss, its gradient w.r.t. the per-token log-probs, and the metrics it logged."""
    trainer = SimpleNamespace(
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


def engine_dpo(batch, loss_type, *, beta, label_smoothing=0.0):
    def loss_fn(log_probs_bt):
        return per_pair_loss(
            loss_type, *sequence_inputs(log_probs_bt, batch), beta=beta, label_smoothing=label_smoothing
        ).mean()

    loss, grad_bt = jax.value_and_grad(loss_fn)(jnp.asarray(batch.log_probs_bt))
    return float(loss), np.asarray(grad_bt)


def assert_close(ours, theirs, what):
    diff = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
    assert diff <= TOLERANCE, f"{what}: max |engine - trl| = {diff:.3g}"


# ---- tests -------------------------------------------------------------------------------------

DPO_CASES = [
    pytest.param(loss_type, beta, 0.0, id=f"{loss_type}-beta{beta}")
    for loss_type in ("sigmoid", "robust", "hinge", "ipo", "sppo_hard", "apo_zero", "apo_down", "sigmoid_norm")
    for beta in (0.1, 0.5)
]
DPO_CASES += [
    # TRL 1.16's sigmoid ignores label_smoothing (cDPO is gone from it); so must the engine's.
    pytest.param("sigmoid", 0.5, 0.2, id="sigmoid-beta0.5-smoothing0.2"),
    pytest.param("robust", 0.1, 0.2, id="robust-beta0.1-smoothing0.2"),
    pytest.param("robust", 0.5, 0.3, id="robust-beta0.5-smoothing0.3"),
]


@pytest.mark.parametrize("loss_type,beta,label_smoothing", DPO_CASES)
def test_dpo_loss_and_gradient_match_trl(loss_type, beta, label_smoothing):
    for seed in SEEDS:
        batch = random_batch(seed)
        trl_loss, trl_grad, _ = trl_dpo(batch, [loss_type], [1.0], beta=beta, label_smoothing=label_smoothing)
        loss, grad = engine_dpo(batch, loss_type, beta=beta, label_smoothing=label_smoothing)
        assert_close(loss, trl_loss, f"{loss_type} loss, seed {seed}")
        assert_close(grad, trl_grad, f"{loss_type} gradient, seed {seed}")


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
