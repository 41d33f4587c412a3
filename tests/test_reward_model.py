"""Reward models: TRL's RewardTrainer loss, learning held-out preferences, resume, LoRA with
the head trained beside the adapter, export as transformers' *ForSequenceClassification with
the engine's scores, convert back, and GRPO scoring completions with a reward model."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config, to_yaml
from engine.data.tokenizer import TokenizerConfig, load_saved, save_tokenizer, train_tokenizer
from engine.interop.hf.__main__ import main as hf_main
from engine.models.params import graphdef_of
from engine.posttrain.config import GRPOConfig
from engine.posttrain.finetune import finetune_start
from engine.posttrain.grpo import RolloutSource, policy_objective, train_config
from engine.posttrain.grpo import make_loss_fn as grpo_loss_fn
from engine.posttrain.reward_config import RewardModelConfig
from engine.posttrain.reward_model import (
    HEAD,
    load_reward_pairs,
    load_reward_params,
    pair_losses,
    reward_rows,
    run_reward_model,
    sequence_scores,
)
from engine.train.trainer import Trainer
from tests.conftest import child_xla_flags
from tests.deps import need
from tests.engine_kill import kill_then_resume
from tests.test_dpo import preferences  # noqa: F401  (the colour preference pairs)
from tests.test_lora_train import base, restore_adapter  # noqa: F401  (a tiny checkpoint artifact)

torch = need("torch")
transformers = need("transformers")
need("trl")

from safetensors.numpy import load_file  # noqa: E402
from trl import RewardTrainer  # noqa: E402

from tests.test_hf_parity import hf_config  # noqa: E402


def rm_config(base: Path, out: Path, data: Path, **overrides) -> RewardModelConfig:
    tree = {
        "checkpoint": {
            "init_from": str(base / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 10,
            "async_save": False,
        },
        "data": {"path": str(data), "max_prompt_length": 8, "max_length": 16, "batch_size": 8, "eval_fraction": 0.25},
        "optimizer": {"learning_rate": 1e-3},
        "schedule": {"kind": "constant"},
        "steps": 20,
        "log_every": 5,
        "eval_every": 0,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=RewardModelConfig)


@pytest.fixture(scope="module")
def trained(base, preferences, tmp_path_factory):
    """A reward-model artifact (checkpoint/ + tokenizer/) trained 20 steps on the colour pairs."""
    out = tmp_path_factory.mktemp("reward-model")
    shutil.copytree(base / "tokenizer", out / "tokenizer")
    return out, run_reward_model(rm_config(base, out, preferences))


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- TRL's loss


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_and_its_gradient_are_trl_reward_trainers(margin, center):
    """TRL's own RewardTrainer.compute_loss, unbound on a stand-in `self`; its model a stand-in
    returning given rewards (chosen rows then rejected, as its collator stacks them)."""
    rng = np.random.default_rng(3)
    n = 7
    rewards = rng.normal(0.0, 2.0, 2 * n)
    margins = rng.uniform(0.0, 1.5, n) if margin else np.zeros(n)
    leaf = torch.tensor(rewards, dtype=torch.float64, requires_grad=True)
    accelerator = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    this = SimpleNamespace(
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(center_rewards_coefficient=center),
        accelerator=accelerator,
        _total_train_tokens=0,
        _tp_size=1,
        _metrics={"train": defaultdict(list)},
    )
    inputs = {"input_ids": torch.zeros(2 * n, 3, dtype=torch.long), "attention_mask": torch.ones(2 * n, 3)}
    if margin:
        inputs["margin"] = torch.tensor(margins, dtype=torch.float64)
    loss = RewardTrainer.compute_loss(this, lambda **kw: SimpleNamespace(logits=leaf[:, None]), inputs)
    loss.backward()

    with jax.enable_x64(True):

        def ours(r):
            return jnp.mean(pair_losses(r[:n], r[n:], jnp.asarray(margins), center))

        value, grad = jax.value_and_grad(ours)(jnp.asarray(rewards))
    assert abs(float(value) - loss.item()) <= 1e-12, (float(value), loss.item())
    np.testing.assert_allclose(np.asarray(grad), leaf.grad.numpy(), rtol=1e-10, atol=1e-14)
    chosen, rejected = rewards[:n], rewards[n:]  # the metrics TRL logs, by the formulas the engine logs
    assert this._metrics["train"]["accuracy"][0] == pytest.approx(np.mean(chosen > rejected))
    assert this._metrics["train"]["margin"][0] == pytest.approx(np.mean(chosen - rejected))
    assert this._metrics["train"]["mean_reward"][0] == pytest.approx(np.mean((chosen + rejected) / 2))


# --------------------------------------------------------------------------- the data


def test_rows_end_each_sequence_with_its_last_token_and_a_margin_column_is_read(base, tmp_path):
    bundle = load_saved(base / "tokenizer")
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        json.dumps({"prompt": "colour 1:", "chosen": " green", "rejected": " red", "margin": 0.5})
        + "\n"
        + json.dumps({"prompt": "colour 2:", "chosen": " blue", "rejected": " red blue"})
        + "\n"
    )
    cfg = rm_config(base, tmp_path, data)
    pairs, held_out = load_reward_pairs(cfg.data.model_copy(update={"eval_fraction": 0.0}), bundle, print)
    assert [p.margin for p in pairs] == [0.5, 0.0] and not held_out
    rows = reward_rows(pairs, 16, rows=4)
    for r, pair in enumerate(pairs):
        for k, completion in enumerate((pair.chosen, pair.rejected)):
            sequence = np.concatenate([pair.prompt, completion])  # what TRL scores: prompt + completion + eos
            at = rows["last_bk"][r, k]
            np.testing.assert_array_equal(rows["tokens"][r, at - len(sequence) + 1 : at + 1], sequence)
            assert rows["tokens"][r, at] == bundle.eos_id and rows["segment_ids"][r, at] == k + 1
            assert rows["positions"][r, at] == len(sequence) - 1
            # padding-free: the rejected sequence starts right after the chosen one, then padding
            assert rows["segment_ids"][r, at + 1] == (2 if k == 0 else 0)  # 2: the rejected segment
    np.testing.assert_array_equal(rows["pair_mask"][:, 0], [1, 1, 0, 0])
    np.testing.assert_array_equal(rows["margin"][:, 0], [0.5, 0, 0, 0])
    data.write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}) + "\n")
    with pytest.raises(ConfigError, match=r"pairs.jsonl:1: 'margin' must be a finite number, got 'big'"):
        load_reward_pairs(cfg.data, bundle, print)


# --------------------------------------------------------------------------- training


def test_learns_held_out_preferences_and_a_killed_run_resumes_to_the_uninterrupted_one(
    trained,
    base,
    preferences,
    tmp_path,
):
    out, first = trained
    steps = [r for r in metrics_of(out) if "accuracy" in r]
    assert first["eval_accuracy"] > 0.9 and first["eval_margin"] > 0, first  # held out: chosen scored higher
    assert steps[0]["loss"] > steps[-1]["loss"] and first["train_pairs"] == 54 and first["eval_pairs"] == 18
    print(
        f"\nreward model: held-out pairwise accuracy {first['eval_accuracy']:.3f}, margin "
        f"{first['eval_margin']:.2f} (step {steps[0]['step']}: accuracy {steps[0]['accuracy']:.3f})"
    )

    # SIGKILLed once step 10 is committed (asynchronous checkpoints), then rerun to the end.
    cfg = rm_config(
        base, tmp_path / "killed", preferences, **{"checkpoint.async_save": True, "checkpoint.every_steps": 5}
    )
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "rm.yaml").write_text(to_yaml(cfg))
    kill_then_resume(
        "engine.posttrain.reward_model",
        tmp_path / "killed" / "rm.yaml",
        tmp_path / "killed" / "checkpoint",
        after_step=10,
    )
    a = load_reward_params(out / "checkpoint")[2]
    b = load_reward_params(tmp_path / "killed" / "checkpoint")[2]
    assert HEAD in a and a[HEAD].shape == (32,)
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_lora_trains_the_head_beside_the_adapter(base, preferences, tmp_path):
    result = run_reward_model(
        rm_config(
            base,
            tmp_path / "lora",
            preferences,
            steps=12,
            head_init="zero",
            **{"lora.rank": 4, "lora.target_modules": "all-linear", "optimizer.learning_rate": 2e-2},
        )
    )
    assert result["eval_accuracy"] > 0.8, result
    saved = restore_adapter(tmp_path / "lora" / "checkpoint")  # the trained tree: adapter + head
    assert f"['{HEAD}']" in saved and np.abs(saved[f"['{HEAD}']"]).max() > 0  # it left zero
    assert all(k == f"['{HEAD}']" or k.endswith(("_lora_a']", "_lora_b']")) for k in saved), list(saved)
    _, _, params, _, meta = load_reward_params(tmp_path / "lora" / "checkpoint")  # read: base + adapter folded
    assert meta["lora"]["rank"] == 4 and "lm_head_dv" in params and meta["reward_model"]["head_init"] == "zero"


# --------------------------------------------------------------------------- transformers


def padded_batch(lengths: list[int], width: int, pad: int, vocab: int, seed: int):
    """Right-padded rows of random ids (never the pad id): tokens, positions, segment ids."""
    rng = np.random.default_rng(seed)
    tokens = np.full((len(lengths), width), pad, np.int32)
    segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        ids = rng.integers(0, vocab - 1, n)
        tokens[i, :n] = np.where(ids >= pad, ids + 1, ids)
        segments[i, :n], positions[i, :n] = 1, np.arange(n)
    return tokens, positions, segments


def engine_scores(directory: Path, tokens, positions, segments) -> np.ndarray:
    cfg, compute, params, _, _ = load_reward_params(directory)
    return np.asarray(
        sequence_scores(
            graphdef_of(cfg, compute), params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)
        )
    )


def hf_scores(model, tokens, segments) -> np.ndarray:
    with torch.no_grad():
        return (
            model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segments))
            .logits[:, 0]
            .double()
            .numpy()
        )


def test_export_scores_equal_transformers_and_convert_gives_the_reward_model_back(trained, tmp_path):
    out, _ = trained
    assert hf_main(["export", str(out / "checkpoint"), str(tmp_path / "hf")]) == 0  # the tokenizer beside it
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    pad = load_saved(out / "tokenizer").pad_id
    assert written["architectures"] == ["LlamaForSequenceClassification"] and written["pad_token_id"] == pad
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").float().eval()
    assert model.config.num_labels == 1 and tuple(model.score.weight.shape) == (1, 32)
    batch = padded_batch([5, 13, 2, 9, 1], 15, pad, 300, seed=1)  # odd lengths, right padding
    ours, theirs = engine_scores(out / "checkpoint", *batch), hf_scores(model, batch[0], batch[2])
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    print(f"\nreward model export: max |engine - transformers| score {np.abs(ours - theirs).max():.2e}")

    assert hf_main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    np.testing.assert_array_equal(engine_scores(tmp_path / "back" / "checkpoint", *batch), ours)
    assert load_saved(tmp_path / "back" / "tokenizer").pad_id == pad


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_a_transformers_reward_model_converts_with_its_scores(family, tmp_path):
    """The other way, on families with tied embeddings (qwen3) and Gemma 2's norms and softcaps."""
    config = hf_config(family)
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    assert hf_main(["convert", str(tmp_path / "hf"), str(tmp_path / "rm")]) == 0
    batch = padded_batch([4, 11, 7], 12, 0, 37, seed=2)
    np.testing.assert_allclose(
        engine_scores(tmp_path / "rm" / "checkpoint", *batch), hf_scores(model, batch[0], batch[2]), atol=1e-5, rtol=0
    )
    assert hf_main(["export", str(tmp_path / "rm" / "checkpoint"), str(tmp_path / "again")]) == 0
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


