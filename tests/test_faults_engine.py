"""Faults the engine refuses early or survives: a too-small split, a failing final evaluation,
corrupt or unrecorded checkpoint steps, a non-finite loss (issue 12)."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.config import ConfigError, load_config
from engine.data.shards import write_dataset
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.config import SFTConfig
from engine.posttrain.sft import run_sft
from engine.train.checkpoint import (
    DIGESTS_FILE,
    DIGESTS_FORMAT,
    Checkpointer,
    CorruptCheckpoint,
    load_params,
    verify_step,
)
from engine.train.config import TrainConfig
from engine.train.metrics import read_metrics
from engine.train.pretrain import run_pretrain
from engine.train.trainer import Trainer, TrainingError


def tiny_config(dataset, out: Path, **overrides) -> TrainConfig:
    tree = {
        "model": "tiny",
        "data": {"path": str(dataset), "seq_len": 64, "batch_size": 8, "eval_batches": 2},
        "checkpoint": {"directory": str(out / "checkpoint"), "every_steps": 4, "keep": 10},
        "optimizer": {"learning_rate": 3e-3},
        "schedule": {"warmup_steps": 2},
        "steps": 12,
        "log_every": 1,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=TrainConfig)


def steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def assert_same_params(dir_a: Path, dir_b: Path) -> None:
    _, params_a, step_a = load_params(dir_a)
    _, params_b, step_b = load_params(dir_b)
    assert step_a == step_b
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)


# --------------------------------------------------------------------------- inputs that would fail late


def test_an_empty_validation_split_or_a_train_split_under_one_batch_is_refused_before_step_1(byte_dataset, tmp_path):
    # What tokenize writes when no document fell in the validation split: no shards at all.
    dataset = tmp_path / "data"
    shutil.copytree(byte_dataset, dataset)
    meta = json.loads((dataset / "meta.json").read_text())
    meta["splits"]["validation"] = {"shards": [], "documents": 0, "tokens": 0}
    (dataset / "meta.json").write_text(json.dumps(meta))
    started = time.perf_counter()
    with pytest.raises(
        ConfigError,
        match=rf"the 'validation' split of {dataset} has no documents, but evaluation "
        r"is configured \(data.eval_batches=2\); set data.eval_batches=0",
    ):
        run_pretrain(tiny_config(dataset, tmp_path))
    assert time.perf_counter() - started < 5  # nothing compiled
    assert steps_on_disk(tmp_path / "checkpoint") == []

    # Two short documents cannot fill one 8 x 64 batch.
    small = tmp_path / "small"
    write_dataset(small, {"train": [np.arange(40) % 256, np.arange(30) % 256]}, vocab_size=257, eos_id=256)
    with pytest.raises(
        ConfigError,
        match=r"'train' split of .* holds 68 tokens to predict, fewer than one batch "
        r"\(data.batch_size 8 x data.seq_len 64 = 512\)",
    ):
        run_pretrain(tiny_config(small, tmp_path))
    assert steps_on_disk(tmp_path / "checkpoint") == []


def test_held_out_sft_examples_with_nothing_to_evaluate_are_refused_before_step_1(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog " * 10]
    save_tokenizer(train_tokenizer(TokenizerConfig(vocab_size=300), texts, add_bos=True), tmp_path / "tokenizer")
    model = ModelConfig(
        vocab_size=300, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64
    )
    ckpt = Checkpointer(tmp_path / "base", async_save=False)
    params = nnx.to_pure_dict(nnx.split(Transformer(model, rngs=nnx.Rngs(0)))[1])
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, {"step": 0, "model": model.model_dump(mode="json")}, {})
    ckpt.close()
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"fox {i}", "completion": " dog"}) + "\n" for i in range(8)))
    # Conversations without an assistant turn: rows, but no token the loss counts.
    held_out.write_text(json.dumps({"messages": [{"role": "user", "content": "the fox?"}]}) + "\n")
    cfg = load_config(
        tree={
            "checkpoint": {"init_from": str(tmp_path / "base"), "directory": str(tmp_path / "run" / "checkpoint")},
            "tokenizer": str(tmp_path / "tokenizer"),
            "data": {"path": str(train), "eval_path": str(held_out), "seq_len": 32, "batch_size": 8},
            "steps": 2,
            "progress": False,
            "metrics_dir": str(tmp_path / "run"),
        },
        schema=SFTConfig,
    )
    with pytest.raises(
        ConfigError, match=rf"data.eval_path: {held_out}: the held-out examples give no token to evaluate"
    ):
        run_sft(cfg, log=lambda _: None)
    assert steps_on_disk(tmp_path / "run" / "checkpoint") == []


def test_a_failing_final_evaluation_keeps_the_final_checkpoint_and_the_retry_only_evaluates(
    byte_dataset, tmp_path, monkeypatch
):
    cfg = tiny_config(byte_dataset, tmp_path, steps=4, **{"checkpoint.every_steps": 10})  # saves only the final step

    def broken(self, params, batches):
        raise OSError("the evaluation's disk went away")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "held_out_loss", broken)
        with pytest.raises(OSError, match="went away"):
            run_pretrain(cfg)
    assert steps_on_disk(tmp_path / "checkpoint") == [4] and verify_step(tmp_path / "checkpoint", 4) == []

    logs = []
    result = run_pretrain(cfg, log=logs.append)
    assert any("resumed from checkpoint step 4" in line for line in logs)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # nothing trained twice
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert result["steps"] == 4 and np.isfinite(result["eval_loss"])
    assert result["final_loss"] == records[3]["loss"]


# --------------------------------------------------------------------------- checkpoint digests


def test_a_corrupt_latest_step_falls_back_to_the_previous_one_and_ends_bitwise_equal(byte_dataset, tmp_path):
    run_pretrain(tiny_config(byte_dataset, tmp_path / "reference"))
    # A run stopped after its step-8 checkpoint holds the reference's steps 4 and 8 (runs are deterministic).
    partial = tmp_path / "partial" / "checkpoint"
    shutil.copytree(tmp_path / "reference" / "checkpoint", partial)
    shutil.rmtree(partial / "12")
    largest = max((p for p in (partial / "8").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    corrupt = bytearray(largest.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x10
    largest.write_bytes(corrupt)
    assert verify_step(partial, 8) == [str(largest.relative_to(partial / "8"))]

    logs = []
    run_pretrain(tiny_config(byte_dataset, tmp_path / "partial"), log=logs.append)
    text = "\n".join(logs)
    assert f"checkpoint step 8 in {partial} failed verification" in text
    assert "falling back to checkpoint step 4" in text and "resumed from checkpoint step 4" in text
    assert_same_params(tmp_path / "reference" / "checkpoint", partial)
    reference_losses = [r["loss"] for r in read_metrics(tmp_path / "reference") if "loss" in r]
    assert [r["loss"] for r in read_metrics(tmp_path / "partial") if "loss" in r] == reference_losses[4:]
    assert all(verify_step(partial, step) == [] for step in steps_on_disk(partial))


def test_each_step_commits_its_digests_and_a_step_without_them_is_never_restored(tmp_path):
    directory = tmp_path / "checkpoint"
    ckpt = Checkpointer(directory, keep=5)  # asynchronous saves
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jnp.arange(64.0) * step}, {"m": jnp.zeros(3)}, {"step": step}, {"row": step})
    ckpt.close()
    digests = json.loads((directory / "3" / DIGESTS_FILE).read_text())
    assert digests["format"] == DIGESTS_FORMAT and digests["step"] == 3 and digests["algorithm"] == "sha256"
    assert any(name.startswith("params/") for name in digests["files"])
    assert all(set(entry) == {"size", "sha256"} for entry in digests["files"].values())
    assert [verify_step(directory, step) for step in (1, 2, 3)] == [[], [], []]

    (directory / "3" / DIGESTS_FILE).unlink()  # as if the commit had not recorded them
    (directory / "2" / "params" / "extra").write_bytes(b"not written by the checkpointer")
    assert verify_step(directory, 3) == [DIGESTS_FILE] and verify_step(directory, 2) == ["params/extra"]
    logs = []
    ckpt = Checkpointer(directory, keep=5)
    assert ckpt.resume_step(logs.append) == 1
    assert "checkpoint step 3" in logs[0] and f"its {DIGESTS_FILE} is missing" in logs[0] and "params/extra" in logs[1]
    from flows.summary import line_level  # how a stage's log ranks the engine's lines

    assert [line_level(line) for line in logs] == [logging.WARNING] * len(logs), logs  # INFO hid them
    assert steps_on_disk(directory) == [1]  # the unverified steps make room for the resumed run's
    ckpt.close()

    (directory / "1" / DIGESTS_FILE).unlink()
    with pytest.raises(CorruptCheckpoint, match=rf"no step in {directory} matches its digests \(steps 1\)"):
        Checkpointer(directory).resume_step(logs.append)
    assert steps_on_disk(directory) == [1]  # refused, not deleted


FILLS_THE_DISK = """
import sys
import jax.numpy as jnp
from engine.train.checkpoint import Checkpointer, CheckpointWriteError
ckpt = Checkpointer(sys.argv[1], keep=5)  # asynchronous saves
ckpt.save(1, {"w": jnp.arange(64.0)}, {"m": jnp.zeros(3)}, {"step": 1}, {"row": 1})
ckpt.wait()
try:
    ckpt.save(2, {"w": jnp.arange(400_000.0)}, {"m": jnp.zeros(3)}, {"step": 2}, {"row": 2})  # 1.6 MB
    ckpt.close()
