"""Policy-gradient estimators against their references, in float64:

- every registered loss type (TRL's grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo; GMPO's trainer), at token and
  sequence level, with and without the KL term and the rollout correction's weights: the loss
  and its gradient with respect to the per-token log-probs equal `trl.GRPOTrainer._compute_loss`
  run unbound on a stand-in `self` (as tests/test_dpo_parity.py does for DPO);
- the rollout correction's four modes: TRL's importance-sampling lines, transcribed in torch;
- RLOO's advantages: TRL's RLOOTrainer lines, transcribed; REINFORCE++ and its baseline
  variant: verl's core_algos functions, transcribed (verl is not a dependency);
- the registries: a user's `module:function` surrogate and aggregation run; an unknown name
  is refused in one sentence listing the registered ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.posttrain import advantages as estimators
from engine.posttrain.config import GRPOConfig
from engine.posttrain.policy_loss import policy_loss, sapo
from engine.posttrain.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from engine.posttrain.rollout_correction import rollout_correction
from tests.deps import need

torch = need("torch")
need("trl")

from trl import GRPOTrainer  # noqa: E402

B, T, MAX_LEN = 6, 7, 9
rng = np.random.default_rng(3)
LOGP = np.log(rng.uniform(0.05, 0.9, (B, T)))
OLD = LOGP + rng.normal(0, 0.3, (B, T))  # ratios far enough from 1 that clipping happens
BEHAVIOUR = OLD + rng.normal(0, 0.4, (B, T))
REF = LOGP + rng.normal(0, 0.2, (B, T))
ADV = rng.normal(0, 1, B)
LENGTHS = np.array([7, 3, 5, 1, 6, 4])
MASK = (np.arange(T) < LENGTHS[:, None]).astype(float)


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


# --------------------------------------------------------------------------- TRL's loss


def trl_loss(loss_type, level, beta, epsilon_high, is_ratio=None, trainer=GRPOTrainer, epsilon_low=0.2):
    """(loss, d loss / d logp) from TRL's GRPOTrainer._compute_loss (or a subclass's: `trainer`)
    on a stand-in trainer."""
    logp = torch.tensor(LOGP, requires_grad=True)
    mask = torch.tensor(MASK)
    me = SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True,
        args=SimpleNamespace(
            delta=None,
            use_bias_correction_kl=False,
            steps_per_generation=1,
            sapo_temperature_pos=SAPO_TEMPERATURES[0],
            sapo_temperature_neg=SAPO_TEMPERATURES[1],
        ),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(
            num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        # The policy's per-token log-probs are the leaf (TRL would take them from the model's logits).
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
    )
    inputs = {
        "prompt_ids": torch.ones((B, 1), dtype=torch.long),
        "prompt_mask": torch.ones((B, 1), dtype=torch.long),
        "completion_ids": torch.ones((B, T), dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(ADV),
        "old_per_token_logps": torch.tensor(OLD),
        "ref_per_token_logps": torch.tensor(REF),
        "num_items_in_batch": mask.sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(np.asarray(is_ratio))
    loss = trainer._compute_loss(me, None, inputs)
    loss.backward()
    return loss.item(), logp.grad.numpy(), me._metrics["train"]


SAPO_TEMPERATURES = (0.75, 1.5)  # not TRL's defaults; exact in float32, the dtype torch.where gives TRL's


def engine_loss(loss_type, level, beta, epsilon_high, is_weights=None, epsilon_low=0.2):
    def loss(logp):
        return policy_loss(
            logp,
            jnp.asarray(OLD),
            jnp.asarray(ADV),
            jnp.asarray(MASK),
            ref_logp_bt=jnp.asarray(REF),
            level=level,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            beta=beta,
            loss_type=loss_type,
            max_completion_length=MAX_LEN,
            is_weights=is_weights,
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(LOGP))
    return float(value), np.asarray(grad), metrics


CASES = [
    (loss_type, level, None) for loss_type in ("bnpo", "dr_grpo", "luspo", "cispo") for level in ("token", "sequence")
]
CASES += [
    (loss_type, level, correction)
    for loss_type in ("grpo", "dapo")
    for level in ("token", "sequence")
    for correction in (None, "token_truncate", "sequence_mask")
]
CASES += [("cispo", "token", "token_truncate")]


@pytest.mark.parametrize("loss_type, level, correction", CASES)
def test_each_loss_type_equals_trls_loss_and_gradient(loss_type, level, correction):
    epsilon_high = 1.3 if loss_type == "cispo" else 0.28  # cispo's is an absolute bound on the weight
    is_weights = None
    if correction is not None:
        is_weights, _, _ = rollout_correction(
            jnp.asarray(OLD), jnp.asarray(BEHAVIOUR), jnp.asarray(MASK), correction, clip_min=0.5, clip_max=2.0
        )
    for beta in (0.0, 0.04):
        value, grad, metrics = engine_loss(loss_type, level, beta, epsilon_high, is_weights)
        ref_value, ref_grad, ref_metrics = trl_loss(loss_type, level, beta, epsilon_high, is_weights)
        np.testing.assert_allclose(value, ref_value, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
        if loss_type == "cispo":
            np.testing.assert_allclose(float(metrics["cispo_clip_ratio"]), ref_metrics["cispo_clip_ratio"][0])
            assert 0 < float(metrics["cispo_clip_ratio"]) < 1  # the fixture does clip
        else:
            np.testing.assert_allclose(float(metrics["clip_ratio"]), ref_metrics["clip_ratio/region_mean"][0])
        if beta:
            np.testing.assert_allclose(float(metrics["kl"]), ref_metrics["kl"][0], rtol=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_equals_trls_loss_and_gradient(level):
    """SAPO's soft gate with the run's temperatures (policy_loss.sapo, what a GRPO run with
    loss_type sapo resolves) against GRPOTrainer._compute_loss with loss_type sapo."""
    for beta in (0.0, 0.04):
        value, grad, _ = engine_loss(sapo(*SAPO_TEMPERATURES), level, beta, 0.28)
        ref_value, ref_grad, _ = trl_loss("sapo", level, beta, 0.28)
        np.testing.assert_allclose(value, ref_value, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
    default, _, _ = engine_loss("sapo", level, 0.0, 0.28)
    assert abs(default - value) > 1e-6  # the temperatures matter (the registered sapo has TRL's defaults)


@pytest.mark.parametrize("epsilon_low,epsilon_high", [(0.4, 0.4), (0.1, 0.25)])
def test_gmpo_equals_trls_loss_gradient_and_clip_fractions(epsilon_low, epsilon_high):
    """GMPO (loss_type gmpo): the geometric mean of sign-aware clipped token ratios, against
    trl.experimental.gmpo's GMPOTrainer._compute_loss, with and without its sequence-mean KL."""
    from trl.experimental.gmpo import GMPOTrainer

    for beta in (0.0, 0.04):
        value, grad, metrics = engine_loss("gmpo", "token", beta, epsilon_high, epsilon_low=epsilon_low)
        ref_value, ref_grad, ref_metrics = trl_loss(
            "gmpo", "token", beta, epsilon_high, trainer=GMPOTrainer, epsilon_low=epsilon_low
        )
        np.testing.assert_allclose(value, ref_value, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(float(metrics["clip_ratio"]), ref_metrics["clip_ratio/region_mean"][0])
        np.testing.assert_allclose(float(metrics["clip_ratio_low"]), ref_metrics["clip_ratio/low_mean"][0])
        assert 0 < float(metrics["clip_ratio"]) < 1  # the fixture does clip
        if beta:
            np.testing.assert_allclose(float(metrics["kl"]), ref_metrics["kl"][0], rtol=1e-9)


def test_sapo_and_gmpo_config_keys_are_checked_in_one_sentence():
    base = {"rewards": [{"function": "exact_match"}], "checkpoint": {"init_from": "x", "directory": "y"}}
    assert GRPOConfig.model_validate({**base, "loss_type": "gmpo"}).epsilon == 0.4  # TRL's GMPO default
    assert GRPOConfig.model_validate({**base, "loss_type": "gmpo", "epsilon": 0.3}).epsilon == 0.3
    from engine.posttrain.grpo import resolve_objective

    run = GRPOConfig.model_validate(
        {**base, "loss_type": "sapo", "sapo_temperature_pos": SAPO_TEMPERATURES[0]}
        | {"sapo_temperature_neg": SAPO_TEMPERATURES[1]}
    )
    loss_def, _ = resolve_objective(run)  # what the GRPO step calls: the run's temperatures bound
    np.testing.assert_allclose(
        engine_loss(loss_def, "token", 0.0, 0.28)[0], engine_loss(sapo(*SAPO_TEMPERATURES), "token", 0.0, 0.28)[0]
    )
    for tree, message in [
        ({"loss_type": "gmpo", "algorithm": "gspo"}, "loss_type gmpo makes its own sequence weight"),
        ({"loss_type": "dapo", "sapo_temperature_neg": 2.0}, "sapo_temperature_neg applies to loss_type sapo only"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(tree={**base, **tree}, schema=GRPOConfig)


def trl_is_ratio(mode, clip_min, clip_max):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, the vLLM importance-sampling lines."""
    mask = torch.tensor(MASK)
    per_token_logps_diff = (torch.tensor(OLD) - torch.tensor(BEHAVIOUR)) * mask
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max).numpy()
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0).numpy()


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_weights_are_trls_importance_sampling_ratios(mode):
    for clip_min, clip_max in ((None, 3.0), (0.5, 2.0)):
        weights, keep, metrics = rollout_correction(
            jnp.asarray(OLD), jnp.asarray(BEHAVIOUR), jnp.asarray(MASK), mode, clip_min, clip_max
        )
        np.testing.assert_allclose(np.asarray(weights), trl_is_ratio(mode, clip_min, clip_max), rtol=1e-12)
        assert keep is None  # TRL's modes weight tokens; none leaves the loss
    delta = (OLD - BEHAVIOUR) * MASK
    raw = np.exp(delta) if mode.startswith("token") else np.exp(delta.sum(1))
    live = raw[MASK > 0] if mode.startswith("token") else raw
    assert float(metrics["is_ratio_max"]) == pytest.approx(live.max()) and float(metrics["is_ratio_min"]) == (
        pytest.approx(live.min())
    )
    assert float(metrics["is_clipped_fraction"]) == pytest.approx(np.mean((live < 0.5) | (live > 2.0)))


# --------------------------------------------------------------------------- advantages

G = 4
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 0.3, -1.0, 4.0, 0.0])  # three groups of 4
VALID = np.array([True, True, False, True, True, True, True, True, True, True, True, True])
ROW_LENGTHS = np.array([3, 7, 2, 5, 4, 4, 6, 1, 2, 8, 3, 5])


def trl_rloo(normalize: bool):
    """TRL 1.16's RLOOTrainer: the leave-one-out baseline over scorable siblings (its lines)."""
    rewards = torch.tensor(np.where(VALID, REWARDS, np.nan))
    grouped_rewards = rewards.view(-1, G)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = ((grouped_sum - grouped_rewards) / (scorable_counts - 1)).view(-1)
    advantages = rewards - baselines
    if normalize:
        scorable = advantages[~torch.isnan(advantages)]
        advantages = (advantages - torch.nanmean(advantages)) / (scorable.std() + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).numpy()


def verl_masked_whiten(values, mask):
    """verl.utils.torch_functional.masked_whiten (masked_mean, unbiased masked_var)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_reinforce_plus_plus(baseline: bool):
    """verl core_algos: REINFORCE++ (gamma 1) and REINFORCE++-baseline on an outcome reward at each
    completion's last token, over the scorable rows (an unscorable one is not in verl's batch)."""
    rows = np.flatnonzero(VALID)
    width = ROW_LENGTHS.max()
    mask = torch.tensor((np.arange(width) < ROW_LENGTHS[rows, None]).astype(float))
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rows)), torch.tensor(ROW_LENGTHS[rows] - 1)] = torch.tensor(REWARDS[rows])
    if baseline:
        scores = token_rewards.sum(-1)
        groups = rows // G
        means = {g: scores[groups == g].mean() for g in set(groups)}
        scores = torch.stack([scores[i] - means[g] for i, g in enumerate(groups)])
        advantages = verl_masked_whiten(scores[:, None].tile([1, width]) * mask, mask) * mask
    else:
        returns, running = torch.zeros_like(token_rewards), 0
        for t in reversed(range(width)):
            running = token_rewards[:, t] + running
            returns[:, t] = running
            running = running * mask[:, t]
        advantages = verl_masked_whiten(returns, mask) * mask
    out = np.zeros(len(REWARDS))
    out[rows] = advantages[:, 0].numpy()  # constant over each completion's tokens
    assert np.allclose((advantages * mask).numpy(), out[rows, None] * mask.numpy())
    return out


def test_rloo_advantages_are_trls():
    for scale, normalize in (("none", False), ("batch", True)):
        ours, _ = estimators.rloo(REWARDS, VALID, ROW_LENGTHS, G, scale)
        np.testing.assert_allclose(ours, trl_rloo(normalize), rtol=1e-6, atol=1e-7)
    # leave-one-out = G'/(G'-1) x the group-centred reward (G' scorable siblings)
    full = estimators.rloo(REWARDS[4:], VALID[4:], ROW_LENGTHS[4:], G, "none")[0]
    grpo = estimators.grpo(REWARDS[4:], VALID[4:], ROW_LENGTHS[4:], G, "none")[0]
    np.testing.assert_allclose(full, grpo * G / (G - 1), rtol=1e-6)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_plus_plus_advantages_are_verls(baseline):
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    ours, _ = ADVANTAGE_ESTIMATORS.resolve(name)(REWARDS, VALID, ROW_LENGTHS, G, "batch")
    np.testing.assert_allclose(ours, verl_reinforce_plus_plus(baseline), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- registries


def test_user_surrogates_and_aggregations_are_named_as_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        "import jax.numpy as jnp\n"
        "def vanilla_pg(ratio, advantages_b1, logp_bt, *, epsilon_low, epsilon_high):\n"
        "    return -advantages_b1 * logp_bt, {}\n"
        "def token_sum(per_token_bt, mask_bt, **kwargs):\n"
        "    return jnp.sum(per_token_bt * mask_bt)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = GRPOConfig.model_validate(
        {"rewards": [{"function": "exact_match"}], "loss_type": "my_losses:vanilla_pg", "loss_aggregation": "x:y"}
    )
    assert cfg.loss_type == "my_losses:vanilla_pg"
    loss, _ = policy_loss(
        jnp.asarray(LOGP), None, jnp.asarray(ADV), jnp.asarray(MASK), loss_type=cfg.loss_type, aggregation=None
    )
    np.testing.assert_allclose(float(loss), (-ADV[:, None] * LOGP * MASK).sum() / MASK.sum())  # token_mean
    loss, _ = policy_loss(
        jnp.asarray(LOGP),
        None,
        jnp.asarray(ADV),
        jnp.asarray(MASK),
        loss_type="dapo",
        aggregation="my_losses:token_sum",
    )
    np.testing.assert_allclose(float(loss), (-ADV[:, None] * MASK).sum())  # the ratio is 1: -A per token
    # Registered in Python, a name is as good as a built-in.
    POLICY_LOSSES.register("vanilla_pg", "my_losses:vanilla_pg")
    try:
        assert GRPOConfig.model_validate({"rewards": [{"function": "exact_match"}], "loss_type": "vanilla_pg"})
    finally:
        POLICY_LOSSES._entries.pop("vanilla_pg")


def test_an_unknown_name_is_refused_in_one_sentence_listing_the_registered_ones():
    tree = {"rewards": [{"function": "exact_match"}]}
    with pytest.raises(ConfigError) as error:
        load_config(tree={**tree, "loss_type": "ppo"}, schema=GRPOConfig)
    message = str(error.value)
    assert "key 'loss_type'" in message and "unknown policy loss 'ppo'" in message, message
    registered = "registered are grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, gmpo, or name your own"
    assert registered in message
    assert message.count(". ") == 0, message  # one sentence
    with pytest.raises(ConfigError, match="registered are token_mean, token_mean_local, seq_mean_token_mean"):
        load_config(tree={**tree, "loss_aggregation": "seq-mean"}, schema=GRPOConfig)
