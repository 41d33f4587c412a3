"""Trainer/rollout consistency (engine/posttrain/rollout_correction.py):

- the gap metrics on log-probs whose values are worked out by hand;
- IcePop's token masks and the geometric-mean sequence masks select exactly the tokens and
  sequences expected, and equal verl's rejection-sampling masks (its lines, transcribed; verl is
  not a dependency; TRL 1.16 has neither mode, its four are tests/test_estimators.py's);
- a loss with those masks equals the loss with the masked tokens (sequences) taken out of the
  arrays, for every registered loss type;
- the config: IcePop's and verl's bounds by default, a bad mode or bounds refused;
- a tiny GRPO run logs the gap every step by default, and a bf16 rollout's gap is larger.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.models.config import ModelConfig
from engine.posttrain.config import GRPOConfig, RolloutCorrectionConfig
from engine.posttrain.grpo import corrected, loss_tokens, run_grpo
from engine.posttrain.policy_loss import policy_loss
from engine.posttrain.rollout_correction import mismatch_metrics, rollout_correction
from flows.gates import Gate
from flows.spec import Pipeline
from tests.deps import need
from tests.test_grpo import grpo_config, make_copy_task

torch = need("torch")


@pytest.fixture
def float64():
    with jax.enable_x64(True):
        yield


# --------------------------------------------------------------------------- hand-computed metrics

# Two completions, 3 and 2 tokens; the token ratios rho = pi / mu are 1, 2, 1/4 | 3/2, 4/5. The
# padding positions hold a huge gap and a NaN that must not count.
RHO = np.array([[1.0, 2.0, 0.25, 1.0], [1.5, 0.8, 1.0, 1.0]])
MASK = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
BEHAVIOUR = np.log(np.array([[0.5, 0.2, 0.4, 0.3], [0.1, 0.5, 0.6, 0.7]]))
TRAINER = BEHAVIOUR + np.log(RHO)
TRAINER[0, 3] += 50.0
BEHAVIOUR_PADDED = BEHAVIOUR.copy()
BEHAVIOUR_PADDED[1, 3] = np.nan


def test_the_ratios_spread_is_not_float32_rounding_where_the_ratios_are_one():
    """Ratios within 4e-7 of 1 (float32; 60 random batches of 8 rows of 3-39 tokens, half masked):
    the spread reads as the ratios' own (< 1e-6), not as the rounding of E[x^2] - E[x]^2
    (4.9e-4 for one of these batches; 3.5e-4 seen in a GRPO run)."""
    worst = 0.0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        shape = (8, int(rng.integers(3, 40)))
        behaviour = rng.uniform(-6.0, -0.5, shape).astype(np.float32)
        trainer = behaviour + (rng.uniform(0, 4e-7, shape) * rng.integers(0, 2, shape)).astype(np.float32)
        mask = rng.integers(0, 2, shape).astype(np.float32)
        m = mismatch_metrics(jnp.asarray(trainer), jnp.asarray(behaviour), jnp.asarray(mask))
        worst = max(worst, float(m["rollout_corr/rollout_is_std"]))
    assert worst < 1e-6


def test_the_gap_metrics_equal_their_hand_computed_values(float64):
    m = {k: float(v) for k, v in mismatch_metrics(TRAINER, BEHAVIOUR_PADDED, MASK).items()}
    logs = [0.0, math.log(2), math.log(0.25), math.log(1.5), math.log(0.8)]  # log rho of the 5 tokens
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(map(abs, logs)) / 5, rel=1e-12)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(4), rel=1e-12)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1 + 2 + 0.25 + 1.5 + 0.8) / 5, rel=1e-12)  # 1.11
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.25)
    # std of rho clamped to [1/2, 2]: 1, 2, 0.5, 1.5, 0.8 -> mean 1.16, E[w^2] 1.628, var 0.2824
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(1.628 - 1.16**2), rel=1e-9)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # 2 is not above c = 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.2)  # 1/4 < 1/2
    # k1 = E[-log rho] = -log(1 * 2 * 1/4 * 3/2 * 4/5) / 5 = -log(0.6) / 5
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(0.6) / 5, rel=1e-12)
    # k3 = E[rho - log rho - 1] = (5.55 - log 0.6 - 5) / 5
    assert m["rollout_corr/k3_kl"] == pytest.approx((0.55 - math.log(0.6)) / 5, rel=1e-12)


def test_the_gap_of_identical_log_probs_is_zero(float64):
    m = mismatch_metrics(BEHAVIOUR, BEHAVIOUR, MASK)
    assert float(m["sampling/sampling_logp_difference/max"]) == 0.0 and float(m["rollout_corr/k3_kl"]) == 0.0
    assert float(m["rollout_corr/rollout_is_min"]) == float(m["rollout_corr/rollout_is_max"]) == 1.0


# --------------------------------------------------------------------------- the masks


def test_icepop_removes_exactly_the_tokens_outside_its_bounds(float64):
    rho = RHO.copy()
    rho[1, 1] = 6.0  # above IcePop's beta = 5
    weights, keep, metrics = rollout_correction(BEHAVIOUR + np.log(rho), BEHAVIOUR, MASK, "icepop", 0.5, 5.0)
    expected = np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # 1/4 and 6 out; padding stays out
    np.testing.assert_array_equal(np.asarray(keep), expected)
    np.testing.assert_allclose(np.asarray(weights) * expected, rho * expected, rtol=1e-12)  # M(k) = k inside
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(2 / 5)


def test_the_geometric_mask_removes_exactly_the_sequences_outside_its_bounds(float64):
    # geometric means: (1 * 2 * 1/4) ** (1/3) = 0.794 and (3/2 * 4/5) ** (1/2) = 1.095
    for low, high, kept in ((0.9, 1.1, [False, True]), (0.7, 1.05, [True, False]), (0.5, 2.0, [True, True])):
        weights, keep, metrics = rollout_correction(TRAINER, BEHAVIOUR, MASK, "sequence_geometric_mask", low, high)
        np.testing.assert_array_equal(np.asarray(keep), MASK * np.array(kept, float)[:, None])
        np.testing.assert_array_equal(np.asarray(weights), np.ones((2, 1)))  # pure rejection, no weight
        assert float(metrics["is_ratio_min"]) == pytest.approx(min(0.5 ** (1 / 3), 1.2**0.5), rel=1e-12)


def verl_rejection_mask(log_ratio, response_mask, rollout_rs, upper, lower):
    """verl's rollout_corr_helper.compute_rollout_rejection_mask, its token and geometric lines."""
    if rollout_rs == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        mean = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1)
        weights = torch.exp(torch.clamp(mean.unsqueeze(-1), min=-20.0, max=20.0)).expand_as(log_ratio)
    mask = ((weights >= lower) & (weights <= upper)).float()
    return (response_mask * mask).numpy()


