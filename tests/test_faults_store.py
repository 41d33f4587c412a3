"""Faults around the artifact store (issue 12): a copied store, a deleted manifest over
tampered checkpoints, an orphaned engine still saving, a full disk, a manifest that cannot
be written, and two small user mistakes. Stages run through tasks.runner, without Prefect.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import tests.pipeline_toys  # noqa: F401  (registers the toy stage kinds)
from engine.config import ConfigError, Strict
from engine.contract import MANIFEST
from engine.data import tokenize as engine_tokenize
from engine.data.sources import plan_source
from engine.train.checkpoint import load_params
from flows import cli
from flows.inspection import lineage
from flows.spec import Pipeline
from tasks import runner
from tasks.engine_stage import with_logged_finals
from tasks.launch.run import DiskFull, Diverged, StageFailed, run_child
from tasks.registry import StageContext, StageHooks, StageKind, register_stage, substitute_inputs
from tasks.runner import RAN, RESUMED, SKIPPED, execute_stage
from tasks.store import local as store_local
from tasks.store.records import read_manifest, verify_artifact
from tests.conftest import REPO, child_xla_flags

# The engine child compiles fastest on one device, at LLVM -O0 as the test process does (tests/conftest.py).
ONE_DEVICE = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}


def data_pipeline(store: Path, *, pretrain: bool = False) -> Pipeline:
    """The quickstart's first stages, tiny: arithmetic problems -> tokenize (-> pretrain)."""
    p = Pipeline("faults", store=store)
    p.stage(
        "problems",
        task="arithmetic",
        config={
            "max_number": 20,
            "pretrain_problems": 2000,
            "sft_problems": 10,
            "rl_problems": 10,
            "eval_problems": 10,
        },
    )
    p.stage(
        "tokenize",
        task="tokenize",
        inputs={"corpus": "problems"},
        config={
            "sources": [{"format": "text", "path": "{input:corpus}/pretrain.txt", "unit": "line"}],
            "tokenizer": {"vocab_size": 300},
            "validation_fraction": 0.05,
            "workers": 1,
        },
    )
    if pretrain:
        p.stage(
            "pretrain",
            task="pretrain",
            inputs={"dataset": "tokenize"},
            launcher=ONE_DEVICE,
            config={
                "model": "tiny",
                "steps": 6,
                "log_every": 1,
                "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 1},
                "checkpoint": {"every_steps": 2, "keep": 3, "async_save": False},
            },
        )
    return p


def run_all(plan, log: list | None = None) -> dict[str, str]:
    hooks = StageHooks(log=(log.append if log is not None else lambda _: None))
    return {name: execute_stage(p.job, plan.store, hooks).status for name, p in plan.stages.items()}


def artifact(plan, stage: str) -> Path:
    return plan.store.artifact_dir(stage, plan.stages[stage].job.artifact_id)


# --------------------------------------------------------------------------- a copied store


def test_a_copied_store_with_deleted_manifests_rebuilds_them_under_the_same_ids(tmp_path):
    original = data_pipeline(tmp_path / "store").plan()
    assert run_all(original) == {"problems": RAN, "tokenize": RAN}
    shutil.copytree(tmp_path / "store", tmp_path / "copy", symlinks=True)
    shutil.rmtree(tmp_path / "store")  # moved, not only copied: nothing may point back to it

    copy = data_pipeline(tmp_path / "copy").plan()
    ids = {name: p.job.artifact_id for name, p in copy.stages.items()}
    assert ids == {name: p.job.artifact_id for name, p in original.stages.items()}
    tokenize_dir = artifact(copy, "tokenize")
    before = read_manifest(tokenize_dir)

    # The dataset's engine fingerprint, as a resumed child would compute it in the copy,
    # is the one its meta.json recorded in the original store.
    job = copy.stages["tokenize"].job
    config = substitute_inputs(job.config, {"corpus": copy.store.open_input("problems", ids["problems"])}, "tokenize")
    parts = [part for i, src in enumerate(config.sources) for part in plan_source(i, src, 1 << 26)]
    recorded = json.loads((tokenize_dir / "data" / "meta.json").read_text())["fingerprint"]
    assert engine_tokenize.fingerprint(config, parts) == recorded

    (tokenize_dir / MANIFEST).unlink()
    (artifact(copy, "problems") / MANIFEST).unlink()
    log = []
    assert run_all(copy, log) == {"problems": RESUMED, "tokenize": RESUMED}
    assert any("holds a finished dataset without a complete manifest" in line for line in log)
    after = read_manifest(tokenize_dir)
    assert after["status"] == "complete" and after["id"] == ids["tokenize"]
    # The same shards and tokenizer (tokenize.yaml and meta.json also hold the input's path).
    located = {"tokenize.yaml", "data/meta.json"}
    assert {k: v for k, v in after["files"].items() if k not in located} == {
        k: v for k, v in before["files"].items() if k not in located
    }
    assert after["metrics"] == before["metrics"]
    assert (
        after["parents"]
        == before["parents"]
        == [
            {
                "input": "corpus",
                "stage": "problems",
                "id": ids["problems"],
                "kind": "corpus",
                "path": f"problems/{ids['problems']}",
            }
        ]
    )
    assert verify_artifact(tokenize_dir) == []


