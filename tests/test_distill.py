"""Distillation (TRL's GKD) on the shared trainer: the generalized JSD equals TRL's own, a
small student learns a trained teacher, on-policy steps train on the student's own samples,
a resumed run equals an uninterrupted one, and a teacher of another vocabulary is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.config import ConfigError, load_config, to_yaml
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from engine.inference.sample import Sampler
from engine.models.config import ModelConfig
from engine.models.params import graphdef_of
from engine.models.transformer import Transformer
from engine.posttrain.distill import (
    DistillBatches,
    Teacher,
    distill_objective,
    main,
    on_policy,
    prompt_ids,
    run_distill,
    teacher_model,
    train_config,
)
from engine.posttrain.distill_config import DistillConfig
from engine.posttrain.distill_loss import generalized_jsd_loss
from engine.posttrain.finetune import finetune_start, tokenizer_dir
from engine.posttrain.sft import eval_batches, load_examples, run_sft
from engine.train.checkpoint import Checkpointer, load_params
from engine.train.step import lm_loss_fn
from engine.train.trainer import Trainer, TrainState
from tests.conftest import child_xla_flags
from tests.deps import need
from tests.engine_kill import kill_then_resume
from tests.test_lora_train import colours  # noqa: F401  ('colour i:' -> the i-th of three colours, 60 lines)
from tests.test_sft import MODEL, base, sft_config  # noqa: F401  (a random tiny checkpoint artifact)

STUDENT = dict(MODEL, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=32)  # narrower, shallower

# A stage's engine process on one device at LLVM -O0 (the test session's level): its few steps
# are mostly compilation, which -O0 does in about half the time of the default -O2.
ONE_DEVICE_ENV = {"XLA_FLAGS": child_xla_flags()}


def random_checkpoint(out: Path, model: dict, tokenizer: Path) -> Path:
    """An artifact directory: checkpoint/ (random weights of `model`) and a copy of `tokenizer`."""
    cfg = ModelConfig(**model)
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(
        0,
        nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(1)))[1]),
        {"unused": np.zeros((), np.int32)},
        {"step": 0, "model": cfg.model_dump(mode="json"), "format": "trainflow.checkpoint/1"},
        {},
    )
    ckpt.close()
    shutil.copytree(tokenizer, out / "tokenizer")
    return out


@pytest.fixture(scope="module")
def teacher(base, colours, tmp_path_factory) -> Path:
    """The teacher: the tiny base after a quick SFT on the colours (held-out NLL ~0.05)."""
    out = tmp_path_factory.mktemp("teacher")
    run_sft(sft_config(base, out, colours, steps=40))
    shutil.copytree(base / "tokenizer", out / "tokenizer")
    return out


@pytest.fixture(scope="module")
def student(base, tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("student"), STUDENT, base / "tokenizer")


def distill_config(student: Path, teacher: Path, out: Path, data: Path, **overrides) -> DistillConfig:
    tree = {
        "checkpoint": {
            "init_from": str(student / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 4,
            "async_save": False,
        },
        "teacher": {"checkpoint": str(teacher / "checkpoint")},
        "data": {"path": str(data), "seq_len": 32, "batch_size": 8, "eval_fraction": 0.2},
        "optimizer": {"learning_rate": 1e-2},
        "schedule": {"kind": "constant"},
        "lmbda": 0.0,
        "max_new_tokens": 8,
        "steps": 30,
        "log_every": 5,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=DistillConfig)


# --------------------------------------------------------------------------- parity with TRL


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trls_loss_and_gradient(beta, temperature):
    torch = need("torch")
    GKDTrainer = need("trl.experimental.gkd").GKDTrainer
    rng = np.random.default_rng(int(beta * 10 + temperature * 100))
    student = rng.normal(0, 2, (3, 7, 17))
    teacher = rng.normal(0, 2, (3, 7, 17))
    labels = rng.integers(0, 17, (3, 7))
    labels[0, :3] = labels[1, 5:] = -100  # a prompt, padding
    labels[2] = -100  # a row with no completion token
    student_t = torch.tensor(student, requires_grad=True)
    with jax.enable_x64(True):
        for kwargs, mask, num_items in (
            ({"labels": torch.tensor(labels)}, labels != -100, None),
            ({"labels": torch.tensor(labels), "num_items_in_batch": 23}, labels != -100, 23),
            ({}, None, None),
        ):  # no labels: TRL's batchmean divides by rows
            student_t.grad = None
            expected = GKDTrainer.generalized_jsd_loss(
                student_t, torch.tensor(teacher), beta=beta, temperature=temperature, **kwargs
            )
            expected.backward()
            ours, grad = jax.value_and_grad(generalized_jsd_loss)(
                jnp.asarray(student),
                jnp.asarray(teacher),
                None if mask is None else jnp.asarray(mask, jnp.float64),
                beta=beta,
                temperature=temperature,
                num_items=num_items,
            )
            assert ours.dtype == jnp.float64
            assert abs(float(ours) - expected.item()) <= 1e-6, (kwargs.keys(), float(ours), expected.item())
            np.testing.assert_allclose(np.asarray(grad), student_t.grad.numpy(), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- learning


def held_out_nll(cfg: DistillConfig, checkpoint: Path) -> float:
    """A checkpoint's mean NLL on the held-out completion tokens (the language-modelling loss)."""
    model_cfg, compute, bundle = finetune_start(cfg)
    _, held_out = load_examples(cfg.data, bundle)
    stored, params, _ = load_params(checkpoint)
    loss_fn = jax.jit(lm_loss_fn(graphdef_of(stored, compute)))  # one program, not op by op
    nll = tokens = 0.0
    for rows in eval_batches(held_out, seq_len=cfg.data.seq_len, rows_per_batch=8, packing=True):
        _, aux = loss_fn(params, rows, 1.0)
        nll, tokens = nll + float(aux["nll_sum"]), tokens + float(aux["tokens"])
    return nll / tokens


