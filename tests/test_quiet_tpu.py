"""A quiet console with libtpu installed and no TPU attached (engine/tpu_probe.py): `trainflow
run` (two stages), `export`, `convert` and `plan --target v5e-16`, started as a user starts
them (no JAX_PLATFORMS, no TPU_ variable), print none of libtpu's TPU-probe lines, where a
bare `import jax; jax.devices()` in the same environment prints them; a process that asks
for the TPU still fails loudly."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from engine.tpu_probe import MARK, QUIET_TPU_ENV, drop_quiet_tpu_env, quiet_tpu_probe, tpu_attached
from tests.conftest import REPO, child_xla_flags

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or tpu_attached(),
    reason="needs libtpu installed (the test extra) on a host without a TPU",
)

PROBE = re.compile(r"host bounds|could not determine TPU|INVALID_ARGUMENT|^E0000|InitGoogle|TPU_WORKER", re.M)
"""What libtpu prints when it probes for a TPU VM that is not there."""


def user_env() -> dict[str, str]:
    """This process's environment less what the suite and the engine set for themselves: no
    JAX_PLATFORMS, no TPU_ variables, no logging levels; one CPU device, compiled fast."""
    env = dict(os.environ)
    drop_quiet_tpu_env(env)
    for name in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", *[n for n in env if n.startswith("TPU_")]):
        env.pop(name, None)
    return {**env, "PYTHONPATH": str(REPO), "XLA_FLAGS": child_xla_flags()}


def run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=900)


def trainflow(*args, cwd) -> str:
    """stdout and stderr of a `trainflow` command that must succeed."""
    proc = run([sys.executable, "-m", "flows.cli", *map(str, args)], cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"trainflow {' '.join(map(str, args))} exited {proc.returncode}:\n{output[-3000:]}"
    return output


def test_the_probe_is_quieted_only_where_no_slice_is_described():
    env: dict[str, str] = {}
    assert quiet_tpu_probe(env) == QUIET_TPU_ENV and env[MARK] == ",".join(QUIET_TPU_ENV)
    drop_quiet_tpu_env(env)
    assert env == {}  # a child starts without it, and decides for its own host
    described = {"TPU_ACCELERATOR_TYPE": "v5litepod-16"}
    assert quiet_tpu_probe(described) == {} and described == {"TPU_ACCELERATOR_TYPE": "v5litepod-16"}


def test_asking_for_the_tpu_without_one_still_fails_loudly(tmp_path):
    code = "import engine, jax; jax.devices()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**user_env(), "JAX_PLATFORMS": "tpu"}, capture_output=True
    )
    assert proc.returncode != 0 and b"Unable to initialize backend 'tpu'" in proc.stderr


@pytest.mark.slow
def test_run_export_convert_and_plan_print_no_tpu_probe_lines(tmp_path):
    # The precondition: this libtpu, probed bare in this environment, does print them.
    bare = run([sys.executable, "-c", "import jax; jax.devices()"], tmp_path)
    if not PROBE.search(bare.stdout + bare.stderr):
        pytest.skip("this libtpu prints no probe lines here even unquieted")
    pipeline = tmp_path / "quiet.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "quiet",
                "store": str(tmp_path / "store"),
                "stages": {
                    "tokenize": {
                        "task": "tokenize",
                        "config": {
                            "sources": [{"format": "text", "path": "{stdlib}/a*.py"}],
                            "tokenizer": {"vocab_size": 300},
                            "workers": 1,
                        },
                    },
                    "pretrain": {
                        "task": "pretrain",
                        "inputs": {"dataset": "tokenize"},
                        "config": {
                            "model": "tiny",
                            "steps": 2,
                            "data": {"seq_len": 32, "batch_size": 8, "eval_batches": 0},
                        },
                    },
                },
            }
        )
    )
    outputs = {"run": trainflow("run", pipeline, cwd=tmp_path)}
    (pretrained,) = (tmp_path / "store" / "pretrain").iterdir()
    outputs["export"] = trainflow("export", pretrained, "--out", tmp_path / "hf", "--json", cwd=tmp_path)
    outputs["convert"] = trainflow(
        "convert", tmp_path / "hf", "--store", tmp_path / "converted", "--json", cwd=tmp_path
    )
    outputs["plan"] = trainflow("plan", pipeline, "--target", "v5e-16", "pretrain.data.batch_size=16", cwd=tmp_path)
    for command, output in outputs.items():
        assert not PROBE.search(output), f"trainflow {command} printed libtpu's probe:\n{output[-3000:]}"
    converted = json.loads([line for line in outputs["convert"].splitlines() if line.startswith("{")][-1])
    assert converted["status"] == "ran"
    # The plan still compiled for the slice through libtpu.
    assert "stage pretrain on v5e-16: 16 x TPU v5e (topology v5e:4x4)" in outputs["plan"]
    assert "compiled" in outputs["plan"]
