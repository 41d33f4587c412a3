"""GRPO/GSPO: the objective against NumPy references of the published formulas, advantage
golden values, rewards, and a small verifiable task on which mean reward rises."""

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.copy_task import DIGITS, write_copy_task
from engine.config import ConfigError, Strict, load_config
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import graphdef_of
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import make_loss_fn, policy_objective, run_grpo
from engine.posttrain.policy_loss import group_advantages, policy_loss
from engine.posttrain.rewards import RewardError, RewardSpec, compute_rewards, load_reward, total_reward
from engine.train.checkpoint import load_params, read_meta
from engine.train.step import make_train_step
from flows.spec import Pipeline
from tasks.registry import StageContext, StageKind, register_stage
from tests.conftest import child_xla_flags

# --------------------------------------------------------------------------- NumPy references

rng = np.random.default_rng(0)
B, T = 4, 6
LOGP = np.log(rng.uniform(0.05, 0.9, (B, T)))
OLD = LOGP + rng.normal(0, 0.3, (B, T))  # ratios far enough from 1 that clipping happens
REF = LOGP + rng.normal(0, 0.2, (B, T))
ADV = np.array([1.3, -0.7, 0.4, -1.1])
MASK = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], float)
EPS_LOW, EPS_HIGH, BETA, MAX_LEN = 0.2, 0.28, 0.04, 8


def reference_loss(loss_type, level, beta=0.0, logp=LOGP, old=OLD, mask=MASK, adv=ADV, total_tokens=None):
    """The published formulas, written out with NumPy."""
    if level == "token":
        ratio = np.exp(logp - old)
    else:  # GSPO: exp of the length-normalised sequence log-ratio, shared by the sequence's tokens
        seq = (((logp - old) * mask).sum(1) / mask.sum(1))[:, None]
        ratio = np.broadcast_to(np.exp(seq), logp.shape)
    clipped = np.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token = -np.minimum(ratio * adv[:, None], clipped * adv[:, None])
    if beta:
        per_token = per_token + beta * (np.exp(REF - logp) - (REF - logp) - 1)
    if loss_type == "grpo":
        return np.mean((per_token * mask).sum(1) / mask.sum(1))
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (len(mask) * MAX_LEN)
    return (per_token * mask).sum() / (mask.sum() if total_tokens is None else total_tokens)  # dapo


def loss_of(loss_type, level, beta=0.0, **kwargs):
    return policy_loss(
        jnp.asarray(LOGP),
        jnp.asarray(OLD),
        jnp.asarray(ADV),
        jnp.asarray(MASK),
        ref_logp_bt=jnp.asarray(REF),
        level=level,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
        **kwargs,
    )


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_and_ratio_level_matches_the_numpy_reference(loss_type, level):
    ref_level = "token" if level == "token" else "sequence"  # GSPO-token has GSPO's value
    for beta in (0.0, BETA):
        loss, metrics = loss_of(loss_type, level, beta)
        np.testing.assert_allclose(float(loss), reference_loss(loss_type, ref_level, beta), rtol=1e-5)
    assert 0 < float(metrics["clip_ratio"]) < 1  # the fixture does exercise clipping


def test_the_gspo_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio():
    _, metrics = loss_of("grpo", "sequence")
    seq = np.exp(((LOGP - OLD) * MASK).sum(1) / MASK.sum(1))
    np.testing.assert_allclose(float(metrics["ratio_mean"]), seq.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["ratio_max"]), seq.max(), rtol=1e-5)


