"""Asynchronous GRPO: rollout workers in their own processes (engine/posttrain/async_rollout.py).

max_staleness 0 with a worker is the synchronous run, bitwise; with staleness 2 the rollouts
are stale, their importance ratios logged and corrected, and the policy still learns; a worker
killed with SIGKILL mid-run is restarted, or the stage stops in one sentence and a re-run
resumes from its checkpoint. (Each run here starts a worker: JAX and a sampler compile in a
fresh process, ~10 s on 2 cores.)
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.contract import EXIT_PREEMPTED
from engine.posttrain.async_rollout import RolloutWorkerError
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import run_grpo
from engine.train.checkpoint import load_params
from flows.spec import Pipeline
from tests.conftest import child_xla_flags
from tests.test_grpo import copy_task, grpo_config, rewards_logged  # noqa: F401 - the shared fixture
from tests.test_lora_train import restore_adapter

# The workers of the runs that need not equal a synchronous one take a device of their own
# (the trainer keeps the 8 simulated ones): a smaller program to compile in each new worker.
ONE_DEVICE = {"XLA_FLAGS": child_xla_flags(1)}
UNTIMED = ("_seconds", "tokens_per_second", "tflops_per_device", "mfu")
LORA = {"lora.rank": 4, "lora.alpha": 8, "lora.target_modules": "all-linear"}


def logged(out) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(UNTIMED)} for r in records]


def test_staleness_zero_with_a_worker_is_the_synchronous_run_bitwise(copy_task, tmp_path):  # noqa: F811
    small = {"steps": 3, "prompts_per_step": 4, "num_generations": 8}
    run_grpo(grpo_config(copy_task, tmp_path / "sync", **small))
    logs = []
    run_grpo(grpo_config(copy_task, tmp_path / "async", rollout_workers=1, max_staleness=0, **small), log=logs.append)
    assert any("rollout worker 0 started" in line for line in logs), logs
    sync, async_ = logged(tmp_path / "sync"), logged(tmp_path / "async")
    assert len(sync) == 3 and sync == async_  # every logged number, exactly
    params = [load_params(tmp_path / name / "checkpoint")[1] for name in ("sync", "async")]
    flat = [np.concatenate([np.ravel(a) for a in jax.tree.leaves(p)]) for p in params]
    np.testing.assert_array_equal(flat[0], flat[1])


def test_lora_with_a_worker_sends_only_the_adapter_and_at_staleness_zero_is_the_synchronous_run_bitwise(
    copy_task,  # noqa: F811
    tmp_path,
):
    """The worker loads the frozen base once and samples from base + adapter unmerged; after
    each update only the adapter travels (the logged size is the adapter's bytes)."""
    small = {"steps": 3, "prompts_per_step": 4, "num_generations": 8, **LORA}
    run_grpo(grpo_config(copy_task, tmp_path / "sync", **small))
    logs: list[str] = []
    run_grpo(grpo_config(copy_task, tmp_path / "async", rollout_workers=1, **small), log=logs.append)
    sync, async_ = logged(tmp_path / "sync"), logged(tmp_path / "async")
    assert len(sync) == 3 and sync == async_
    assert sync[-1]["reward"] != sync[0]["reward"]  # the adapter moved: later rollouts sample through it
    adapters = [restore_adapter(tmp_path / name / "checkpoint") for name in ("sync", "async")]
    assert adapters[0].keys() == adapters[1].keys() and all(k.endswith(("_lora_a']", "_lora_b']")) for k in adapters[1])
    for key, value in adapters[0].items():
        np.testing.assert_array_equal(value, adapters[1][key])
    size = f"{len(adapters[1])} arrays, {sum(v.nbytes for v in adapters[1].values()) / 1e6:.3f} MB per update"
    assert any(f"weights to the rollout workers: {size}" in line for line in logs), logs


def test_stale_rollouts_log_their_importance_ratios_and_still_learn(copy_task, tmp_path):  # noqa: F811
    cfg = grpo_config(
        copy_task,
        tmp_path,
        rollout_workers=1,
        max_staleness=2,
        rollout_worker_env=ONE_DEVICE,
        **{"rollout_correction.mode": "token_truncate", "rollout_correction.clip_max": 2.0},
    )
    logs: list[str] = []
    result = run_grpo(cfg, log=logs.append)
    assert any("rollout worker 0 started" in line and "1 devices)" in line for line in logs), logs
    records = logged(tmp_path)
    curve = [r["reward"] for r in records]
    assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.4, curve
    # Batches 0 and 1 come from the starting weights (0 and 1 update old), then exactly 2.
    assert [r["rollout_staleness"] for r in records] == [0.0, 1.0] + [2.0] * (len(records) - 2)
    stale = records[2:]
    assert all(r["is_ratio_min"] <= r["is_ratio_mean"] <= r["is_ratio_max"] for r in records)
    assert any(r["is_ratio_max"] > 1.0 or r["is_ratio_min"] < 1.0 for r in stale)
    assert all(r["rollout_corr/k3_kl"] >= 0 and 0 <= r["is_clipped_fraction"] <= 1 for r in records)
    # The gap the step monitors: rounding for the first batch (the worker sampled with the trainer's
    # weights), the staleness for the later ones.
    gap = "sampling/sampling_logp_difference/max"
    assert records[0][gap] < 1e-4 < max(r[gap] for r in stale), [r[gap] for r in records]
    assert result["steps"] == 15


def test_a_killed_worker_is_restarted_or_stops_the_stage_in_one_sentence_and_a_rerun_resumes(
    copy_task,  # noqa: F811
    tmp_path,
):
    overrides = {
        "steps": 8,
        "prompts_per_step": 4,
        "num_generations": 4,
        "rollout_workers": 1,
        "max_staleness": 1,
        "checkpoint.every_steps": 1,
        "rollout_worker_env": ONE_DEVICE,
    }
    pids: list[int] = []

    def log(line: str) -> None:
        if "rollout worker 0 started (pid" in line:
            pids.append(int(line.split("pid ")[1].split(",")[0]))

    def kill_after(step: int) -> threading.Thread:
        """SIGKILL the newest worker once `step` steps are logged (the trainer then waits on it)."""

        def watch():
            path = tmp_path / "metrics.jsonl"
            while not (path.is_file() and len(path.read_text().splitlines()) >= step):
                time.sleep(0.05)
            os.kill(pids[-1], signal.SIGKILL)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    watcher = kill_after(2)
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 was killed by signal 9 while generating batch"):
        run_grpo(grpo_config(copy_task, tmp_path, rollout_worker_restarts=0, **overrides), log=log)
    watcher.join()
    kept = load_params(tmp_path / "checkpoint")[2]
    assert 2 <= kept <= 4  # the batches generated before the kill were trained on

    # The re-run resumes from that checkpoint; its worker is killed too, and restarted.
    lines: list[str] = []
    watcher = kill_after(kept + 1)
    result = run_grpo(grpo_config(copy_task, tmp_path, **overrides), log=lambda line: (lines.append(line), log(line)))
    watcher.join()
    assert any(f"resumed from checkpoint step {kept}" in line for line in lines), lines
    assert any("was killed by signal 9" in line and "restarting it" in line for line in lines), lines
    assert result["steps"] == 8
    assert [r["step"] for r in logged(tmp_path)] == list(range(1, 9))


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_with_a_worker_in_flight_saves_exits_143_leaves_no_worker_and_a_rerun_resumes(
    copy_task,  # noqa: F811
    tmp_path,
):
    """The engine's entry point, SIGTERMed as a process group (a preemption notice or Ctrl-C
    reaching the worker too) while the worker generates ahead: the trainer saves the current
    step and exits EXIT_PREEMPTED, its worker is gone, and the same config resumes there."""
    steps = 30
    cfg = grpo_config(
        copy_task,
        tmp_path,
        steps=steps,
        prompts_per_step=4,
        num_generations=4,
        rollout_workers=1,
        max_staleness=1,
        rollout_worker_env=ONE_DEVICE,
    )  # checkpoint.every_steps is 100: the only checkpoint is SIGTERM's
    config = tmp_path / "grpo.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.posttrain.grpo", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-2000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, stderr.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = stderr.read_text()
    saved = int(re.search(r"SIGTERM: saved checkpoint at step (\d+)", log).group(1))
    assert 2 <= saved < steps and load_params(tmp_path / "checkpoint")[2] == saved
    workers = [int(pid) for pid in re.findall(r"rollout worker 0 started \(pid (\d+)", log)]
    assert workers == [workers[0]] and workers[0] != proc.pid  # it ignored SIGTERM: never restarted
    assert not alive(workers[0])  # the trainer stopped it before exiting

    lines: list[str] = []
    result = run_grpo(cfg, log=lines.append)
    assert any(f"resumed from checkpoint step {saved}" in line for line in lines), lines
    assert result["steps"] == steps
    assert [r["step"] for r in logged(tmp_path)] == list(range(1, steps + 1))


def test_bad_estimator_loss_and_staleness_settings_are_refused_in_one_sentence(copy_task, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="max_staleness must be 0 .on-policy. or more updates, not -1"):
        grpo_config(copy_task, tmp_path, max_staleness=-1)
    with pytest.raises(ConfigError, match="max_staleness 2 needs rollout_workers >= 1"):
        grpo_config(copy_task, tmp_path, max_staleness=2)
    with pytest.raises(ConfigError, match=r"unknown policy loss 'dapoo': registered are grpo, bnpo, dr_grpo, dapo"):
        grpo_config(copy_task, tmp_path, loss_type="dapoo")
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'rlo': registered are grpo, rloo, reinforce"):
        grpo_config(copy_task, tmp_path, advantage_estimator="rlo")
    with pytest.raises(ConfigError, match="loss_type cispo clips the importance weight at epsilon_high"):
        grpo_config(copy_task, tmp_path, loss_type="cispo")
    cfg = load_config(
        tree={**grpo_config(copy_task, tmp_path).model_dump(), "loss_type": "no_such:loss"}, schema=GRPOConfig
    )
    with pytest.raises(ConfigError, match="loss_type: cannot import module 'no_such'"):
        run_grpo(cfg)


def test_a_user_loss_module_is_found_at_plan_time_and_its_source_is_part_of_the_id(copy_task, tmp_path, monkeypatch):  # noqa: F811
    def plan():
        p = Pipeline("user-loss", store=tmp_path / "store")
        base = p.stage("base", task="test-checkpoint-copy", config={"path": str(copy_task)})
        p.stage(
            "grpo",
            task="grpo",
            inputs={"checkpoint": base},
            config={
                "data": {"path": str(copy_task / "prompts.jsonl")},
                "rewards": [{"function": "exact_match"}],
                "loss_type": "my_pg_loss:vanilla",
            },
        )
        return p.plan().stages["grpo"].job.artifact_id

    with pytest.raises(ConfigError, match=r"key 'loss_type': cannot find module 'my_pg_loss' of 'my_pg_loss:vanilla'"):
        plan()
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "my_pg_loss.py"
    module.write_text(
        "def vanilla(ratio, advantages_b1, logp_bt, **kwargs):\n    return -advantages_b1 * logp_bt, {}\n"
    )
    first = plan()
    module.write_text(module.read_text() + "# edited\n")
    assert plan() != first