@pytest.mark.parametrize("mode, level", [("icepop", "token"), ("sequence_geometric_mask", "geometric")])
def test_the_masks_are_verls_rejection_masks(float64, mode, level):
    rng = np.random.default_rng(5)
    behaviour = np.log(rng.uniform(0.05, 0.9, (9, 7)))
    old = behaviour + rng.normal(0, 0.1 if level == "geometric" else 0.8, behaviour.shape)
    mask = (np.arange(7) < rng.integers(1, 8, 9)[:, None]).astype(float)
    low, high = (0.5, 5.0) if level == "token" else (0.97, 1.03)
    _, keep, _ = rollout_correction(old, behaviour, mask, mode, low, high)
    reference = verl_rejection_mask(torch.tensor(old - behaviour), torch.tensor(mask), level, high, low)
    np.testing.assert_array_equal(np.asarray(keep), reference)
    assert 0 < reference.sum() < mask.sum()  # some rejected, some kept


# --------------------------------------------------------------------------- the loss


def correction_config(mode, **bounds) -> GRPOConfig:
    tree = {"rewards": [{"function": "exact_match"}], "rollout_correction": {"mode": mode, **bounds}}
    return load_config(tree=tree, schema=GRPOConfig)


B, T, MAX_LEN = 6, 7, 9
rng = np.random.default_rng(11)
LOGP = np.log(rng.uniform(0.05, 0.9, (B, T)))
OLD = LOGP + rng.normal(0, 0.3, (B, T))
BEHAVIOUR_FAR = OLD + rng.normal(0, 0.7, (B, T))  # far enough that IcePop's [0.5, 5] removes some
REF = LOGP + rng.normal(0, 0.2, (B, T))
ADV = rng.normal(0, 1, B)
LENGTHS = np.array([7, 3, 5, 2, 6, 4])
LOSS_MASK = (np.arange(T) < LENGTHS[:, None]).astype(float)


