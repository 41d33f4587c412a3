"""Exactly-once resume of GRPO: a stage SIGKILLed at several points and resumed each time ends
equal to the uninterrupted run, and a changed prompt set is refused on resume.

Each run is `python -m engine.posttrain.grpo CONFIG` in a process of its own, killed where
tests/grpo_kill.py says (its reward function and policy loss are the run's, in the
uninterrupted run too): while a batch is scored after its rollout (mid-rollout), inside the
compiled update (mid-update), and as soon as a checkpoint step appears on disk (while it is
written, before or after its digests: the step's manifest). Then:

- synchronous: the final params are bitwise the uninterrupted run's, and so is every step's
  metrics line (wall-clock timings aside);
- a rollout worker with max_staleness 1: the batches in flight at the kill are generated again
  with the weights they had (the checkpoint of update b - 1), the same prompts and seeds, so
  the metrics lines and the final params are again the uninterrupted run's;
- multi-turn (two-turn tool episodes, synchronous): bitwise, as the synchronous run;
- all: each step's prompts are the uninterrupted run's, each taken once (no step skipped or
  repeated in the metrics);
- a prompts file changed between the kill and the resume is refused in one sentence naming
  data.path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import run_grpo
from engine.train.checkpoint import load_params
from engine.train.metrics import read_metrics
from tests.conftest import child_xla_flags
from tests.grpo_kill import CONSUMED, KILL_AT_ROLLOUT, KILL_AT_UPDATE
from tests.test_grpo import grpo_config, make_copy_task
from tests.test_multiturn import tool_config, tool_task  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent
STEPS = 5
TIMEOUT = 600


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    cfg = ModelConfig(
        vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=24, max_seq_len=8
    )
    return make_copy_task(tmp_path_factory.mktemp("resume_task"), cfg)


def write_config(task: Path, out: Path, multiturn: bool = False, **fields) -> Path:
    """The run's config file: the copy task (or the two-turn tool task), a checkpoint every step
    (all kept), the kill points' reward and loss."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"  # the run's own copy: a test changes it
    if multiturn:
        tree = tool_config(task, out, steps=STEPS, prompts_per_step=4, num_generations=8).model_dump(mode="json")
        tree["rewards"] = [{"function": "tests.grpo_kill:no_reward", "weight": 0.0}]
    else:
        tree = grpo_config(task, out, steps=STEPS, prompts_per_step=2, num_generations=4).model_dump(mode="json")
        tree["rewards"] = [{"function": "tests.grpo_kill:copy_reward"}]
    if not prompts.exists():
        shutil.copy(tree["data"]["path"], prompts)
    tree["checkpoint"].update(every_steps=1, keep=STEPS + 1, async_save=True)
    tree["data"]["path"] = str(prompts)
    tree["loss_type"] = "tests.grpo_kill:clipped_with_kill_point"
    tree.update(fields)
    path = out / "config.yaml"
    path.write_text(json.dumps(tree))  # JSON is YAML
    GRPOConfig.model_validate(tree)
    return path


def stage(config: Path, **env) -> subprocess.Popen:
    environment = {**os.environ, "XLA_FLAGS": child_xla_flags(), CONSUMED: str(config.parent / "consumed.jsonl"), **env}
    argv = [sys.executable, "-m", "engine.posttrain.grpo", str(config)]
    return subprocess.Popen(
        argv, cwd=REPO, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, stderr


def kill_when_step_appears(config: Path, step: int) -> None:
    """Start the stage and SIGKILL it as soon as checkpoint step `step` is on disk (possibly
    half written, its digests not yet recorded)."""
    proc = stage(config)
    deadline = time.monotonic() + TIMEOUT
    while not (config.parent / "checkpoint" / str(step)).exists() and proc.poll() is None:
        assert time.monotonic() < deadline, f"no checkpoint step {step}"
        time.sleep(0.01)
    proc.kill()
    code, stderr = finish(proc)
    assert code == -signal.SIGKILL, f"the run ended before it could be killed: {stderr[-2000:]}"


def killed_three_times(config: Path) -> str:
    """Killed mid-rollout of batch 3, mid-update of the second step it resumes to, while
    checkpoint 5 is written; then run to the end. Returns the last run's log."""
    marker = config.parent / "killed"
    code, stderr = finish(stage(config, **{KILL_AT_ROLLOUT: f"2:{marker}.rollout"}))
    assert code == -signal.SIGKILL, stderr[-2000:]
    # Resumed at 2 (or 1: checkpoints are saved asynchronously, step 2's may not have landed).
    code, stderr = finish(stage(config, **{KILL_AT_UPDATE: f"2:{marker}.update"}))
    assert code == -signal.SIGKILL and "resumed from checkpoint step" in stderr, stderr[-2000:]
    kill_when_step_appears(config, 5)
    code, stderr = finish(stage(config))
    assert code == 0 and "resumed from checkpoint step" in stderr, stderr[-2000:]
    return stderr


def comparable(metrics_dir: Path) -> list[dict]:
    """The metrics lines without their wall-clock timings."""
    timing = ("seconds", "tokens_per_second", "tflops", "mfu")
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in read_metrics(metrics_dir)]


