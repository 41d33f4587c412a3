"""More than one process on this machine: jax.distributed on 127.0.0.1 with gloo collectives.

A stage's result must not depend on how many processes computed it: every process builds the
same global batch and places the rows its devices hold, so 1 x 4, 2 x 2 and 4 x 1
(processes x devices) give the same losses and parameters whichever mesh axes span the
processes; SIGTERM delivered to the ranks at different times stops them at one agreed step. (The
fine-tuning stages on 2 processes: tests/test_multihost_posttrain.py, a file of its own so
that the two halves run side by side under `pytest -n 2 --dist loadfile`.)
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from engine.data.shards import write_dataset
from engine.train.checkpoint import load_params
from tasks.launch.gang import child_env
from tasks.launch.run import LauncherSpec, commands, run_child
from tests.conftest import child_xla_flags

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

STEPS = 16  # enough for a signal after step 5 to land well before the end
MESH_2x2 = {"data": 2, "fsdp": 1, "tensor": 2}
# processes x devices per process -> the mesh; every axis of size > 1 spans processes somewhere.
LAYOUTS = {
    "1x4": (1, 4, MESH_2x2),
    "2x2": (2, 2, MESH_2x2),
    "4x1": (4, 1, {"data": 1, "fsdp": 2, "tensor": 2}),
    "2x2-context": (2, 2, {"data": 1, "context": 2, "tensor": 2}),
}  # each row's positions on 2 processes


def stdlib_bytes(out: Path, documents: int, length: int, validation: int) -> None:
    """A token dataset at `out` of standard-library sources as byte tokens (vocab 257, EOS 256)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:documents]
    docs = [
        np.concatenate([np.frombuffer(Path(p).read_bytes(), np.uint8).astype(np.int32)[:length], [256]]) for p in files
    ]
    write_dataset(out, {"train": docs[:-validation], "validation": docs[-validation:]}, vocab_size=257, eos_id=256)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Standard-library sources as byte tokens: enough documents that packing mixes them."""
    out = tmp_path_factory.mktemp("bytes")
    stdlib_bytes(out, documents=60, length=3000, validation=8)
    return out


def write_config(out: Path, dataset: Path, mesh: dict) -> Path:
    cfg = {
        "model": {"preset": "tiny", "vocab_size": 260, "max_seq_len": 64},
        "mesh": mesh,
        "steps": STEPS,
        "log_every": 1,
        "data": {"path": str(dataset), "seq_len": 32, "batch_size": 8, "eval_batches": 1},
        "checkpoint": {"directory": str(out / "checkpoint"), "every_steps": 1000, "async_save": False},
        "metrics_dir": str(out),
        "progress": False,
        "optimizer": {"learning_rate": 1e-2},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.yaml").write_text(yaml.safe_dump(cfg))
    return out / "train.yaml"


def launcher(processes: int, devices: int) -> LauncherSpec:
    env = {"XLA_FLAGS": child_xla_flags(devices), "JAX_PLATFORMS": "cpu"}
    return LauncherSpec(kind="local-multi", processes=processes, env=env) if processes > 1 else LauncherSpec(env=env)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def params(out: Path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(load_params(out / "checkpoint", as_numpy=True)[1])]


@pytest.fixture(scope="module")
def layouts(dataset, tmp_path_factory) -> dict[str, Path]:
    """Each layout's run, 16 steps from the same start. The layouts of one shape (2 x 2, and
    2 x 2 with context parallelism) run one after another in one gang (tests/mh_driver.py): their
    2 processes start, import and join once."""
    runs = {
        name: write_config(tmp_path_factory.mktemp(name), dataset, mesh).parent for name, (*_, mesh) in LAYOUTS.items()
    }
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, (processes, devices, _) in LAYOUTS.items():
        shapes.setdefault((processes, devices), []).append(name)
    for (processes, devices), names in shapes.items():
        run_child(
            [
                sys.executable,
                "-m",
                "tests.mh_driver",
                *(f"engine.train.pretrain={runs[n] / 'train.yaml'}" for n in names),
            ],
            launcher=launcher(processes, devices),
            log=lambda line: None,
            cwd=REPO,
        )
    return runs


def test_pretraining_does_not_depend_on_the_process_layout(layouts):
    """The same mesh over 2 processes or 1 gives the same bits; other meshes (4 processes,
    tensor parallel; 2 processes, each row's positions split over them) the same run up to
    summation order: AdamW steps at lr 1e-2 carry a last-bit difference in a reduction (30 steps:
    to ~2e-6 in 2 of the 16,640 entries of a 260 x 64 matrix; 5.8e-7 before the fused cross
    entropy changed the rounding). Context parallelism sums each query's keys in one product,
    not in blocked's two parts: after 30 steps one entry of a 4,096-entry attention matrix ended 1.4e-5 away
    (an entry whose gradient is near zero, which AdamW's normalised update magnifies; 3.2e-5 on
    an AMD EPYC with AVX2, and its losses up to 1.4e-6 apart). Tensor parallelism (4x1) splits
    the heads' products over processes: on an Intel Xeon with AVX-512 one entry of that same
    matrix, whose gradient is near zero, ended 2.1e-5 away (-3.11e-4 against -3.32e-4), the
    losses within 1e-6 all the same."""
    reference = losses(layouts["1x4"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for name in ("2x2", "4x1", "2x2-context"):
        # Context parallelism's other summation order moves a loss by up to 1.4e-6 (AMD EPYC, AVX2).
        np.testing.assert_allclose(
            losses(layouts[name]), reference, rtol=3e-6 if "context" in name else 1e-6, err_msg=name
        )
        for ours, theirs in zip(params(layouts[name]), params(layouts["1x4"])):
            if name == "2x2":
                np.testing.assert_array_equal(ours, theirs, err_msg=name)
            else:
                np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=5e-5, err_msg=name)


def test_a_checkpoint_four_processes_saved_loads_on_whatever_devices_are_here(layouts):
    model_cfg, restored, step = load_params(layouts["4x1"] / "checkpoint")  # one device of this process
    assert step == STEPS and model_cfg.vocab_size == 260
    leaf = jax.tree.leaves(restored)[0]
    assert leaf.sharding.device_set == {jax.local_devices()[0]}


def test_sigterm_to_two_ranks_a_second_apart_saves_once_and_the_resume_is_bitwise_equal(dataset, layouts, tmp_path):
    processes, devices, mesh = LAYOUTS["2x2"]
    config = write_config(tmp_path, dataset, mesh)
    argv = [sys.executable, "-m", "engine.train", str(config)]
    ranks = [
        subprocess.Popen(rank_argv, env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank_argv, env in commands(launcher(processes, devices), argv)
    ]
    try:
        deadline = time.time() + 180
        while not (tmp_path / "metrics.jsonl").is_file() or len(losses(tmp_path)) < 5:
            assert time.time() < deadline and all(r.poll() is None for r in ranks), "the run did not get going"
            time.sleep(0.1)
        ranks[0].send_signal(signal.SIGTERM)
        time.sleep(1.0)
        ranks[1].send_signal(signal.SIGTERM)
        codes = [r.wait(timeout=60) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    assert codes == [143, 143], [r.stdout.read()[-2000:] for r in ranks]
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoint").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 5 <= saved[0] < STEPS, saved  # one agreed step, saved once

    run_child(argv, launcher=launcher(processes, devices), log=lambda line: None)  # resume to the end
    assert losses(tmp_path) == losses(layouts["2x2"])
    for ours, theirs in zip(params(tmp_path), params(layouts["2x2"])):
        np.testing.assert_array_equal(ours, theirs)


def rank_pid(config: Path, rank: int) -> int | None:
    """The pid of the engine process that is `rank` of the run of `config` (from /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and str(config) in (proc / "cmdline").read_bytes().decode(errors="replace")
                and f"TRAINFLOW_PROCESS_ID={rank}".encode() in (proc / "environ").read_bytes().split(b"\0")
            ):
                return int(proc.name)
        except OSError:
            continue
    return None


def test_sigkill_of_one_rank_stops_the_gang_and_the_rerun_resumes_bitwise_equal(dataset, layouts, tmp_path):
    processes, devices, mesh = LAYOUTS["2x2"]
    config = write_config(tmp_path, dataset, mesh)
    cfg = yaml.safe_load(config.read_text())
    cfg["checkpoint"]["every_steps"] = 4  # a cadence does not change what is computed
    config.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "engine.train", str(config)]
    outcome: dict[str, BaseException] = {}

    def launch():
        try:
            run_child(argv, launcher=launcher(processes, devices), log=lambda line: None)
        except BaseException as error:  # noqa: BLE001 (handed to the test thread)
            outcome["error"] = error

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.time() + 240
    while not (tmp_path / "checkpoint" / "8" / "digests.json").is_file():  # step 8 committed
        assert time.time() < deadline and thread.is_alive(), "the run did not get going"
        time.sleep(0.05)
    os.kill(rank_pid(config, 1), signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the surviving rank was not stopped"
    assert "rank 1 was killed by SIGKILL" in str(outcome.get("error")), outcome
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoint").iterdir() if p.name.isdigit())
    assert 8 <= max(saved) < STEPS, saved

    lines: list[str] = []
    run_child(argv, launcher=launcher(processes, devices), log=lines.append)  # the re-run resumes
    assert any(f"resumed from checkpoint step {max(saved)}" in line for line in lines), lines[-20:]
    assert losses(tmp_path) == losses(layouts["2x2"])
    for ours, theirs in zip(params(tmp_path), params(layouts["2x2"])):
        np.testing.assert_array_equal(ours, theirs)