def loss_and_grad(logp, old, ref, adv, mask, weights, total_tokens, loss_type, level):
    def loss(lp):
        return policy_loss(
            lp,
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            ref_logp_bt=jnp.asarray(ref),
            level=level,
            epsilon_low=0.2,
            epsilon_high=1.3 if loss_type == "cispo" else 0.28,
            beta=0.04,
            loss_type=loss_type,
            max_completion_length=MAX_LEN,
            total_tokens=total_tokens,
            is_weights=None if weights is None else jnp.asarray(weights),
        )[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp))
    return float(value), np.asarray(grad)


def compact(rows_bt, keep_bt):
    """Each row's kept tokens moved to its front: the arrays as if the others were never sampled."""
    out = np.zeros_like(rows_bt)
    for i, (row, keep) in enumerate(zip(rows_bt, keep_bt > 0)):
        out[i, : keep.sum()] = row[keep]
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_loss_with_icepop_equals_the_loss_without_the_masked_tokens(float64, loss_type, level):
    """The run's path (grpo.corrected, grpo.loss_tokens) against policy_loss on arrays from which
    the masked tokens are cut out, each kept token weighted by its ratio (IcePop's M(k) = k)."""
    cfg = correction_config("icepop")
    batch = {"completion_mask": jnp.asarray(LOSS_MASK), "old_logps": jnp.asarray(OLD)}
    batch["behaviour_logps"] = jnp.asarray(BEHAVIOUR_FAR)
    mask, weights, _ = corrected(cfg, batch)
    keep = np.asarray(mask)
    assert 0 < (LOSS_MASK - keep).sum() and (keep.sum(1) > 0).all()  # some removed, no sequence emptied
    value, grad = loss_and_grad(LOGP, OLD, REF, ADV, mask, weights, loss_tokens(cfg)(batch), loss_type, level)

    rho = np.exp(OLD - BEHAVIOUR_FAR)
    cut = {name: compact(x, keep) for name, x in (("logp", LOGP), ("old", OLD), ("ref", REF), ("rho", rho))}
    cut_mask = (np.arange(T) < keep.sum(1)[:, None]).astype(float)
    ref_value, ref_grad = loss_and_grad(
        cut["logp"], cut["old"], cut["ref"], ADV, cut_mask, cut["rho"], None, loss_type, level
    )
    assert value == pytest.approx(ref_value, rel=1e-12)
    np.testing.assert_allclose(compact(grad, keep), ref_grad * cut_mask, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(grad * (keep == 0), 0.0)  # a removed token gets no gradient


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "cispo"])
def test_a_token_mean_loss_with_the_geometric_mask_equals_the_loss_without_those_sequences(float64, loss_type):
    """(An aggregation that averages over sequences still counts a removed sequence as a zero.)"""
    cfg = correction_config("sequence_geometric_mask", clip_min=0.9, clip_max=1.1)
    batch = {
        "completion_mask": jnp.asarray(LOSS_MASK),
        "old_logps": jnp.asarray(OLD),
        "behaviour_logps": jnp.asarray(BEHAVIOUR_FAR),
    }
    mask, weights, _ = corrected(cfg, batch)
    kept = np.asarray(mask).sum(1) > 0
    assert 0 < kept.sum() < B
    value, grad = loss_and_grad(LOGP, OLD, REF, ADV, mask, weights, loss_tokens(cfg)(batch), loss_type, "token")
    rows = [x[kept] for x in (LOGP, OLD, REF, ADV, LOSS_MASK)]
    ref_value, ref_grad = loss_and_grad(*rows, None, None, loss_type, "token")
    assert value == pytest.approx(ref_value, rel=1e-12)
    np.testing.assert_allclose(grad[kept], ref_grad, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(grad[~kept], 0.0)


# --------------------------------------------------------------------------- the config


def test_icepop_and_the_geometric_mask_take_their_references_bounds_unless_given():
    assert (RolloutCorrectionConfig(mode="icepop").clip_min, RolloutCorrectionConfig(mode="icepop").clip_max) == (
        0.5,
        5.0,
    )
    geometric = RolloutCorrectionConfig(mode="sequence_geometric_mask")
    assert (geometric.clip_min, geometric.clip_max) == (0.999, 1.001)
    assert RolloutCorrectionConfig(mode="icepop", clip_max=3.0).clip_max == 3.0
    assert RolloutCorrectionConfig(mode="icepop", clip_min=None).clip_min is None
    assert (RolloutCorrectionConfig().clip_min, RolloutCorrectionConfig().clip_max) == (None, 3.0)  # TRL's


def test_an_unknown_mode_or_crossed_bounds_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="unknown rollout correction 'icepo'.*icepop, sequence_geometric_mask"):
        correction_config("icepo")
    with pytest.raises(ConfigError, match=r"clip_min \(2.0\) must not exceed clip_max \(1.5\)"):
        correction_config("token_mask", clip_min=2.0, clip_max=1.5)


