"""The training loop: learning, determinism, resume after SIGKILL, re-meshing, NaN, accumulation."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from engine.config import load_config
from engine.data.shards import shard_paths
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.transformer import Transformer
from engine.train.checkpoint import load_params
from engine.train.config import TrainConfig
from engine.train.metrics import read_metrics
from engine.train.optimizer import weight_decay_mask
from engine.train.pretrain import run_pretrain
from engine.train.trainer import TrainingError
from tests.conftest import child_xla_flags

REPO = Path(__file__).resolve().parent.parent


def tiny_config(dataset, out: Path, **overrides):
    tree = {
        "model": "tiny",
        "data": {"path": str(dataset), "seq_len": 64, "batch_size": 8, "eval_batches": 2},
        "checkpoint": {"directory": str(out / "checkpoint"), "every_steps": 5, "keep": 10},
        "optimizer": {"learning_rate": 3e-3},
        "schedule": {"warmup_steps": 5},
        "steps": 20,
        "log_every": 1,
        "progress": False,
        "metrics_dir": str(out),
    }
    flat = [f"{k}={v}" for k, v in overrides.items()]
    return load_config(tree=tree, overrides=flat, schema=TrainConfig)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def assert_params_identical(dir_a: Path, dir_b: Path):
    _, params_a, step_a = load_params(dir_a)
    _, params_b, step_b = load_params(dir_b)
    assert step_a == step_b
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)


def assert_resumes_bitwise(dataset: Path, tmp_path: Path, capfd, run: str, **overrides) -> None:
    """The finished 6-step run at tmp_path / run (checkpoints every 3 steps), its step-6
    checkpoint removed and the run started again: it resumes from step 3 and ends with the
    same parameters, bitwise."""
    shutil.copytree(tmp_path / run, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "6")
    capfd.readouterr()
    run_pretrain(tiny_config(dataset, tmp_path / "resumed", **overrides))
    assert "resumed from checkpoint step 3" in capfd.readouterr().err
    assert_params_identical(tmp_path / run / "checkpoint", tmp_path / "resumed" / "checkpoint")


def test_loss_falls_well_below_the_unigram_entropy_of_real_text(bpe_dataset, tmp_path):
    counts = Counter()
    for path in shard_paths(bpe_dataset, "validation"):
        from array_record.python.array_record_module import ArrayRecordReader

        reader = ArrayRecordReader(path)
        for record in reader.read_all():
            counts.update(np.frombuffer(record, "<i4").tolist())
    p = np.array(list(counts.values()), float) / sum(counts.values())
    unigram_entropy = float(-(p * np.log(p)).sum())  # nats per token

    cfg = tiny_config(
        bpe_dataset,
        tmp_path,
        steps=300,
        log_every=1,
        **{
            "data.seq_len": 128,
            "data.batch_size": 16,
            "data.eval_batches": 4,
            "optimizer.learning_rate": 1e-2,
            "checkpoint.every_steps": 300,
        },
    )
    # 300 steps: the run, not the compile, is the cost. As a user runs it (the CLI, XLA's
    # default optimisation, one CPU device), not in the suite's process (8 simulated devices,
    # unoptimised kernels): 40-odd seconds instead of 90.
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", str(config)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["result"]
    assert result["eval_loss"] < 0.8 * unigram_entropy, (result["eval_loss"], unigram_entropy)
    curve = losses(tmp_path)
    assert len(curve) == 300 and np.mean(curve[-20:]) < curve[0] - 1.5
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1


def test_same_config_and_seed_give_the_same_loss_sequence(byte_dataset, tmp_path):
    run_pretrain(tiny_config(byte_dataset, tmp_path / "a", steps=8))
    run_pretrain(tiny_config(byte_dataset, tmp_path / "b", steps=8))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(losses(tmp_path / "a")) == 8


def test_gradient_accumulation_equals_one_big_batch(byte_dataset, tmp_path):
    mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}  # 4 batch shards: 2 micro-batches of 4 rows
    run_pretrain(tiny_config(byte_dataset, tmp_path / "one", steps=3, **mesh))
    run_pretrain(tiny_config(byte_dataset, tmp_path / "acc", steps=3, grad_accum=2, **mesh))
    np.testing.assert_allclose(losses(tmp_path / "one"), losses(tmp_path / "acc"), rtol=2e-5)
    _, p1, _ = load_params(tmp_path / "one" / "checkpoint")
    _, p4, _ = load_params(tmp_path / "acc" / "checkpoint")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)


def test_restoring_on_a_different_mesh_continues_with_the_same_loss(byte_dataset, tmp_path):
    first = tiny_config(byte_dataset, tmp_path / "fsdp", steps=10, **{"mesh.data": 1, "mesh.fsdp": 8})
    run_pretrain(first)
    # Continue the same run on fsdp=8 and, from copies of its checkpoints, on data=2 x tensor=2 x fsdp=2
    # and on data=2 x context=2 x tensor=2 (each row's positions split over `context`, the parameters
    # over it as over fsdp).
    import shutil

    remeshes = {
        "remesh": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
        "context": {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2},
    }
    for name in remeshes:
        shutil.copytree(tmp_path / "fsdp", tmp_path / name)
    run_pretrain(tiny_config(byte_dataset, tmp_path / "fsdp", steps=16, **{"mesh.data": 1, "mesh.fsdp": 8}))
    a = losses(tmp_path / "fsdp")
    assert len(a) == 16
    for name, mesh in remeshes.items():
        run_pretrain(tiny_config(byte_dataset, tmp_path / name, steps=16, **mesh))
        b = losses(tmp_path / name)
        assert len(b) == 16
        np.testing.assert_allclose(a[10:], b[10:], rtol=1e-5, err_msg=name)


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(byte_dataset, tmp_path):
    # An absurd learning rate without clipping blows the logits up to inf within two steps.
    cfg = tiny_config(
        byte_dataset,
        tmp_path,
        steps=10,
        **{
            "optimizer.learning_rate": 1e12,
            "optimizer.grad_clip_norm": "null",
            "schedule.warmup_steps": 0,
            "schedule.kind": "constant",
            "checkpoint.every_steps": 1,
        },
    )
    with pytest.raises(TrainingError, match=r"non-finite loss \((nan|inf)\) at step \d+") as e:
        run_pretrain(cfg)
    import re

    bad_step = int(re.search(r"at step (\d+)", str(e.value)).group(1))
    _, params, good_step = load_params(tmp_path / "checkpoint")
    assert good_step == bad_step - 1
    assert f"last good checkpoint (step {good_step})" in str(e.value)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def _run_cli(config_path: Path, *extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": child_xla_flags(1)}
    return subprocess.Popen(
        [sys.executable, "-m", "engine.train", str(config_path), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_run_killed_with_sigkill_resumes_to_bitwise_identical_parameters(byte_dataset, tmp_path):
    cfg = tiny_config(byte_dataset, tmp_path, steps=30, **{"checkpoint.every_steps": 4})
    config_ref = tmp_path / "ref.yaml"
    config_kill = tmp_path / "kill.yaml"
    tree = cfg.model_dump(mode="json")
    for path, name in ((config_ref, "ref"), (config_kill, "kill")):
        tree["checkpoint"]["directory"] = str(tmp_path / name / "checkpoint")
        tree["metrics_dir"] = str(tmp_path / name)
        path.write_text(yaml.safe_dump(tree))

    reference = _run_cli(config_ref)
    victim = _run_cli(config_kill)
    ckpt_dir = tmp_path / "kill" / "checkpoint"
    deadline = time.time() + 300
    while not (ckpt_dir / "12").is_dir():  # orbax renames a step directory into place when complete
        assert victim.poll() is None, victim.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert killed_at < 30, "the run finished before it could be killed"

    resumed = _run_cli(config_kill)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"resumed from checkpoint step {killed_at}" in err
    _, ref_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_err
    assert_params_identical(tmp_path / "ref" / "checkpoint", ckpt_dir)
    assert losses(tmp_path / "ref") == losses(tmp_path / "kill")


def test_cli_reports_a_config_error_in_one_line_without_a_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nsteps: 3\ndata: {path: /nonexistent, seq_len: 64}\nchekpoint: {}\n")
    proc = _run_cli(path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'chekpoint'; did you mean 'checkpoint'" in err
    assert "Traceback" not in err


def test_a_tokenizer_larger_than_the_model_vocabulary_is_caught_before_compiling(byte_dataset, tmp_path):
    from engine.config import ConfigError

    cfg = tiny_config(byte_dataset, tmp_path, **{"model.vocab_size": 200})
    with pytest.raises(
        ConfigError, match=r"model.vocab_size \(200\) is smaller than the tokenizer's vocabulary \(257\)"
    ):
        run_pretrain(cfg)
    assert not (tmp_path / "checkpoint").exists()


def test_weight_decay_falls_on_matrices_not_on_biases_sinks_norms_or_embeddings():
    """A GPT-OSS-shaped model, layers stacked: its biases and sinks have two or more axes (layers,
    experts, heads) yet are offsets, not matrices, and get no decay; every weight matrix does."""
    cfg = ModelConfig.model_validate(
        yaml.safe_load((Path(__file__).parent.parent / "configs" / "models" / "tiny-gpt-oss.yaml").read_text())
    )
    params = nnx.to_pure_dict(
        nnx.eval_shape(lambda: nnx.split(Transformer(cfg, ComputeConfig(scan_layers=True), rngs=nnx.Rngs(0)))[1])
    )
    flat = {
        "/".join(map(str, (getattr(k, "key", k) for k in path))): (decay, leaf)
        for (path, decay), leaf in zip(
            jax.tree_util.tree_flatten_with_path(weight_decay_mask(params, False))[0], jax.tree.leaves(params)
        )
    }
    decayed = {name for name, (decay, _) in flat.items() if decay}
    matrix = lambda name: name.split("/")[-1].startswith(("w", "lm_head"))  # noqa: E731
    assert decayed and all(matrix(name) for name in decayed), sorted(decayed)
    offsets = {name for name in flat if name.split("/")[-1].startswith(("b", "sinks"))}
    assert {"bq_nh", "bo_d", "sinks_n", "b_gate_ef", "b_down_ed"} <= {n.split("/")[-1] for n in offsets}
    assert any(flat[name][1].ndim >= 2 for name in offsets) and not offsets & decayed
    assert all(matrix(name) == (name in decayed) for name in flat if "norm" not in name and name != "embed_vd")
    assert all(jax.tree.leaves(weight_decay_mask(params, True)))