def consumed_per_step(out: Path) -> dict[int, list]:
    """The prompts scored at each step; a batch scored again after a kill must be the same."""
    per_step: dict[int, list] = {}
    for line in (out / "consumed.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert per_step.setdefault(record["step"], record["prompts"]) == record["prompts"], record
    return per_step


def assert_same_run(uninterrupted: Path, resumed: Path) -> None:
    steps = [r["step"] for r in read_metrics(resumed)]
    assert steps == list(range(1, STEPS + 1)), steps  # each step trained, and logged, once
    assert comparable(resumed) == comparable(uninterrupted)
    assert consumed_per_step(resumed) == consumed_per_step(uninterrupted)
    assert sorted(consumed_per_step(resumed)) == list(range(STEPS))
    _, params_a, step_a = load_params(uninterrupted / "checkpoint")
    _, params_b, step_b = load_params(resumed / "checkpoint")
    assert step_a == step_b == STEPS
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)


def test_synchronous_grpo_killed_mid_rollout_mid_update_and_mid_checkpoint_resumes_bitwise(task, tmp_path):
    code, stderr = finish(stage(write_config(task, tmp_path / "uninterrupted")))
    assert code == 0, stderr[-2000:]
    killed_three_times(write_config(task, tmp_path / "killed"))
    assert_same_run(tmp_path / "uninterrupted", tmp_path / "killed")

    # The prompts file changed under the checkpoint: refused, not resumed over other records.
    prompts = tmp_path / "killed" / "prompts.jsonl"
    prompts.write_text(prompts.read_text().replace('"3="', '"7="', 1))
    cfg = GRPOConfig.model_validate(json.loads((tmp_path / "killed" / "config.yaml").read_text()))
    with pytest.raises(ConfigError, match=r"^data\.path: .* is not the prompt set this run's checkpoint"):
        run_grpo(cfg.model_copy(update={"steps": STEPS + 1}), log=lambda line: None)


def test_grpo_with_a_stale_worker_killed_three_times_regenerates_its_batches_and_equals_the_uninterrupted_run(
    task, tmp_path
):
    workers = {"rollout_workers": 1, "max_staleness": 1}
    code, stderr = finish(stage(write_config(task, tmp_path / "uninterrupted", **workers)))
    assert code == 0, stderr[-2000:]
    killed_three_times(write_config(task, tmp_path / "killed", **workers))
    assert_same_run(tmp_path / "uninterrupted", tmp_path / "killed")
    staleness = [r["rollout_staleness"] for r in read_metrics(tmp_path / "killed")]
    assert staleness == [0.0] + [1.0] * (STEPS - 1), staleness  # batch b from update b - 1, resumed or not


def test_multi_turn_grpo_killed_three_times_resumes_bitwise(tool_task, tmp_path):  # noqa: F811
    """Two-turn tool episodes (the calculator run in its sandbox): the episodes of a batch
    scored again after a kill are the same, and the run ends as the uninterrupted one."""
    code, stderr = finish(stage(write_config(tool_task, tmp_path / "uninterrupted", multiturn=True)))
    assert code == 0, stderr[-2000:]
    killed_three_times(write_config(tool_task, tmp_path / "killed", multiturn=True))
    assert_same_run(tmp_path / "uninterrupted", tmp_path / "killed")
    assert "env/tool_calls" in read_metrics(tmp_path / "killed")[-1]