def test_a_smaller_student_learns_a_trained_teacher_and_closes_most_of_the_gap(
    student,
    teacher,
    colours,
    tmp_path,
):
    cfg = distill_config(student, teacher, tmp_path / "run", colours, **{"optimizer.learning_rate": 3e-2})
    before = held_out_nll(cfg, student / "checkpoint")
    result = run_distill(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "jsd" in r]
    after, teacher_nll = result["eval_nll/student"], result["eval_nll/teacher"]
    closed = (before - after) / (before - teacher_nll)
    print(
        f"\ndistill: held-out student NLL {before:.3f} -> {after:.3f} (teacher {teacher_nll:.3f}, "
        f"{closed:.0%} of the gap closed), held-out JSD {result['eval_jsd']:.4f}; per-step JSD "
        f"{steps[0]['jsd']:.3f} -> {steps[-1]['jsd']:.3f}; student {result['num_params']:,} parameters, "
        f"teacher {result['teacher_params']:,}"
    )
    # The metric is the language-modelling loss of each model on the held-out completions.
    assert teacher_nll == pytest.approx(held_out_nll(cfg, teacher / "checkpoint"), rel=1e-4)
    assert after == pytest.approx(held_out_nll(cfg, tmp_path / "run" / "checkpoint"), rel=1e-4)
    assert result["teacher_params"] > 2 * result["num_params"]
    assert steps[-1]["jsd"] < 0.5 * steps[0]["jsd"] and all(r["on_policy"] == 0.0 for r in steps)
    assert closed > 0.8, (before, after, teacher_nll)


def test_on_policy_steps_train_on_the_students_own_samples(student, teacher, colours, tmp_path):
    cfg = distill_config(student, teacher, tmp_path / "run", colours, lmbda=1.0, steps=3, log_every=1)
    result = run_distill(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "jsd" in r]
    assert [r["on_policy"] for r in steps] == [1.0, 1.0, 1.0] and all(r["completion_length"] > 0 for r in steps)
    assert np.isfinite(result["eval_jsd"])

    # The batch after step 3: completions the student samples for the data's prompts (its own
    # sampler, unsharded, gives the same tokens), the loss on exactly those tokens.
    model_cfg, compute, bundle = finetune_start(cfg)
    trainer = Trainer(train_config(cfg, model_cfg, compute), lambda graphdef: distill_objective(graphdef, cfg))
    teacher_ = Teacher(cfg, trainer, *teacher_model(cfg, model_cfg, bundle, tokenizer_dir(cfg)))
    examples, _ = load_examples(cfg.data, bundle)
    source = DistillBatches(cfg, trainer, model_cfg, bundle, examples, teacher_)
    source.set_state({"rows": {"epoch": 0, "row": 0}, "prompts": {"epoch": 0, "index": 16}})
    params = load_params(tmp_path / "run" / "checkpoint", trainer.abstract_params)[1]
    batch, metrics = source.next_batch(TrainState(3, params, None))
    prompts = [prompt_ids(examples[i])[-cfg.prompt_length :] for i in source.prompts._order()[16:24]]
    tokens, mask = np.zeros((8, cfg.prompt_length), np.int32), np.zeros((8, cfg.prompt_length), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, -len(p) :], mask[r, -len(p) :] = p, 1
    out = Sampler(model_cfg, compute)(
        load_params(tmp_path / "run" / "checkpoint")[1],
        tokens,
        mask,
        seed=jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), 3), 0),
        max_new_tokens=8,
        temperature=cfg.temperature,
        eos_ids=(bundle.eos_id,),
        pad_id=bundle.eos_id,
    )
    targets, loss_mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"]).astype(bool)
    for r in range(8):
        np.testing.assert_array_equal(targets[r][loss_mask[r]], out.tokens[r][out.mask[r]])
        assert bundle.tokenizer.decode(prompts[r].tolist()).startswith("colour")
    assert metrics["on_policy"] == 1.0 and batch["teacher_logits"].shape == (8, 32, MODEL["vocab_size"])