def test_gspo_token_has_the_sequence_ratios_value_but_per_token_gradients():
    def grad(level):
        fn = lambda logp: policy_loss(
            logp,
            jnp.asarray(OLD),
            jnp.asarray(ADV),
            jnp.asarray(MASK),
            level=level,  # noqa: E731
            loss_type="grpo",
            epsilon_low=10.0,
            epsilon_high=10.0,
        )[0]
        return np.asarray(jax.grad(fn)(jnp.asarray(LOGP)))

    # Unclipped: d/dlogp_t of GSPO's A * exp(mean log-ratio) is ratio * A / |o|, the same
    # for every token of a sequence; GSPO-token weights each token's own log-prob by it.
    seq_ratio = np.exp(((LOGP - OLD) * MASK).sum(1) / MASK.sum(1))
    expected = -(seq_ratio * ADV / MASK.sum(1))[:, None] * MASK / len(MASK)
    np.testing.assert_allclose(grad("sequence"), expected, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(grad("sequence_token"), expected, rtol=1e-5, atol=1e-8)


def test_with_one_update_per_rollout_and_no_kl_the_ratio_is_exactly_one():
    for level in ("token", "sequence", "sequence_token"):
        loss, metrics = policy_loss(
            jnp.asarray(LOGP), None, jnp.asarray(ADV), jnp.asarray(MASK), level=level, loss_type="bnpo"
        )
        assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0
        assert float(metrics["clip_ratio"]) == 0.0
        # ... so the loss is -mean(A) over tokens, and its gradient the plain policy gradient.
        np.testing.assert_allclose(float(loss), -(ADV[:, None] * MASK).sum() / MASK.sum(), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_normalises_each_loss_type_as_trl_does(loss_type):
    """Two micro-batches: dapo equals the unsplit batch; the others average per-micro-batch losses."""
    identity = lambda params, batch, total: policy_loss(  # noqa: E731
        batch["logp"] + params["shift"],
        batch["old"],
        batch["adv"],
        batch["mask"],
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
        total_tokens=total,
        accumulation_steps=2,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
    )
    import optax

    step = make_train_step(
        policy_objective(lambda p, b, total: identity(p, {**b, "completion_mask": b["mask"]}, total)),
        optax.sgd(0.0),
        grad_accum=2,
    )
    batch = {"logp": LOGP, "old": OLD, "adv": ADV, "mask": MASK, "completion_mask": MASK}
    _, _, metrics = step(
        {"shift": jnp.zeros(())}, optax.sgd(0.0).init({"shift": jnp.zeros(())}), jax.tree.map(jnp.asarray, batch)
    )
    halves = [np.arange(0, B, 2), np.arange(1, B, 2)]  # rows i, i+2: the micro-batches
    if loss_type == "dapo":
        expected = reference_loss("dapo", "token")
    else:
        expected = np.mean(
            [reference_loss(loss_type, "token", logp=LOGP[h], old=OLD[h], mask=MASK[h], adv=ADV[h]) for h in halves]
        )
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


# --------------------------------------------------------------------------- advantages and rewards


def test_group_advantages_golden_values():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of G = 4
    valid = np.ones(8, bool)
    group, std = group_advantages(rewards, valid, 4, "group")
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: no spread.
    s = math.sqrt(1 / 3)
    np.testing.assert_allclose(
        group, [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0, 0, 0, 0], rtol=1e-6
    )
    np.testing.assert_allclose(std, [s, 0.0], rtol=1e-6)
    batch, _ = group_advantages(rewards, valid, 4, "batch")
    batch_std = np.std(rewards, ddof=1)  # 0.9258...: group means, batch std (TRL scale_rewards=batch)
    np.testing.assert_allclose(
        batch,
        [
            0.5 / (batch_std + 1e-4),
            -0.5 / (batch_std + 1e-4),
            -0.5 / (batch_std + 1e-4),
            0.5 / (batch_std + 1e-4),
            0,
            0,
            0,
            0,
        ],
        rtol=1e-6,
    )
    none, _ = group_advantages(rewards, valid, 4, "none")
    np.testing.assert_allclose(none, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_an_unscorable_completion_gets_zero_advantage_and_leaves_its_groups_statistics():
    rewards = np.array([1.0, 0.0, 5.0, 1.0])
    valid = np.array([True, True, False, True])
    advantages, _ = group_advantages(rewards, valid, 4, "none")
    np.testing.assert_allclose(advantages, [1 / 3, -2 / 3, 0.0, 1 / 3])


def test_builtin_rewards_and_a_user_function_with_weights(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shorter(prompts, completions, completion_ids, **kwargs):\n"
        "    return [None if c == '?' else -len(c) for c in completions]\n"
        "def broken(prompts, completions, **kwargs):\n"
        "    raise ValueError('no luck')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = [
        RewardSpec(function="exact_match", kwargs={"pattern": r"#### (\S+)"}),
        RewardSpec(function="numeric_match", kwargs={"tolerance": 0.01}),
        RewardSpec(function="regex", kwargs={"pattern": r"\d+"}),
        RewardSpec(function="my_rewards:shorter", weight=0.5),
    ]
    loaded = [(*load_reward(s), s) for s in specs]
    assert [name for name, _, _ in loaded] == ["exact_match", "numeric_match", "regex", "shorter"]
    completions = ["so #### 42", "3.999", "?", "#### 4"]
    per_function = compute_rewards(
        loaded,
        prompts=["p"] * 4,
        completions=completions,
        completion_ids=[[1]] * 4,
        columns={"answer": ["42", "4", "4", "4.0"]},
        max_completion_length=8,
        step=0,
    )
    np.testing.assert_array_equal(per_function[:, 0], [1, 0, 0, 0])  # "4" != "4.0" as text
    np.testing.assert_array_equal(per_function[:, 1], [1, 1, 0, 1])
    np.testing.assert_array_equal(per_function[:, 2], [0, 0, 0, 0])  # fullmatch of digits only: none
    assert np.isnan(per_function[2, 3]) and per_function[0, 3] == -10
    total, valid = total_reward(per_function, [1.0, 1.0, 1.0, 0.5])
    # TRL's rule: a function that returned None is left out of that completion's sum; only a
    # completion no function scored is dropped.
    np.testing.assert_allclose(total, [2 - 5, 1 - 2.5, 0, 1 - 3])
    np.testing.assert_array_equal(valid, [True, True, True, True])
    none_scored = np.array([[np.nan, np.nan], [1.0, np.nan], [np.nan, 2.0]])
    total, valid = total_reward(none_scored, [1.0, 0.5])
    np.testing.assert_allclose(total, [0.0, 1.0, 1.0])
    np.testing.assert_array_equal(valid, [False, True, True])

    failing = RewardSpec(function="my_rewards:broken")
    with pytest.raises(RewardError, match="reward function 'broken' raised ValueError: no luck"):
        compute_rewards(
            [(*load_reward(failing), failing)],
            prompts=["p"],
            completions=["c"],
            completion_ids=[[1]],
            columns={},
            max_completion_length=8,
            step=0,
        )
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_reward(RewardSpec(function="exact_mach"))


def test_length_penalty_is_dapos_soft_overlong_ramp():
    from engine.posttrain.rewards import length_penalty

    ids = [[0] * n for n in (4, 6, 7, 8, 9)]
    assert length_penalty(ids, max_completion_length=8, buffer=2) == [0.0, 0.0, -0.5, -1.0, -1.0]


# --------------------------------------------------------------------------- learning


@pytest.fixture(scope="module")
def copy_task(tmp_path_factory) -> Path:
    """A checkpoint artifact (random 2-layer model, character tokenizer) and prompts 'd=' whose
    verifiable answer is the digit d: the policy must learn to copy a token."""
    return make_copy_task(
        tmp_path_factory.mktemp("copy_task"),
        ModelConfig(
            vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=16
        ),
    )


def make_copy_task(out: Path, cfg: ModelConfig) -> Path:
    """The copy task ('d=' -> 'd') beside the model's initial checkpoint (bench/copy_task.py)."""
    return write_copy_task(out, cfg)


def grpo_config(task: Path, out: Path, **overrides) -> GRPOConfig:
    tree = {
        "checkpoint": {
            "init_from": str(task / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 100,
            "async_save": False,
        },
        "data": {"path": str(task / "prompts.jsonl")},
        "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
        "optimizer": {"learning_rate": 2e-2},
        "prompts_per_step": 10,
        "num_generations": 16,
        "max_prompt_length": 2,
        "max_completion_length": 2,
        "steps": 15,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=GRPOConfig)


def rewards_logged(out: Path) -> list[float]:
    return [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm, rollout_dtype", [("grpo", "float32"), ("gspo", "bfloat16")])
def test_mean_reward_rises_on_a_verifiable_copy_task(copy_task, tmp_path, algorithm, rollout_dtype):
    """(bf16 rollouts: the sampler's bf16 copy of the policy; the ratios stay the training forward's.)"""
    result = run_grpo(grpo_config(copy_task, tmp_path, algorithm=algorithm, rollout_dtype=rollout_dtype))
    curve = rewards_logged(tmp_path)
    first, last = np.mean(curve[:3]), np.mean(curve[-3:])
    assert first < 0.25 and last > first + 0.4, curve  # chance is 1/16
    assert result["ratio_min"] == result["ratio_max"] == 1.0  # mu = 1, beta = 0
    assert read_meta(tmp_path / "checkpoint")[1]["stage"] == "grpo"


def test_grpo_on_a_mixture_of_experts_learns_with_its_router_losses(tmp_path):
    """A Mixtral-shaped policy (4 experts, top 2): reward rises, the router's losses are part of
    the minimised objective (as in pretraining) and logged with each expert's load, and the
    result keeps the architecture."""
    cfg = ModelConfig(
        family="mixtral",
        vocab_size=16,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        max_seq_len=16,
        num_experts=4,
        experts_per_token=2,
    )
    task = make_copy_task(tmp_path / "task", cfg)
    result = run_grpo(grpo_config(task, tmp_path / "run", algorithm="grpo"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [r["reward"] for r in records]
    assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.4, curve
    assert all(0 < r["moe_balance_loss"] < 4 and r["moe_router_z_loss"] > 0 for r in records)
    assert sum(records[-1][f"moe_load/{e}"] for e in range(4)) == pytest.approx(1.0, abs=1e-4)
    assert result["ratio_min"] == result["ratio_max"] == 1.0
    saved_cfg, params, _ = load_params(tmp_path / "run" / "checkpoint")
    assert saved_cfg == cfg

    # With every advantage 0 the policy term and its gradient vanish: what is left of the
    # objective is the router's, 0.01 * balance + 0.001 * z (the defaults), and it trains the router
    # (the trained policy's parameters; jitted: op by op this gradient took ~30 s).
    graphdef = graphdef_of(cfg, ComputeConfig())
    rows = np.random.default_rng(0).integers(2, 16, (4, 4)).astype(np.int32)
    batch = {
        "tokens": jnp.asarray(rows),
        "segment_ids": jnp.ones((4, 4), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(4), (4, 4)),
        "completion_mask": jnp.ones((4, 2)),
        "advantages": jnp.zeros((4, 1)),
    }
    loss_fn = make_loss_fn(graphdef, grpo_config(task, tmp_path / "unit"), prompt_len=2)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, 8.0)
    router = 0.01 * metrics["moe_balance_loss"] + 0.001 * metrics["moe_router_z_loss"]
    assert float(loss) == pytest.approx(float(router), rel=1e-6) and float(router) > 0
    router_grads = [
        g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "w_router_de" in jax.tree_util.keystr(path)
    ]
    assert router_grads and all(float(jnp.abs(g).max()) > 0 for g in router_grads)


def test_mu_updates_use_the_old_policy_and_kl_to_a_reference_then_resume(copy_task, tmp_path):
    overrides = {
        "algorithm": "gspo",
        "gspo_variant": "token",
        "num_iterations": 2,
        "beta": 0.04,
        "grad_accum": 2,
        "loss_type": "grpo",
        "epsilon_high": 0.28,
        "prompts_per_step": 4,
        "num_generations": 4,
    }
    first = run_grpo(grpo_config(copy_task, tmp_path, steps=2, **overrides))
    # The second update of a rollout batch sees params the first one moved: ratios leave 1.
    assert first["ratio_max"] > 1.0 or first["ratio_min"] < 1.0
    assert first["kl"] > 0 and math.isfinite(first["entropy"]) and first["steps"] == 2
    logs = []
    resumed = run_grpo(grpo_config(copy_task, tmp_path, steps=3, **overrides), log=logs.append)
    assert any("resumed from checkpoint step 2" in line for line in logs) and resumed["steps"] == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# --------------------------------------------------------------------------- stage kinds


class _CheckpointCopyConfig(Strict):
    path: str


class _CheckpointCopy(StageKind):
    """A checkpoint artifact made by copying one (stands in for pretrain/convert here)."""

    task = "test-checkpoint-copy"
    output = "checkpoint"
    config_schema = _CheckpointCopyConfig

    def run(self, ctx: StageContext) -> dict:
        for name in ("checkpoint", "tokenizer"):
            shutil.copytree(Path(ctx.config.path) / name, ctx.out_dir / name)
        return {}


# Other test modules import this one as tests.test_grpo beside pytest's own import of it:
# the second class object replaces the first (the same stage kind).
register_stage(_CheckpointCopy, replace=True)


def post_training_pipeline(task: Path, store: Path, sft_data: Path) -> Pipeline:
    one_device = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}  # one device, compiled as here
    p = Pipeline("post", store=store)
    base = p.stage("base", task="test-checkpoint-copy", config={"path": str(task)})
    sft = p.stage(
        "sft",
        task="sft",
        inputs={"checkpoint": base},
        launcher=one_device,
        config={"data": {"path": str(sft_data), "seq_len": 8, "batch_size": 4}, "steps": 2, "log_every": 1},
    )
    p.stage(
        "grpo",
        task="grpo",
        inputs={"checkpoint": sft},
        launcher=one_device,
        config={
            "algorithm": "gspo",
            "data": {"path": str(task / "prompts.jsonl")},
            "steps": 2,
            "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
            "prompts_per_step": 2,
            "num_generations": 4,
            "max_prompt_length": 2,
            "max_completion_length": 2,
        },
    )
    return p


@pytest.mark.slow
def test_the_examples_of_sft_and_grpo_stages_are_part_of_their_ids(copy_task, tmp_path):
    """New data: new sft and grpo artifacts, the base stays (running them is
    tests/test_bucket_posttrain.py's SFT -> GRPO pipeline)."""
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"prompt": f"{d}=", "completion": d}) + "\n" for d in DIGITS))
    plan = post_training_pipeline(copy_task, tmp_path / "store", sft_data).plan()
    sft_data.write_text(sft_data.read_text() + json.dumps({"prompt": "1=", "completion": "1"}) + "\n")
    changed = post_training_pipeline(copy_task, tmp_path / "store", sft_data).plan()
    assert [changed.stages[s].job.artifact_id == plan.stages[s].job.artifact_id for s in ("base", "sft", "grpo")] == [
        True,
        False,
        False,
    ]


def test_stage_configs_are_checked_before_anything_runs(copy_task, tmp_path):
    p = Pipeline("bad", store=tmp_path)
    base = p.stage("base", task="test-checkpoint-copy", config={"path": str(copy_task)})
    p.stage(
        "grpo",
        task="grpo",
        inputs={"checkpoint": base},
        config={"data": {"path": str(copy_task / "prompts.jsonl")}, "rewards": [{"function": "exact_mach"}]},
    )
    with pytest.raises(ConfigError, match=r"rewards.0.function': 'exact_mach' is neither a built-in"):
        p.plan()
    p = Pipeline("bad", store=tmp_path)
    base = p.stage("base", task="test-checkpoint-copy", config={"path": str(copy_task)})
    p.stage(
        "sft",
        task="sft",
        inputs={"checkpoint": base},
        config={"data": {"path": str(copy_task / "prompts.jsonl")}, "checkpoint": {"init_from": "/elsewhere"}},
    )
    with pytest.raises(ConfigError, match=r"key 'checkpoint.init_from' is set by the pipeline"):
        p.plan()


def test_kl_at_positions_after_eos_cannot_make_the_loss_or_its_gradient_nan():
    """A padded position whose log-ratio is huge (garbage logits past EOS) is masked before exp."""
    logp = jnp.asarray(LOGP, jnp.float32)
    ref = jnp.asarray(LOGP, jnp.float32).at[:, -1].set(800.0)  # exp(800) overflows float32
    mask = jnp.asarray(MASK, jnp.float32).at[:, -1].set(0.0)

    def loss(shift):
        return policy_loss(
            logp + shift,
            None,
            jnp.asarray(ADV),
            mask,
            ref_logp_bt=ref,
            beta=0.04,
            loss_type="bnpo",
            max_completion_length=MAX_LEN,
        )[0]

    value, grad = jax.value_and_grad(loss)(jnp.zeros(()))
    assert np.isfinite(float(value)) and np.isfinite(float(grad))


def test_frac_reward_zero_std_follows_the_std_the_advantages_are_scaled_by():
    rewards = np.array([1.0, 1.0, 0.0, 1.0])  # group 1 has no spread, group 2 has
    valid = np.ones(4, bool)
    _, group_std = group_advantages(rewards, valid, 2, "group")
    assert np.isclose(group_std, 0.0).tolist() == [True, False]
    _, batch_std = group_advantages(rewards, valid, 2, "batch")  # TRL: the batch std, for every row
    assert np.isclose(batch_std, 0.0).tolist() == [False, False]


def test_grpo_on_a_context_parallel_mesh_equals_data_parallel(copy_task, tmp_path):
    """Rollouts, rewards and updates with each row's positions split over `context` (data 2 x
    context 2 x tensor 2) give what data parallelism over the same 8 devices gives."""
    runs = {}
    for name, mesh in (("data", {"mesh.data": 8}), ("context", {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2})):
        run_grpo(grpo_config(copy_task, tmp_path / name, steps=3, **mesh))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [
            {
                k: v
                for k, v in r.items()
                if isinstance(v, float)
                and not k.endswith(("_seconds", "tokens_per_second", "tflops_per_device", "mfu"))
            }
            for r in records
        ]
    assert len(runs["data"]) == 3 and runs["data"][0].keys() == runs["context"][0].keys()
    assert {"loss", "reward", "grad_norm"} <= runs["data"][0].keys(), runs["data"][0].keys()
    for a, b in zip(runs["data"], runs["context"]):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