except CheckpointWriteError as e:
    print(f"error: {e}", file=sys.stderr)
"""


def test_a_disk_that_fills_during_a_checkpoint_is_one_sentence_and_the_last_step_is_kept(tmp_path):
    """A real full file system: a 512 KiB tmpfs, mounted in a user and mount namespace of
    its own (no root needed), fits step 1 and not step 2. Orbax's threads logged four
    tracebacks (~320 lines) for it; now one line names the step, the directory and the step
    kept, and carries the strerror the launcher classifies as a full disk."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(FILLS_THE_DISK)
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm): cannot mount a small file system")
    command = f"mount -t tmpfs -o size=512k tmpfs {mount} && exec {sys.executable} {script} {mount}/checkpoint"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stderr.splitlines() == [
        f"error: checkpoint step 2: No space left on device writing {mount}/checkpoint; it is not committed, "
        "step 1, the newest committed, is kept"
    ], proc.stderr


# --------------------------------------------------------------------------- non-finite loss


def test_a_non_finite_update_found_one_step_late_never_writes_a_checkpoint_after_it(byte_dataset, tmp_path):
    # Checkpoints every 2 steps, logs only at the end. At this learning rate step 3 is the first
    # bad one: not a checkpoint step, so it is found one step late, before step 4's hooks run.
    cfg = tiny_config(
        byte_dataset,
        tmp_path,
        steps=10,
        log_every=100,
        **{
            "optimizer.learning_rate": 1e6,
            "optimizer.grad_clip_norm": "null",
            "schedule.warmup_steps": 0,
            "schedule.kind": "constant",
            "checkpoint.every_steps": 2,
        },
    )
    with pytest.raises(
        TrainingError, match=r"non-finite (loss|gradient norm) \((nan|inf)\b.* at step \d+; stopped"
    ) as e:
        run_pretrain(cfg)
    bad_step = int(re.search(r"at step (\d+)", str(e.value)).group(1))
    assert bad_step % 2 == 1, f"the first bad step ({bad_step}) should fall between checkpoints"
    saved = steps_on_disk(tmp_path / "checkpoint")
    assert saved == [bad_step - 1]
    assert f"The last good checkpoint (step {bad_step - 1}) in {tmp_path / 'checkpoint'} is intact" in str(e.value)
    assert verify_step(tmp_path / "checkpoint", bad_step - 1) == []
    _, params, _ = load_params(tmp_path / "checkpoint")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