# --------------------------------------------------------------------------- tampered checkpoints


def flip_a_byte(step_dir: Path) -> str:
    """Corrupt one parameter file of a checkpoint step; returns its path within the step."""
    target = next(p for p in sorted((step_dir / "params").rglob("*")) if p.is_file() and p.stat().st_size > 64)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target.relative_to(step_dir).as_posix()


def test_a_deleted_manifest_over_tampered_checkpoints_resumes_from_verified_steps_only(tmp_path):
    plan = data_pipeline(tmp_path / "store", pretrain=True).plan()
    run_all(plan)
    out = artifact(plan, "pretrain")
    reference = read_manifest(out)
    shutil.copytree(out / "checkpoint" / "6", tmp_path / "reference" / "6")  # a checkpoint directory of its own

    (out / MANIFEST).unlink()
    older = flip_a_byte(out / "checkpoint" / "2")  # kept, never read on resume
    flip_a_byte(out / "checkpoint" / "6")  # the latest: what a resume would restore
    log = []
    result = execute_stage(plan.stages["pretrain"].job, plan.store, StageHooks(log=log.append))

    assert result.status == RESUMED
    assert any(
        f"checkpoint step 2 in {out / 'checkpoint'} differs from the digests" in line and older in line for line in log
    ), log
    assert any("falling back to checkpoint step 4" in line for line in log), log
    manifest = read_manifest(out)
    assert manifest["status"] == "complete" and verify_artifact(out) == []
    assert sorted(p.name for p in (out / "checkpoint").iterdir() if p.name.isdigit()) == ["4", "6"]
    # Retrained from step 4: the same parameters as the untouched run, and its final metrics.
    _, params, step = load_params(out / "checkpoint")
    _, expected, _ = load_params(tmp_path / "reference")
    assert step == 6
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, expected)
    for key in ("final_loss", "eval_loss", "steps"):
        assert manifest["metrics"][key] == reference["metrics"][key], key


def test_a_child_resumed_at_its_last_step_still_reports_its_final_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"step": 5, "loss": 2.5},
                {"step": 6, "loss": 2.0, "grad_norm": 0.5},
                {"step": 6, "eval_loss": 2.25},
            ]
        )
    )
    nothing_trained = {"steps": 6, "final_loss": None, "num_params": 7}
    assert with_logged_finals(nothing_trained, metrics) == {
        "loss": 2.0,
        "grad_norm": 0.5,
        "eval_loss": 2.25,
        "steps": 6,
        "final_loss": 2.0,
        "num_params": 7,
    }
    trained = {"steps": 6, "final_loss": 1.0, "loss": 1.0}
    assert with_logged_finals(trained, metrics) == trained


# --------------------------------------------------------------------------- an orphaned engine

# An engine stand-in that, told to stop (its parent died: PR_SET_PDEATHSIG), takes its time
# to save. It writes only to files: its parent and so its stdout are gone by then.
SLOW_SAVER = r"""
import json, os, signal, sys, time
out, events = sys.argv[1], sys.argv[2]
def event(what):
    with open(events, "a") as f:
        f.write(f"{what} {os.getpid()} {time.time():.6f}\n")
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
event("start")
resumed = os.path.exists(os.path.join(out, "checkpoint"))
for _ in range(0 if resumed else 6000):
    if stop:
        time.sleep(1.5)  # a slow checkpoint
        with open(os.path.join(out, "checkpoint"), "w") as f:
            f.write("saved by " + str(os.getpid()))
        event("saved")
        sys.exit(143)
    time.sleep(0.01)
with open(os.path.join(out, "final"), "w") as f:
    f.write("finished by " + str(os.getpid()))
event("finished")
print(json.dumps({"result": {"resumed": resumed}}), flush=True)
"""


