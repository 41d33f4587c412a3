"""Process reward models (the reward_model stage with `process:`): rows as TRL's
PRMTrainer.tokenize_row makes them; the loss and its gradient as transformers'
token-classification loss; a PRM that learns step labels; GRPO scoring completions with it
(min over the steps' P(correct)); refusals in one sentence.

TRL 1.16 (installed) no longer ships PRMTrainer; its `tokenize_row` (trl/experimental/prm in
TRL's repository) is transcribed below, as tests/test_estimators.py transcribes verl."""

from __future__ import annotations

import json
import shutil
from itertools import chain
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.config import ConfigError, load_config
from engine.data.tokenizer import load_saved
from engine.models.params import graphdef_of
from engine.posttrain.config import GRPOConfig
from engine.posttrain.finetune import finetune_start
from engine.posttrain.grpo import RolloutSource, policy_objective, train_config
from engine.posttrain.grpo import make_loss_fn as grpo_loss_fn
from engine.posttrain.process_reward import (
    IGNORE,
    PROCESS_HEAD,
    aggregate_steps,
    prompt_ids_of,
    step_logits,
    step_loss_terms,
    step_row,
)
from engine.posttrain.reward_config import ProcessRewardConfig, RewardModelConfig
from engine.posttrain.reward_model import load_reward_params, run_reward_model
from engine.train.trainer import Trainer
from tests.deps import need
from tests.test_dpo import NAMES
from tests.test_lora_train import base  # noqa: F401  (a tiny checkpoint artifact)

torch = need("torch")
transformers = need("transformers")

from transformers.loss.loss_utils import ForTokenClassification  # noqa: E402


def trl_tokenize_row(features, tokenizer, step_separator, max_length, max_completion_length, train_on_last_step_only,
                     is_eval):  # fmt: skip
    """TRL's PRMTrainer.tokenize_row (trl/experimental/prm/prm_trainer.py), transcribed."""
    prompt_ids = tokenizer(features["prompt"], add_special_tokens=False)["input_ids"]
    completions_ids = [
        tokenizer(completion, add_special_tokens=False)["input_ids"] for completion in features["completions"]
    ]
    if train_on_last_step_only and not is_eval:
        labels = [-100] * (len(features["labels"]) - 1) + [int(features["labels"][-1])]
    else:
        labels = [int(label) for label in features["labels"]]
    separator_ids = tokenizer.encode(step_separator, add_special_tokens=False)
    completions_ids = [completion + separator_ids for completion in completions_ids]
    labels = [[-100] * (len(completion) - 1) + [label] for completion, label in zip(completions_ids, labels)]
    completion_ids = list(chain(*completions_ids))
    labels = list(chain(*labels))
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    if max_completion_length is not None:
        completion_ids = completion_ids[:max_completion_length]
        labels = labels[:max_completion_length]
    input_ids = prompt_ids + completion_ids
    labels = [-100] * len(prompt_ids) + labels
    if max_length is not None:
        input_ids = input_ids[:max_length]
        labels = labels[:max_length]
    return {"input_ids": input_ids, "labels": labels}


@pytest.mark.parametrize(
    "separator,max_length,max_completion_length,last_only",
    [("\n", 64, None, False), (" ;", 64, 9, False), ("\n", 13, None, False), ("\n", 64, None, True)],
)
def test_rows_are_trls_tokenize_row(base, separator, max_length, max_completion_length, last_only):
    bundle = load_saved(base / "tokenizer")
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bundle.tokenizer, bos_token=bundle.bos_token)
    features = {
        "prompt": "colour 2:",
        "completions": [" blue", " red and green", " blue"],
        "labels": [True, False, True],
    }
    process = ProcessRewardConfig(
        step_separator=separator, max_completion_length=max_completion_length, train_on_last_step_only=last_only
    )
    theirs = trl_tokenize_row(features, hf_tokenizer, separator, max_length, max_completion_length, last_only, False)
    labels = [int(x) for x in features["labels"]]
    if last_only:
        labels = [IGNORE] * 2 + labels[-1:]
    ours = step_row(bundle, prompt_ids_of(bundle, features["prompt"], 32), features["completions"], labels, process,
                    max_length)  # fmt: skip
    assert ours.ids.tolist() == theirs["input_ids"] and ours.labels.tolist() == theirs["labels"]


