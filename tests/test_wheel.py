"""The wheel works anywhere: built from the source tree and installed (not editable) into a
fresh venv, it runs the shipped tiny pipeline from an empty directory, with no checkout on
any path.

Reinstalling JAX, torch and Prefect into the new venv would take minutes, so the new venv
borrows this environment's third-party packages through a one-line .pth file. A path line
in a .pth only appends that directory to sys.path: the .pth files inside it are not run, so
setuptools' `__editable__.trainflow-*.pth` (the finder that maps `engine` to the checkout)
stays out, and the new venv's own site-packages, where the wheel went, comes first.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, child_xla_flags

pytestmark = pytest.mark.slow

# The shipped tiny pipeline, shortened: what is tested is where the code and the presets
# come from, not the training.
FAST = [
    "pretrain.steps=12",
    "pretrain.log_every=4",
    "pretrain.eval_every=12",
    "pretrain.schedule.warmup_steps=2",
    "pretrain.checkpoint.every_steps=6",
]


def run(argv: list, *, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def build_wheel(out: Path) -> Path:
    """A wheel of the working tree's files (tracked and untracked, not ignored), built in a
    copy so that a stale build/ or egg-info in the checkout can neither leak in nor be written."""
    if not (REPO / ".git").exists():
        pytest.skip("builds the wheel from a git checkout's file list")
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    source = out / "source"
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # a file deleted but not yet staged is still listed
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # No build isolation: setuptools is already here (torch and tensorflow need it), and
    # an isolated build would fetch it from the network.
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            out / "dist",
            source,
        ],
        cwd=out,
    )
    (wheel,) = (out / "dist").glob("trainflow-*.whl")
    return wheel


def fresh_venv(path: Path, wheel: Path) -> Path:
    """A venv holding the wheel, seeing this environment's third-party packages; its python."""
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel],
        cwd=path.parent,
    )
    new_site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=path).stdout.strip()
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (Path(new_site) / "_trainflow_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def test_wheel_runs_the_tiny_pipeline_without_a_checkout(tmp_path, prefect_server):
    wheel = build_wheel(tmp_path / "build")
    version = wheel.name.split("-")[1]
    venv = tmp_path / "venv"
    python = fresh_venv(venv, wheel)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    env["XLA_FLAGS"] = child_xla_flags()  # one device, compiled as the tests compile: the fastest

    where = json.loads(
        run(
            [
                python,
                "-c",
                "import json, sys, configs, engine, flows, tasks; print(json.dumps("
                "{'modules': [m.__file__ for m in (configs, engine, flows, tasks)], 'path': sys.path}))",
            ],
            cwd=empty,
            env=env,
        ).stdout
    )
    for module_file in where["modules"]:
        assert Path(module_file).is_relative_to(venv), f"{module_file} is not from the wheel's venv"
    assert str(REPO) not in where["path"], "the checkout is on the new venv's sys.path"

    assert run([venv / "bin" / "trainflow", "--version"], cwd=empty, env=env).stdout == f"trainflow {version}\n"

    # The C++ kernels build from the wheel's own files (sources and their shared header), into
    # an empty cache: a missing file would only show as auto's fallback to XLA's lowering.
    if shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"):
        reasons = run(
            [
                python,
                "-c",
                "from engine.ops import cpu_kernels; "
                "print([cpu_kernels.unavailable(n) for n in sorted(cpu_kernels.SOURCES)])",
            ],
            cwd=empty,
            env={**env, "TRAINFLOW_KERNEL_CACHE": str(tmp_path / "kernels")},
        ).stdout
        assert reasons.strip().splitlines()[-1] == "[None, None]", reasons

    pipeline = tmp_path / "pipeline" / "tiny.yaml"
    pipeline.parent.mkdir()
    pipeline.write_text(
        run(
            [
                python,
                "-c",
                "from importlib.resources import files; "
                "print(files('configs').joinpath('pipelines', 'tiny.yaml').read_text(), end='')",
            ],
            cwd=empty,
            env=env,
        ).stdout
    )
    store = tmp_path / "store"
    run([venv / "bin" / "trainflow", "run", pipeline, "--store", store, *FAST], cwd=empty, env=env, timeout=600)

    assert sorted(p.name for p in store.iterdir()) == ["pretrain", "tokenize"]
    for stage in ("tokenize", "pretrain"):
        (artifact,) = (store / stage).iterdir()
        assert json.loads((artifact / "artifact.json").read_text())["status"] == "complete", artifact
    assert list(empty.iterdir()) == [], "the run wrote into its working directory"