class SlowSaverConfig(Strict):
    events: str


@register_stage
class SlowSaver(StageKind):
    task = "slow-saver"
    output = "checkpoint"
    config_schema = SlowSaverConfig
    non_semantic = ("events",)
    launches_child = True

    def run(self, ctx: StageContext) -> dict:
        return ctx.launch([sys.executable, "-c", SLOW_SAVER, str(ctx.out_dir), ctx.config.events]).result or {}


ORPHANING_RUN = """
import sys
from tests.test_faults_store import slow_saver_plan
from tasks.registry import StageHooks
from tasks.runner import execute_stage
plan = slow_saver_plan(sys.argv[1], sys.argv[2])
execute_stage(plan.stages["train"].job, plan.store, StageHooks(log=lambda m: print(m, flush=True)))
"""


def slow_saver_plan(store, events):
    p = Pipeline("orphan", store=store)
    p.stage("train", task="slow-saver", config={"events": str(events)})
    return p.plan()


def events_of(path: Path) -> list[tuple[str, int, float]]:
    lines = path.read_text().split("\n") if path.is_file() else []
    return [(what, int(pid), float(at)) for what, pid, at in (line.split() for line in lines if line)]


def test_a_new_run_waits_for_the_orphaned_engine_of_a_killed_run(tmp_path):
    store, events = tmp_path / "store", tmp_path / "events"
    first = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_RUN, str(store), str(events)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not events_of(events):
        assert first.poll() is None and time.monotonic() < deadline, "the first run's engine never started"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)  # the run only: its engine gets SIGTERM and starts saving
    first.wait()

    plan = slow_saver_plan(store, events)
    log: list[tuple[float, str]] = []
    result = execute_stage(plan.stages["train"].job, plan.store, StageHooks(log=lambda m: log.append((time.time(), m))))

    (orphan_start, orphan, _), (saved, saver, saved_at), (start, engine, started_at), (finished, *_) = events_of(events)
    assert (orphan_start, saved, start, finished) == ("start", "saved", "start", "finished")
    assert saver == orphan != engine
    assert started_at > saved_at, "the new run's engine started while the orphan was still saving"
    waiting = [m for _, m in log if m.startswith("waiting for")]
    assert waiting and f"pid {first.pid}" in waiting[0] and "that run has exited" in waiting[0], log
    assert result.status == RESUMED and result.metrics == {"resumed": True}
    out = artifact(plan, "train")
    assert (out / "checkpoint").read_text() == f"saved by {orphan}"
    assert read_manifest(out)["status"] == "complete" and verify_artifact(out) == []


# --------------------------------------------------------------------------- classified errors


@pytest.fixture(scope="module")
def retryable():
    """The flow's decision: whether a stage that raised `error` is retried."""
    from flows.pipeline import NOT_RETRIED  # Prefect: seconds to import, so only here

    return lambda error: not isinstance(error, NOT_RETRIED)


class DiskFullConfig(Strict):
    filename: str | None = None


@register_stage
class FillsTheDisk(StageKind):
    task = "fills-the-disk"
    output = "dataset"
    config_schema = DiskFullConfig

    def run(self, ctx: StageContext) -> dict:
        (ctx.out_dir / "part").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([ctx.config.filename] if ctx.config.filename else []))


@pytest.mark.parametrize("filename", [None, "/data/shard-00003.bin"])
def test_a_full_disk_is_not_retried_and_names_the_path(tmp_path, filename, retryable):
    p = Pipeline("full", store=tmp_path / "store")
    p.stage("fill", task="fills-the-disk", config={"filename": filename})
    plan = p.plan()
    out = artifact(plan, "fill")
    with pytest.raises(DiskFull) as caught:
        execute_stage(plan.stages["fill"].job, plan.store)
    # A failed write() often carries no filename: the artifact directory is named instead.
    assert (
        str(caught.value) == f"stage 'fill': No space left on device writing {filename or out}; free space, then re-run"
    )
    assert not retryable(caught.value)
    manifest = read_manifest(out)
    assert manifest["status"] == "failed" and str(filename or out) in manifest["error"]
    assert plan.status()["fill"]["state"] == "failed"