def test_the_loss_and_its_gradient_are_transformers_token_classification_loss():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, 11, 2))
    labels = np.where(rng.random((3, 11)) < 0.3, rng.integers(0, 2, (3, 11)), IGNORE)
    theirs_logits = torch.tensor(logits, requires_grad=True)
    theirs = ForTokenClassification(theirs_logits, torch.tensor(labels), SimpleNamespace(num_labels=2))
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logits)
    with jax.enable_x64(True):

        def loss(x):
            nll_sum, count, _ = step_loss_terms(x, jnp.asarray(labels))
            return nll_sum / count

        ours, grad = jax.value_and_grad(loss)(jnp.asarray(logits))
    np.testing.assert_allclose(float(ours), theirs.item(), rtol=1e-6)  # transformers' loss is float32
    np.testing.assert_allclose(np.asarray(grad), theirs_grad.numpy(), rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------- a trained PRM


@pytest.fixture(scope="module")
def steps_data(tmp_path_factory) -> Path:
    """'colour i:' and steps naming colours: a step is correct when it names the i-th colour."""
    path = tmp_path_factory.mktemp("prm-data") / "steps.jsonl"
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for k in range(96):
            right = k % 3
            steps = [int(rng.integers(0, 3)) for _ in range(int(rng.integers(1, 4)))]
            record = {
                "prompt": f"colour {right}:",
                "completions": [f" {NAMES[s]}" for s in steps],
                "labels": [s == right for s in steps],
            }
            f.write(json.dumps(record) + "\n")
    return path


def prm_config(base: Path, out: Path, data: Path, **overrides) -> RewardModelConfig:
    tree = {
        "checkpoint": {"init_from": str(base / "checkpoint"), "directory": str(out / "checkpoint")}
        | {"every_steps": 10, "async_save": False},
        "data": {"path": str(data), "max_prompt_length": 8, "max_length": 24, "batch_size": 8, "eval_fraction": 0.25},
        "process": {"step_separator": "\n"},
        "optimizer": {"learning_rate": 3e-3},
        "schedule": {"kind": "constant"},
        "steps": 30,
        "log_every": 10,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=RewardModelConfig)


@pytest.fixture(scope="module")
def trained_prm(base, steps_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("prm")
    shutil.copytree(base / "tokenizer", out / "tokenizer")
    return out, run_reward_model(prm_config(base, out, steps_data))


def test_a_prm_learns_held_out_step_labels(trained_prm):
    _, result = trained_prm
    print(f"\nPRM held-out step accuracy {result['eval_accuracy']:.3f} over {result['eval_steps']:.0f} steps")
    assert result["eval_accuracy"] > 0.8, result  # a third of the steps are correct: chance is below 0.67


def step_probabilities(directory: Path, ids: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """P(correct) at `ends` of one unpadded row, through the PRM's own params (no batching)."""
    model_cfg, compute, params, _, _ = load_reward_params(directory, allow_process=True)
    decoder = nnx.merge(graphdef_of(model_cfg, compute), {k: v for k, v in params.items() if k != PROCESS_HEAD})
    hidden, _ = decoder.hidden_states(jnp.asarray(ids[None]), jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), int))
    return np.asarray(jax.nn.softmax(step_logits(hidden, jnp.asarray(params[PROCESS_HEAD])), -1)[0, ends, 1])


def test_grpo_rewards_completions_with_the_min_over_their_steps(trained_prm, base, tmp_path):
    out, _ = trained_prm
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"colour {i}:"}) + "\n" for i in range(3)))
    cfg = load_config(
        tree={
            "checkpoint": {"init_from": str(base / "checkpoint"), "directory": str(tmp_path / "ck")}
            | {"async_save": False},
            "data": {"path": str(tmp_path / "prompts.jsonl")},
            "rewards": [{"model": str(out / "checkpoint"), "name": "prm"}],
            "prompts_per_step": 4,
            "num_generations": 4,
            "max_prompt_length": 8,
            "max_completion_length": 6,
            "temperature": 3.0,  # varied completions, some with several steps
            "steps": 2,
            "progress": False,
            "metrics_dir": str(tmp_path),
        },
        schema=GRPOConfig,
    )
    model_cfg, compute, bundle = finetune_start(cfg)
    trainer = Trainer(
        train_config(cfg, model_cfg, compute),
        lambda graphdef: policy_objective(grpo_loss_fn(graphdef, cfg, cfg.max_prompt_length)),
    )
    source = RolloutSource(cfg, trainer, model_cfg, bundle)
    batch, values = source.next_batch(trainer.init_state())
    tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
    completion = np.asarray(batch["completion_mask"]) > 0  # (rows, completion tokens) after the prompt's
    prompt_width = tokens.shape[1] - completion.shape[1]
    process = ProcessRewardConfig(step_separator="\n")
    expected, step_counts = [], []
    for row in range(tokens.shape[0]):
        prompt = tokens[row, :prompt_width][segments[row, :prompt_width] != 0].tolist()
        text = bundle.tokenizer.decode(tokens[row, prompt_width:][completion[row]].tolist(), skip_special_tokens=True)
        steps = text.split("\n")
        steps = steps[:-1] if len(steps) > 1 and not steps[-1].strip() else steps
        example = step_row(bundle, prompt, steps, [1] * len(steps), process, 10_000)
        ends = np.flatnonzero(example.labels != IGNORE)
        expected.append(aggregate_steps(step_probabilities(out / "checkpoint", example.ids, ends), "min"))
        step_counts.append(len(ends))
    expected = np.asarray(expected)
    assert np.std(expected) > 0
    assert values["reward/prm/mean"] == pytest.approx(expected.mean(), abs=1e-5)
    assert values["reward/prm/std"] == pytest.approx(expected.std(ddof=1), abs=1e-5)
    # Completions of several steps (sampled ones here rarely hold the separator), through the
    # GRPO stage's scorer itself: the min over each one's steps.
    texts = [[" red\n blue", " green\n green\n", " blue", "\n red\n green\n blue"][r % 4] for r in range(len(tokens))]
    scorer = source.reward_models[0]
    got = scorer(batch, texts)
    for row, text in enumerate(texts):
        prompt = tokens[row, :prompt_width][segments[row, :prompt_width] != 0].tolist()
        steps = text.split("\n")
        steps = steps[:-1] if len(steps) > 1 and not steps[-1].strip() else steps
        example = step_row(bundle, prompt, steps, [1] * len(steps), process, 10_000)
        ends = np.flatnonzero(example.labels != IGNORE)
        p_steps = step_probabilities(out / "checkpoint", example.ids, ends)
        assert len(ends) == [2, 2, 1, 4][row % 4]
        assert got[row] == pytest.approx(p_steps.min(), abs=1e-5)


