"""GRPO's episodes on an OpenEnv environment server (engine/posttrain/openenv_env.py).

The server is OpenEnv's own (openenv-core's create_app on uvicorn) serving tests/openenv_echo.py,
OpenEnv's template echo environment with a hold: a step can be made to wait, so that a GRPO run
is killed in the middle of an episode. Then:

- a run killed mid-episode and resumed equals the uninterrupted one: every metrics line (timings
  aside) and the final params, bitwise (the batch in flight is generated again, episodes included);
- its episode rewards are the server's (0.1 per character the model sent);
- a server that returns no observation text, one that does not answer in time, and a served one
  that died each fail the episode promptly, and a dead served server is started again.
"""

from __future__ import annotations

import json
import os
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
from engine.train.checkpoint import load_params
from engine.train.metrics import read_metrics
from tests.conftest import child_xla_flags
from tests.deps import need
from tests.test_grpo import grpo_config, make_copy_task

need("openenv")
from engine.posttrain import openenv_env  # noqa: E402
from engine.posttrain.openenv_env import OpenEnvEnvironment, ServeConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
TIMEOUT = 600
ECHO = {
    "environment": "tests.openenv_echo:PausingEcho",
    "action": "tests.openenv_echo:EchoAction",
    "observation": "tests.openenv_echo:EchoObservation",
    "path": str(REPO),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(URL, hold directory) of an OpenEnv server of tests/openenv_echo.py on 127.0.0.1."""
    hold = tmp_path_factory.mktemp("hold")
    port = openenv_env.free_port()
    argv = [sys.executable, "-m", "engine.posttrain.openenv_env", ServeConfig(**ECHO).model_dump_json(), str(port)]
    env = {**os.environ, "OPENENV_PAUSE_DIR": str(hold), "OPENENV_PAUSE_SECONDS": "60"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not openenv_env.healthy(url):
        assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.2)
    yield url, hold
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    cfg = ModelConfig(
        vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=24, max_seq_len=8
    )
    return make_copy_task(tmp_path_factory.mktemp("openenv_task"), cfg)


def write_config(task: Path, out: Path, url: str) -> Path:
    """Two-turn episodes of one token each on the server; a checkpoint every step."""
    out.mkdir(parents=True, exist_ok=True)
    tree = grpo_config(task, out, steps=STEPS, prompts_per_step=2, num_generations=4).model_dump(mode="json")
    tree["rewards"] = []
    tree["environment"] = {"factory": "openenv", "max_turns": 2, "max_turn_tokens": 1, "kwargs": {"url": url}}
    tree["max_completion_length"] = 4
    tree["checkpoint"].update(every_steps=1, keep=STEPS + 1, async_save=False)
    path = out / "config.yaml"
    path.write_text(json.dumps(tree))  # JSON is YAML
    GRPOConfig.model_validate(tree)
    return path


def stage(config: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "engine.posttrain.grpo", str(config)]
    env = {**os.environ, "XLA_FLAGS": child_xla_flags()}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def comparable(metrics_dir: Path) -> list[dict]:
    timing = ("seconds", "tokens_per_second", "tflops", "mfu")
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in read_metrics(metrics_dir)]


def test_grpo_killed_mid_episode_resumes_to_the_uninterrupted_run(task, server, tmp_path):
    url, hold = server
    uninterrupted = stage(write_config(task, tmp_path / "uninterrupted", url))
    _, stderr = uninterrupted.communicate(timeout=TIMEOUT)
    assert uninterrupted.returncode == 0, stderr[-2000:]

    killed_config = write_config(task, tmp_path / "killed", url)
    proc = stage(killed_config)
    deadline = time.monotonic() + TIMEOUT
    while not (tmp_path / "killed/checkpoint/1").exists():  # a step committed, then hold an episode's step
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    (hold / "arm").touch()
    while not (hold / "paused").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no episode step after the arm"
        time.sleep(0.05)
    proc.kill()  # in the middle of an episode: its session is open on the server, its step unanswered
    proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL
    resumed = stage(killed_config)
    _, stderr = resumed.communicate(timeout=TIMEOUT)
    assert resumed.returncode == 0 and "resumed from checkpoint step" in stderr, stderr[-2000:]

    records = comparable(tmp_path / "killed")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records == comparable(tmp_path / "uninterrupted")
    assert all(r["env/failed"] == 0.0 and r["env/turns"] == 2.0 for r in records), records
    # The server's reward: 0.1 per character, two one-character turns (the EOS ends a turn
    # empty: 0.1 or 0.2 an episode).
    assert all(0.1 <= r["reward/environment/mean"] <= 0.2 + 1e-9 for r in records), records
    _, params_a, step_a = load_params(tmp_path / "uninterrupted/checkpoint")
    _, params_b, step_b = load_params(tmp_path / "killed/checkpoint")
    assert step_a == step_b == STEPS
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)


def test_garbage_a_timeout_and_a_dead_server_fail_the_episode_and_a_served_server_restarts(server):
    url, _ = server
    garbage = OpenEnvEnvironment(url=url, observation_field="board")
    with pytest.raises(ValueError, match="the OpenEnv server's reset observation has no text 'board'"):
        garbage.reset({"prompt": "1="})

    slow = OpenEnvEnvironment(url=url, timeout_seconds=1.0)
    assert slow.reset({"prompt": "1="}) == "1="
    with pytest.raises(TimeoutError):
        slow.step("sleep:20")

    served = OpenEnvEnvironment(serve=ECHO)
    assert served.reset({"prompt": "2="}) == "2="
    assert served.step("34").reward == pytest.approx(0.2)
    [process] = [s.process for s in openenv_env._SERVERS.values()]
    process.kill()
    process.wait()
    with pytest.raises(Exception):  # noqa: B017 - the connection's own error: the episode fails
        served.step("5")
    again = OpenEnvEnvironment(serve=ECHO)
    assert again.reset({"prompt": "3="}) == "3=" and again.step("6").observation == "6"
    assert [s.starts for s in openenv_env._SERVERS.values()] == [2]

    with pytest.raises(ConfigError, match="environment.kwargs: .*give url .* or serve"):
        OpenEnvEnvironment(url=url, serve=ECHO)