CRASHES_WITH = r"""
import sys
kind = sys.argv[1]
if kind == "disk":
    raise OSError(28, "No space left on device", "/store/pretrain/0123/checkpoint/6.orbax-checkpoint-tmp/params")
if kind == "nan":
    print("error: non-finite loss (nan) at step 7; stopped. The last good checkpoint (step 6) is intact",
          file=sys.stderr)
    sys.exit(1)
raise MemoryError("a worker was lost")
"""


@pytest.mark.parametrize(
    "kind, error, message, retried",
    [
        (
            "disk",
            DiskFull,
            (
                "stage 'x': OSError: [Errno 28] No space left on device: "
                "'/store/pretrain/0123/checkpoint/6.orbax-checkpoint-tmp/params' (exit 1)"
            ),
            False,
        ),
        ("nan", Diverged, "stage 'x': non-finite loss (nan) at step 7", False),
        ("crash", StageFailed, "stage 'x': exited with code 1: MemoryError: a worker was lost", True),
    ],
)
def test_child_failures_are_classified_retryable_or_not(kind, error, message, retried, retryable):
    with pytest.raises(error) as caught:
        run_child([sys.executable, "-c", CRASHES_WITH, kind], log=lambda _: None, what="stage 'x'")
    assert str(caught.value).startswith(message)
    assert retryable(caught.value) is retried


def test_tokenize_on_a_full_disk_says_where_it_was_writing(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus\n" for i in range(200)))
    config = tmp_path / "tokenize.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "sources": [{"format": "text", "path": str(corpus), "unit": "line"}],
                "tokenizer": {"vocab_size": 300},
                "workers": 1,
            }
        )
    )

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a failed write() raises it: no filename

    monkeypatch.setattr(engine_tokenize, "write_meta", full)
    assert engine_tokenize.main([str(config), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: No space left on device writing {tmp_path / 'out'}"]


# --------------------------------------------------------------------------- small things


def test_a_manifest_that_cannot_be_written_never_stays_running(tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    p = Pipeline("toy", store=tmp_path / "store")
    p.stage("a", task="toy-source", config={"value": 2, "trace": str(trace)})
    plan = p.plan()
    out = artifact(plan, "a")
    write = runner.write_json_atomic

    def fail_when(status):
        def write_json_atomic(path, value):
            if value["status"] in status:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            write(path, value)

        return write_json_atomic

    def failing(status):  # the runner writes the failed manifest, the store the others
        monkeypatch.setattr(runner, "write_json_atomic", fail_when(status))
        monkeypatch.setattr(store_local, "write_json_atomic", fail_when(status))

    # The final write fails, the failure is recorded.
    failing({"complete"})
    with pytest.raises(DiskFull, match=re.escape(f"No space left on device writing {out}")):
        execute_stage(plan.stages["a"].job, plan.store)
    assert read_manifest(out)["status"] == "failed" and plan.status()["a"]["state"] == "failed"

    # Nothing after the first write lands: the manifest still says running, the store does not.
    failing({"complete", "failed"})
    with pytest.raises(DiskFull):
        execute_stage(plan.stages["a"].job, plan.store)
    assert read_manifest(out)["status"] == "running"
    assert plan.status()["a"]["state"] == "partial" and lineage(out)["status"] == "partial"

    failing(set())
    assert execute_stage(plan.stages["a"].job, plan.store).status == RESUMED
    assert plan.status()["a"]["state"] == "complete"
    assert execute_stage(plan.stages["a"].job, plan.store).status == SKIPPED


def test_an_unknown_stage_key_lists_the_valid_ones_or_the_closest(tmp_path):
    def error_of(**options):
        p = Pipeline("keys", store=tmp_path)
        p.stage("a", task="toy-source", **options)
        with pytest.raises(ConfigError) as caught:
            p.plan()
        return str(caught.value)

    assert error_of(retires=2) == "pipeline 'keys': stages.a: unknown key 'retires'; did you mean 'retries'?"
    assert error_of(zzz=1) == (
        "pipeline 'keys': stages.a: unknown key 'zzz'; valid keys: config, inputs, launcher, "
        "matrix, max_parallel, retries, retry_backoff, retry_delay_seconds, task, when"
    )


def test_lineage_of_a_directory_that_is_not_an_artifact_fails_in_one_line(tmp_path, capsys):
    assert cli.main(["lineage", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path} is not an artifact (no readable artifact.json); `trainflow lineage` takes an artifact"
    ]