USER_CORRECTION = """
import jax.numpy as jnp


def keep_the_likelier(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(log_ratio_bt)
    return ratio, jnp.ones_like(ratio), log_ratio_bt >= 0  # drop tokens the trainer finds less likely
"""


def test_a_user_correction_runs_is_found_at_plan_time_and_its_source_is_part_of_the_id(
    tiny_task, tmp_path, monkeypatch, float64
):
    def plan():
        p = Pipeline("user-correction", store=tmp_path / "store")
        base = p.stage("base", task="test-checkpoint-copy", config={"path": str(tiny_task)})
        config = {
            "data": {"path": str(tiny_task / "prompts.jsonl")},
            "rewards": [{"function": "exact_match"}],
            "rollout_correction": {"mode": "my_correction:keep_the_likelier"},
        }
        p.stage("grpo", task="grpo", inputs={"checkpoint": base}, config=config)
        return p.plan().stages["grpo"].job.artifact_id

    with pytest.raises(ConfigError, match=r"key 'rollout_correction.mode': cannot find module 'my_correction'"):
        plan()
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "my_correction.py"
    module.write_text(USER_CORRECTION)
    first = plan()
    module.write_text(module.read_text() + "# edited\n")
    assert plan() != first
    _, keep, metrics = rollout_correction(TRAINER, BEHAVIOUR, MASK, "my_correction:keep_the_likelier")
    np.testing.assert_array_equal(np.asarray(keep), [[1, 1, 0, 0], [1, 0, 0, 0]])  # rho 1, 2, 1/4 | 3/2, 4/5
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(2 / 5)


# --------------------------------------------------------------------------- a run

GAP = [
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_min",
    "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_std",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
]


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    cfg = ModelConfig(
        vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=24, max_seq_len=8
    )
    return make_copy_task(tmp_path_factory.mktemp("tiny_task"), cfg)


def test_a_grpo_run_logs_the_rollout_trainer_gap_every_step_by_default(tiny_task, tmp_path):
    """The engine's KV-cache sampler against the trainer's forward, on-policy, no correction
    configured: the gap is logged each step; in float32 it is rounding, a bf16 rollout's is not."""
    gaps, finals = {}, {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        finals[dtype] = run_grpo(
            grpo_config(tiny_task, out, steps=2, prompts_per_step=2, num_generations=4, rollout_dtype=dtype)
        )
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(set(GAP) <= set(r) for r in records)
        for r in records:
            assert (
                r["rollout_corr/rollout_is_min"]
                <= r["rollout_corr/rollout_is_mean"]
                <= r["rollout_corr/rollout_is_max"]
            )
            assert r["rollout_corr/k3_kl"] >= 0 and "is_ratio_mean" not in r  # on-policy: no correction metrics
        gaps[dtype] = max(r["sampling/sampling_logp_difference/max"] for r in records)
        # The stage's final metrics carry the worst step's gap, for a pipeline gate.
        final = finals[dtype]
        assert final["rollout_divergence/worst_logp_difference_max"] == gaps[dtype]
        assert final["rollout_divergence/worst_k3_kl"] == max(r["rollout_corr/k3_kl"] for r in records)
        assert final["rollout_divergence/worst_fraction_past_threshold"] == max(
            r["rollout_corr/rollout_is_ratio_fraction_high"] + r["rollout_corr/rollout_is_ratio_fraction_low"]
            for r in records
        )
        assert final["rollout_divergence/steps"] == 2
    assert gaps["float32"] < 1e-4 < gaps["bfloat16"], gaps
    # A gate over the bf16 run's summary stops what follows it past a bound, and lets it run below.
    gate = Gate('grpo.metrics["rollout_divergence/worst_logp_difference_max"] < 1e-4', "p.yaml: stages.export.when")
    manifests = {dtype: {"metrics": final} for dtype, final in finals.items()}
    assert gate.evaluate(lambda stage: manifests["float32"], {"grpo": "grpo"})[0]
    passed, seen = gate.evaluate(lambda stage: manifests["bfloat16"], {"grpo": "grpo"})
    assert not passed and seen == {gate.references[0].text: gaps["bfloat16"]}