def test_aggregates_and_refusals():
    p = np.array([0.9, 0.2, 0.7])
    assert aggregate_steps(p, "min") == pytest.approx(0.2)
    assert aggregate_steps(p, "product") == pytest.approx(0.126)
    assert aggregate_steps(p, "last") == pytest.approx(0.7)
    assert np.isnan(aggregate_steps(p[:0], "min"))
    base_tree = {"checkpoint": {"init_from": "x", "directory": "y"}, "process": {}}
    with pytest.raises(ConfigError, match="center_rewards_coefficient applies to a Bradley-Terry reward model"):
        load_config(tree={**base_tree, "center_rewards_coefficient": 0.01}, schema=RewardModelConfig)
    with pytest.raises(ConfigError, match="aggregate"):
        load_config(tree={**base_tree, "process": {"aggregate": "mean"}}, schema=RewardModelConfig)


def test_bad_records_and_export_are_refused_in_one_sentence(trained_prm, base, tmp_path):
    from engine.posttrain.process_reward import tokenize_steps

    out, _ = trained_prm
    bundle = load_saved(base / "tokenizer")
    cfg = prm_config(base, tmp_path, tmp_path / "unused.jsonl")
    record = {"prompt": "a", "completions": [" b", " c"], "labels": [True]}
    with pytest.raises(ConfigError, match=r"^x:2: 'labels' must list one true/false per step \(2 steps\)$"):
        tokenize_steps(record, "x:2", bundle, cfg, False)
    with pytest.raises(ConfigError, match=r"^x:3: 'completions' must be a non-empty list of step texts$"):
        tokenize_steps({**record, "completions": "b"}, "x:3", bundle, cfg, False)
    with pytest.raises(ConfigError, match="is a process reward model .* no \\*ForSequenceClassification form"):
        load_reward_params(out / "checkpoint")


def test_a_process_reward_model_is_a_reward_model_stage_that_plans(base, steps_data, tmp_path):
    from flows.spec import Pipeline
    from tasks.plan import plan_pipeline
    from tasks.runner import RAN, execute_stage
    from tasks.store.records import read_manifest
    from tests.test_dpo import ONE_DEVICE_ENV
    from tests.test_grpo import _CheckpointCopy  # noqa: F401  (registers test-checkpoint-copy)

    p = Pipeline("steps", store=tmp_path / "store")
    start = p.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    p.stage(
        "prm",
        task="reward_model",
        inputs={"checkpoint": start},
        launcher={"kind": "local", "env": ONE_DEVICE_ENV},
        config={
            "process": {"step_separator": "\n", "aggregate": "product"},
            "data": {"path": str(steps_data), "max_prompt_length": 8, "max_length": 24, "batch_size": 8}
            | {"eval_fraction": 0.1},
            "steps": 2,
            "log_every": 1,
        },
    )
    plan = p.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN, RAN]
    out = plan.store.artifact_dir("prm", plan.stages["prm"].job.artifact_id)
    manifest = read_manifest(out)
    assert manifest["kind"] == "reward_model" and "eval_accuracy" in manifest["metrics"], manifest["metrics"]
    _, _, params, _, meta = load_reward_params(out / "checkpoint", allow_process=True)
    assert params[PROCESS_HEAD].shape == (params["embed_vd"].shape[1], 2)
    assert meta["reward_model"]["process"]["aggregate"] == "product"
    plans, _ = plan_pipeline(plan, "local")
    assert [q.stage for q in plans] == ["prm"] and plans[0].fits, plans
