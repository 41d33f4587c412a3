"""KTO (unpaired feedback): the loss, its gradient and its KL estimate against TRL's own
`KTOTrainer._compute_loss`; TRL's KL-completion rotation; bad records and configs refused in
one sentence; a stage that learns a task whose desirable answer is known; the `kto` stage
kind in a pipeline with its reference input."""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.data.tokenizer import load_saved
from engine.posttrain.kto import example_rows, kto_losses, run_kto, tokenize_example, with_kl_completions
from engine.posttrain.kto_config import KTOConfig
from tests.deps import need
from tests.test_dpo import NAMES, ONE_DEVICE_ENV
from tests.test_lora_train import base  # noqa: F401  (a tiny checkpoint artifact, init std 0.25)

torch = need("torch")
need("trl")

from trl import KTOTrainer  # noqa: E402

ROWS, TOKENS = 7, 6  # odd sizes; per-token arrays are (ROWS, TOKENS)


@pytest.fixture
def float64():
    with jax.enable_x64(True):
        yield


def random_batch(seed: int) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    label = rng.random(ROWS) < 0.5
    label[:2] = [True, False]  # both kinds present
    position = np.arange(TOKENS + 1)

    def sequences():
        prompt_len = rng.integers(1, 3, ROWS)
        end = prompt_len + rng.integers(1, TOKENS + 1 - prompt_len + 1)
        completion = (position >= prompt_len[:, None]) & (position < end[:, None])
        return rng.integers(0, 17, (ROWS, TOKENS + 1)), position < end[:, None], completion

    ids, attention, completion = sequences()
    kl_ids, kl_attention, kl_completion = sequences()
    mask_bt, kl_mask_bt = completion[:, 1:].astype(float), kl_completion[:, 1:].astype(float)
    log_probs_bt, kl_log_probs_bt = -rng.exponential(1.0, (ROWS, TOKENS)), -rng.exponential(1.0, (ROWS, TOKENS))
    return SimpleNamespace(
        label=label,
        ids=ids,
        attention=attention,
        completion=completion,
        kl_ids=kl_ids,
        kl_attention=kl_attention,
        kl_completion=kl_completion,
        mask_bt=mask_bt,
        kl_mask_bt=kl_mask_bt,
        log_probs_bt=log_probs_bt,
        kl_log_probs_bt=kl_log_probs_bt,
        # the reference a few nats off, so the sigmoids are not saturated; z0 is positive for odd
        # seeds and clamped to 0 for even ones
        ref=(log_probs_bt * mask_bt).sum(-1) + rng.normal(0.0, 2.0, ROWS),
        ref_kl=(kl_log_probs_bt * kl_mask_bt).sum(-1) + rng.normal((-1.0) ** seed, 0.5, ROWS),
    )