# --------------------------------------------------------------------------- GRPO


def grpo_with_reward_model(base: Path, out: Path, reward_model: Path) -> GRPOConfig:
    (out / "prompts.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"colour {i}:"}) + "\n" for i in range(3)))
    tree = {
        "checkpoint": {
            "init_from": str(base / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "async_save": False,
        },
        "data": {"path": str(out / "prompts.jsonl")},
        "rewards": [{"model": str(reward_model), "name": "rm"}],
        "prompts_per_step": 4,
        "num_generations": 4,
        "max_prompt_length": 8,
        "max_completion_length": 3,
        "steps": 2,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, schema=GRPOConfig)


def test_grpo_rewards_completions_with_the_reward_models_scores(trained, base, tmp_path):
    out, _ = trained
    cfg = grpo_with_reward_model(base, tmp_path / "grpo", out / "checkpoint")
    model_cfg, compute, bundle = finetune_start(cfg)
    trainer = Trainer(
        train_config(cfg, model_cfg, compute),
        lambda graphdef: policy_objective(grpo_loss_fn(graphdef, cfg, cfg.max_prompt_length)),
    )
    source = RolloutSource(cfg, trainer, model_cfg, bundle)
    batch, values = source.next_batch(trainer.init_state())
    tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
    # Each prompt + completion alone, unpadded, through the reward model: the reward term's values.
    expected = np.array(
        [
            engine_scores(out / "checkpoint", ids[None], np.arange(len(ids))[None], np.ones((1, len(ids)), np.int32))[0]
            for ids in (row[seg != 0] for row, seg in zip(tokens, segments))
        ]
    )
    assert len(expected) == 16 and expected.std() > 0
    assert values["reward"] == pytest.approx(expected.mean(), abs=1e-5)
    assert values["reward/rm/mean"] == pytest.approx(expected.mean(), abs=1e-5)
    assert values["reward/rm/std"] == pytest.approx(expected.std(ddof=1), abs=1e-5)


def test_a_reward_model_from_another_tokenizer_is_refused(trained, base, tmp_path):
    out, _ = trained
    other = tmp_path / "other-rm"
    shutil.copytree(out / "checkpoint", other / "checkpoint")
    save_tokenizer(
        train_tokenizer(TokenizerConfig(vocab_size=280), ["a different corpus " * 30], add_bos=True),
        other / "tokenizer",
    )
    cfg = grpo_with_reward_model(base, tmp_path / "grpo", other / "checkpoint")
    model_cfg, compute, bundle = finetune_start(cfg)
    trainer = Trainer(train_config(cfg, model_cfg, compute))
    with pytest.raises(
        ConfigError,
        match=r"^rewards.0.model: the reward model .* was trained with another tokenizer "
        r"than the policy's; a reward model must share the policy's tokenizer$",
    ):
        RolloutSource(cfg, trainer, model_cfg, bundle)
    assert not (tmp_path / "grpo" / "checkpoint").exists()


@pytest.mark.slow
def test_reward_model_is_a_stage_that_grpo_scores_with_and_export_writes(base, preferences, tmp_path):
    from flows.spec import Pipeline
    from tasks.registry import stage_kind_names
    from tasks.runner import RAN, execute_stage
    from tasks.store.records import read_manifest

    if "test-checkpoint-copy" not in stage_kind_names():  # test_grpo.py registers it (maybe as another module)
        from tests.test_grpo import _CheckpointCopy  # noqa: F401

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"colour {i}:"}) + "\n" for i in range(3)))
    one_device = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}
    p = Pipeline("rm", store=tmp_path / "store")
    start = p.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    rm = p.stage(
        "rm",
        task="reward_model",
        inputs={"checkpoint": start},
        launcher=one_device,
        config={
            "data": {
                "path": str(preferences),
                "max_prompt_length": 8,
                "max_length": 16,
                "batch_size": 8,
                "eval_fraction": 0.25,
            },
            "steps": 2,
            "log_every": 1,
        },
    )
    p.stage(
        "grpo",
        task="grpo",
        inputs={"checkpoint": start, "judge": rm},
        launcher=one_device,
        config={
            "data": {"path": str(prompts)},
            "rewards": [{"model": "judge"}],
            "steps": 1,
            "prompts_per_step": 2,
            "num_generations": 2,
            "max_prompt_length": 8,
            "max_completion_length": 2,
        },
    )
    p.stage("export", task="export", inputs={"checkpoint": rm})
    plan = p.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN] * 4
    manifests = {
        name: read_manifest(plan.store.artifact_dir(name, s.job.artifact_id)) for name, s in plan.stages.items()
    }
    assert manifests["rm"]["kind"] == "reward_model" and "eval_accuracy" in manifests["rm"]["metrics"]
    assert sorted(q["stage"] for q in manifests["grpo"]["parents"]) == ["base", "rm"]  # the reward model's edge
    assert "reward/judge/mean" in manifests["grpo"]["metrics"]
    assert manifests["export"]["metrics"]["architecture"] == "LlamaForSequenceClassification"
    # trainflow plan prices the reward model's step, its head included (rows: 8, one per device here).
    from tasks.plan import plan_pipeline

    priced = Pipeline("rm-plan", store=tmp_path / "store")
    priced.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    priced.stage(
        "rm",
        task="reward_model",
        inputs={"checkpoint": "base"},
        config={
            "data": {"path": str(preferences), "max_prompt_length": 8, "max_length": 16, "batch_size": 8},
            "steps": 2,
        },
    )
    plans, _ = plan_pipeline(priced.plan(), "local")
    assert [q.stage for q in plans] == ["rm"] and plans[0].fits and plans[0].how == "compiled"
    assert plans[0].memory.gradients == plans[0].memory.parameters  # the decoder and its head both train