def test_a_run_killed_with_sigkill_resumes_and_equals_an_uninterrupted_one(student, teacher, colours, tmp_path):
    overrides = {"lmbda": 0.5, "seed": 1, "steps": 8}
    kinds = [on_policy(distill_config(student, teacher, tmp_path, colours, **overrides), s) for s in range(8)]
    assert any(kinds[:4]) and not all(kinds[:4]) and any(kinds[4:]) and not all(kinds[4:]), kinds
    run_distill(distill_config(student, teacher, tmp_path / "run", colours, **overrides))
    # SIGKILLed once step 4 is committed (asynchronous checkpoints), then rerun to the end.
    cfg = distill_config(
        student,
        teacher,
        tmp_path / "killed",
        colours,
        **{**overrides, "checkpoint.async_save": True, "checkpoint.every_steps": 2},
    )
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "distill.yaml").write_text(to_yaml(cfg))
    kill_then_resume(
        "engine.posttrain.distill",
        tmp_path / "killed" / "distill.yaml",
        tmp_path / "killed" / "checkpoint",
        after_step=4,
    )
    a, b = load_params(tmp_path / "run" / "checkpoint")[1], load_params(tmp_path / "killed" / "checkpoint")[1]
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------- bad input


def test_a_teacher_of_another_vocabulary_is_refused_in_one_sentence(
    student,
    teacher,
    colours,
    tmp_path,
    capsys,
):
    other = tmp_path / "other-tokenizer"
    save_tokenizer(
        train_tokenizer(TokenizerConfig(vocab_size=300), ["lorem ipsum dolor sit amet " * 30], add_bos=True), other
    )
    cfg = distill_config(student, teacher, tmp_path / "run", colours, **{"teacher.tokenizer": str(other)})
    (tmp_path / "distill.yaml").write_text(to_yaml(cfg))
    assert main([str(tmp_path / "distill.yaml")]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: teacher.tokenizer: the teacher's tokenizer") and "\n" not in message
    assert str(other) in message and str(student / "tokenizer") in message, message
    assert not (tmp_path / "run" / "checkpoint").exists()

    wider = random_checkpoint(tmp_path / "wider", dict(MODEL, vocab_size=304), student / "tokenizer")
    with pytest.raises(
        ConfigError,
        match=r"the teacher's vocab_size \(304, .*wider.*\) differs from the "
        r"student's \(300, .*student.*\)",
    ):
        run_distill(distill_config(student, wider, tmp_path / "run", colours))
    with pytest.raises(ConfigError, match="data.loss_on must be completion"):
        distill_config(student, teacher, tmp_path / "run", colours, **{"data.loss_on": "all", "lmbda": 0.5})


# --------------------------------------------------------------------------- the stage


@pytest.mark.slow
def test_distill_is_a_pipeline_stage_with_both_lineage_edges_and_a_plan(
    student,
    teacher,
    colours,
    tmp_path,
):
    from flows.spec import Pipeline
    from tasks.plan import plan_pipeline
    from tasks.runner import RAN, execute_stage
    from tasks.store.records import read_manifest
    from tests.test_grpo import _CheckpointCopy  # noqa: F401  (registers test-checkpoint-copy)

    p = Pipeline("distil", store=tmp_path / "store")
    small = p.stage("student", task="test-checkpoint-copy", config={"path": str(student)})
    big = p.stage("teacher", task="test-checkpoint-copy", config={"path": str(teacher)})
    p.stage(
        "distill",
        task="distill",
        inputs={"checkpoint": small, "teacher": big},
        launcher={"kind": "local", "env": ONE_DEVICE_ENV},
        config={
            "data": {"path": str(colours), "seq_len": 32, "batch_size": 8, "eval_fraction": 0.1},
            "lmbda": 0.5,
            "max_new_tokens": 4,
            "steps": 2,
            "log_every": 1,
        },
    )
    plan = p.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN, RAN, RAN]
    manifest = read_manifest(plan.store.artifact_dir("distill", plan.stages["distill"].job.artifact_id))
    assert manifest["kind"] == "checkpoint" and sorted(q["stage"] for q in manifest["parents"]) == [
        "student",
        "teacher",
    ]
    assert manifest["metrics"]["steps"] == 2 and "eval_nll/teacher" in manifest["metrics"]
    plans, notes = plan_pipeline(plan, "local")
    assert [q.stage for q in plans] == ["distill"] and plans[0].fits
    assert plans[0].memory.batch >= 8 * 32 * MODEL["vocab_size"] * 4 / 8  # the teacher's logits, per device
    assert any("teacher's parameters (37,792" in note for note in notes), notes