def trl_kto(batch, loss_type, *, beta, desirable_weight, undesirable_weight):
    """TRL's loss, d loss / d per-token log-probs, and its metrics, on a stand-in `self` whose
    model is TRL's fused LM head: per-token log-probs, zero where the label is -100."""
    log_probs_bt = torch.tensor(batch.log_probs_bt, requires_grad=True)
    kl_ids = torch.tensor(batch.kl_ids)

    def model(*, input_ids, labels, fused_lm_head, **kwargs):
        leaf = torch.tensor(batch.kl_log_probs_bt) if input_ids is kl_ids else log_probs_bt
        keep = labels[:, 1:] != -100
        zeros = torch.zeros_like(leaf)
        return SimpleNamespace(log_probs=leaf * keep, entropy=zeros, mean_logits=zeros)

    me = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        calculate_KL=loss_type == "kto",
        loss_type=loss_type,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    me._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, me)
    inputs = {
        "input_ids": torch.tensor(batch.ids),
        "attention_mask": torch.tensor(batch.attention, dtype=torch.long),
        "completion_mask": torch.tensor(batch.completion, dtype=torch.long),
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.tensor(batch.kl_attention, dtype=torch.long),
        "KL_completion_mask": torch.tensor(batch.kl_completion, dtype=torch.long),
        "label": torch.tensor(batch.label),
        "ref_logps": torch.tensor(batch.ref),
        "ref_KL_logps": torch.tensor(batch.ref_kl),
    }
    loss = KTOTrainer._compute_loss(me, model, inputs, return_outputs=False)
    (grad,) = torch.autograd.grad(loss, log_probs_bt)
    return loss.item(), grad.numpy(), {k: v[-1] for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("beta,weights", [(0.1, (1.0, 1.0)), (0.5, (1.0, 1.33)), (2.0, (0.7, 1.0))])
def test_kto_loss_gradient_and_kl_match_trl(float64, loss_type, beta, weights):
    """kto_losses (what the training step sums over a micro-batch and divides by its examples)
    equals TRL's loss and gradient w.r.t. the per-token log-probs; z0 is TRL's logged kl."""
    seen_kl = []
    for seed in range(4):
        batch = random_batch(seed)
        trl_loss, trl_grad, metrics = trl_kto(
            batch, loss_type, beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1]
        )

        def loss_fn(log_probs_bt):
            losses, kl = kto_losses(
                (log_probs_bt * batch.mask_bt).sum(-1),  # noqa: B023
                jnp.asarray((batch.kl_log_probs_bt * batch.kl_mask_bt).sum(-1)),  # noqa: B023
                jnp.asarray(batch.ref),  # noqa: B023
                jnp.asarray(batch.ref_kl),  # noqa: B023
                jnp.asarray(batch.label, jnp.float64),  # noqa: B023
                jnp.ones(ROWS),
                beta=beta,
                loss_type=loss_type,
                desirable_weight=weights[0],
                undesirable_weight=weights[1],
            )
            return losses.sum() / ROWS, kl

        (loss, kl), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(batch.log_probs_bt))
        np.testing.assert_allclose(float(loss), trl_loss, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(grad), trl_grad, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(float(kl), metrics["kl"], rtol=1e-12, atol=1e-14)
        rewards = beta * ((batch.log_probs_bt * batch.mask_bt).sum(-1) - batch.ref)
        np.testing.assert_allclose(rewards[batch.label].mean(), metrics["rewards/chosen"], rtol=1e-12)
        np.testing.assert_allclose(rewards[~batch.label].mean(), metrics["rewards/rejected"], rtol=1e-12)
        seen_kl.append(float(kl))
    if loss_type == "kto":
        assert min(seen_kl) == 0.0 < max(seen_kl), seen_kl  # the clamp at 0 and a positive estimate both checked


def test_kl_completions_are_trls_rotation_within_each_micro_batch():
    """TRL: (x_1, y_1) ... (x_n, y_n) -> (x_1, y_n), (x_2, y_1), ..., per batch of the file's order."""
    examples = [([1, 2], [10 + i, 20 + i], i % 2 == 0) for i in range(7)]
    rows = with_kl_completions(examples, group=3, calculate_kl=True, max_length=8)
    completions = [e[1] for e in examples]
    expected = []
    for start in range(0, 7, 3):
        chunk = completions[start : start + 3]
        expected += [chunk[-1]] + chunk[:-1]  # TRL's add_kl_completion_ids
    assert [r.rejected.tolist() for r in rows] == expected
    assert [r.chosen.tolist() for r in rows] == completions and [r.label for r in rows] == [e[2] for e in examples]
    cut = with_kl_completions([([1] * 5, [2] * 3, True), ([1] * 2, [3] * 6, False)], 2, True, max_length=8)
    assert cut[0].rejected.tolist() == [3] * 3  # the KL completion keeps what max_length leaves after the prompt
    assert [len(r.rejected) for r in with_kl_completions(examples, 3, False, 8)] == [0] * 7  # apo_zero_unpaired
    rows_np = example_rows(rows[:3], 8)
    assert rows_np["label"].tolist() == [[1.0], [0.0], [1.0]] and rows_np["tokens"].shape == (3, 16)


# --------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def feedback(tmp_path_factory) -> Path:
    """'colour i:' with the i-th colour desirable and another one undesirable, unpaired and shuffled."""
    path = tmp_path_factory.mktemp("kto-data") / "feedback.jsonl"
    rng = np.random.default_rng(0)
    records = []
    for i in range(96):
        right = i % 3
        good = rng.random() < 0.5
        colour = right if good else (right + 1 + rng.integers(0, 2)) % 3
        records.append({"prompt": f"colour {right}:", "completion": f" {NAMES[colour]}", "label": bool(good)})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def kto_config(base: Path, out: Path, data: Path, **overrides) -> KTOConfig:
    tree = {
        "checkpoint": {"init_from": str(base / "checkpoint"), "directory": str(out / "checkpoint")}
        | {"every_steps": 10, "async_save": False},
        "data": {"path": str(data), "max_prompt_length": 8, "max_length": 16, "batch_size": 8, "eval_fraction": 0.25},
        "optimizer": {"learning_rate": 1e-3},
        "schedule": {"kind": "constant"},
        "steps": 12,
        "log_every": 4,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=KTOConfig)


def test_kto_learns_which_completion_is_desirable(base, feedback, tmp_path):
    before = run_kto(kto_config(base, tmp_path / "zero", feedback, steps=1, **{"optimizer.learning_rate": 1e-12}))
    after = run_kto(
        kto_config(
            base,
            tmp_path / "kto",
            feedback,
            **{"lora.rank": 4, "lora.target_modules": "all-linear", "optimizer.learning_rate": 2e-2},
        )
    )
    margins = before["eval_rewards/margins"], after["eval_rewards/margins"]
    print(f"\nKTO held-out rewards/margins: {margins[0]:.4f} -> {margins[1]:.4f}")
    assert abs(before["eval_rewards/margins"]) < 1e-3  # the policy (almost) its own reference
    assert after["eval_rewards/margins"] > 0.5, after
    assert after["eval_loss"] < before["eval_loss"] and "kl" in after


def test_bad_records_and_configs_are_refused_in_one_sentence(base, feedback, tmp_path):
    bundle = load_saved(base / "tokenizer")
    cfg = kto_config(base, tmp_path, feedback)
    with pytest.raises(ConfigError, match=r"^x:3: 'label' must be true \(desirable\) or false \(undesirable\), not 1$"):
        tokenize_example({"prompt": "a", "completion": " b", "label": 1}, "x:3", bundle, cfg.data)
    with pytest.raises(ConfigError, match=r"^x:4: no 'label' key \(the record has: prompt, completion\)$"):
        tokenize_example({"prompt": "a", "completion": " b"}, "x:4", bundle, cfg.data)
    with pytest.raises(ConfigError, match="data.batch_size / grad_accum must be at least 2, not 1"):
        kto_config(base, tmp_path, feedback, **{"data.batch_size": 2, "grad_accum": 2})
    kto_config(base, tmp_path, feedback, loss_type="apo_zero_unpaired", **{"data.batch_size": 1})  # no KL term


def test_kto_is_a_pipeline_stage_with_a_reference_input(base, feedback, tmp_path):
    from flows.spec import Pipeline
    from tasks.plan import plan_pipeline
    from tasks.runner import RAN, execute_stage
    from tasks.store.records import read_manifest
    from tests.test_grpo import _CheckpointCopy  # noqa: F401  (registers test-checkpoint-copy)

    p = Pipeline("feedback", store=tmp_path / "store")
    start = p.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    reference = p.stage("reference", task="test-checkpoint-copy", config={"path": str(base)})
    p.stage(
        "kto",
        task="kto",
        inputs={"checkpoint": start, "reference": reference},
        launcher={"kind": "local", "env": ONE_DEVICE_ENV},
        config={
            "data": {"path": str(feedback), "max_prompt_length": 8, "max_length": 16, "batch_size": 8}
            | {"eval_fraction": 0.1},
            "steps": 2,
            "log_every": 1,
            "precompute_ref": True,
        },
    )
    plan = p.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN, RAN, RAN]
    manifest = read_manifest(plan.store.artifact_dir("kto", plan.stages["kto"].job.artifact_id))
    assert manifest["kind"] == "checkpoint" and [q["stage"] for q in manifest["parents"]] == ["base", "reference"]
    assert manifest["metrics"]["steps"] == 2 and "eval_kl" in manifest["metrics"], manifest["metrics"]
    plans, notes = plan_pipeline(plan, "local")  # the planner hook: the KTO step over example rows
    assert [q.stage for q in plans] == ["kto"] and plans[0].fits, plans
