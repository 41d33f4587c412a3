"""What orchestration costs: Prefect + the artifact store beside the work itself.

    python -m bench.pipeline_overhead [--stages 8] [--work-seconds 0.5] [--skip-real]

Three measurements, each side by side with its peer:

1. A chain of N stages whose work is a fixed sleep, run (a) through the Prefect flow and
   (b) through tasks.runner.execute_stage in a plain loop (the store protocol alone, no
   Prefect). Per-stage overhead = (wall - work) / N, for a first run and an all-skipped re-run.
2. The real tiny pipeline (tokenize -> pretrain, few steps): each stage's wall time in its
   Prefect task beside the time spent in the stage's own work (child process, JAX compile
   and training included).
3. `trainflow run` of that finished pipeline as a user types it (process start, imports,
   flow run, every stage skipped) beside `trainflow status` (no Prefect).
4. A sweep (`matrix:`) of N points (default 100) whose every point is finished: expanding it
   into a plan (ids and all), then skipping every point through the Prefect flow, beside the
   same skips through execute_stage in a plain loop and beside the single-stage skip of 1.
   Target: expand + skip under 10 s for 100 points.

Uses $PREFECT_API_URL if set, else starts a local Prefect server (SQLite) for the run.
Writes bench/results/pipeline_overhead.json (with --only-sweep: pipeline_overhead_sweep.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from importlib.metadata import version
from pathlib import Path

from bench import machine

REPO = Path(__file__).resolve().parent.parent
LOAD_AT_START = list(os.getloadavg())  # before the run: the run itself loads the machine
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
if "PREFECT_API_URL" not in os.environ:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="trainflow-bench-prefect-"))

from pydantic import Field  # noqa: E402

from engine.config import Strict  # noqa: E402
from tasks.registry import Input, StageContext, StageKind, register_stage  # noqa: E402


class SleepConfig(Strict):
    index: int = 0
    seconds: float = Field(0.5, ge=0)


@register_stage
class Sleep(StageKind):
    """Work of a known duration that writes a small file."""

    task = "bench-sleep"
    output = "dataset"
    inputs = {}
    config_schema = SleepConfig

    def run(self, ctx: StageContext) -> dict:
        time.sleep(ctx.config.seconds)
        (ctx.out_dir / "out.txt").write_text(str(ctx.config.index))
        return {"index": ctx.config.index}


@register_stage
class SleepAfter(Sleep):
    task = "bench-sleep-after"
    inputs = {"previous": Input("dataset")}


def chain(n: int, seconds: float, store: Path):
    from flows.spec import Pipeline

    p = Pipeline("bench-chain", store=store)
    previous = None
    for i in range(n):
        previous = p.stage(
            f"s{i}",
            task="bench-sleep" if previous is None else "bench-sleep-after",
            inputs={"previous": previous} if previous else {},
            config={"index": i, "seconds": seconds},
        )
    return p.plan()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_chain(n: int, seconds: float, root: Path) -> dict:
    from flows.pipeline import run_plan
    from tasks.runner import execute_stage

    def plain(plan):
        return {name: execute_stage(p.job, plan.store).status for name, p in plan.stages.items()}

    rows = {}
    for mode in ("prefect", "plain"):
        store = root / f"chain-{mode}"
        runner = (lambda plan: run_plan(plan)) if mode == "prefect" else plain
        first, _ = timed(lambda: runner(chain(n, seconds, store)))  # noqa: B023
        rerun, statuses = timed(lambda: runner(chain(n, seconds, store)))  # noqa: B023
        skipped = {s["status"] if isinstance(s, dict) else s for s in statuses.values()}
        assert skipped == {"skipped"}, statuses
        work = n * seconds
        rows[mode] = {
            "first_run_s": round(first, 3),
            "work_s": work,
            "overhead_per_stage_s": round((first - work) / n, 4),
            "all_skipped_rerun_s": round(rerun, 3),
            "skipped_per_stage_s": round(rerun / n, 4),
        }
    return rows


def sweep(n: int, store: Path):
    from flows.spec import Pipeline

    p = Pipeline("bench-sweep", store=store)
    p.stage("source", task="bench-sleep", config={"seconds": 0})
    p.stage(
        "point",
        task="bench-sleep-after",
        inputs={"previous": "source"},
        config={"seconds": 0},
        matrix={"index": list(range(n))},
    )
    return p.plan()


def bench_sweep(n: int, root: Path, chain_seconds: float) -> dict:
    from flows.pipeline import run_plan
    from tasks.runner import execute_stage

    store = root / "sweep"
    for planned in sweep(n, store).stages.values():  # every point finished, without Prefect
        execute_stage(planned.job, sweep(1, store).store)
    expand_s, plan = timed(lambda: sweep(n, store))
    assert len(plan.stages) == n + 1
    plain_s, statuses = timed(lambda: [execute_stage(p.job, plan.store).status for p in plan.stages.values()])
    assert set(statuses) == {"skipped"}, statuses
    prefect_s, summary = timed(lambda: run_plan(sweep(n, store)))
    assert {s["status"] for s in summary.values()} == {"skipped"}, summary
    single_s, single = timed(lambda: run_plan(chain(1, chain_seconds, root / "chain-prefect")))  # s0 is finished
    assert single["s0"]["status"] == "skipped", single
    return {
        "points": n,
        "expand_s": round(expand_s, 3),
        "all_skipped_plain_s": round(plain_s, 3),
        "all_skipped_prefect_s": round(prefect_s, 3),
        "expand_plus_skip_s": round(expand_s + prefect_s, 3),
        "skipped_per_point_s": round(prefect_s / (n + 1), 4),
        "single_stage_skip_prefect_s": round(single_s, 3),
    }


def bench_real(root: Path, steps: int) -> dict:
    from flows.pipeline import run_plan
    from flows.spec import load_plan

    pipeline = REPO / "configs" / "pipelines" / "tiny.yaml"
    overrides = [f"pretrain.steps={steps}", "pretrain.eval_every=0", "pretrain.checkpoint.every_steps=1000"]
    store = root / "real"
    first, summary = timed(lambda: run_plan(load_plan(pipeline, overrides, store)))
    stages = {
        name: {
            "status": s["status"],
            "task_s": round(s["seconds"], 3),
            "work_s": round(s["work_seconds"], 3),
            "store_bookkeeping_s": round(s["seconds"] - s["work_seconds"], 3),
        }
        for name, s in summary.items()
    }
    rerun, again = timed(lambda: run_plan(load_plan(pipeline, overrides, store)))
    assert {s["status"] for s in again.values()} == {"skipped"}, again

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "flows.cli"]
    cli_rerun, proc = timed(
        lambda: subprocess.run(
            [*cli, "run", str(pipeline), "--store", str(store), *overrides],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cli_status, proc = timed(
        lambda: subprocess.run(
            [*cli, "status", str(pipeline), "--store", str(store), *overrides],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {
        "pipeline": "configs/pipelines/tiny.yaml " + " ".join(overrides),
        "first_run_s": round(first, 3),
        "stages": stages,
        "flow_overhead_s": round(first - sum(s["seconds"] for s in summary.values()), 3),
        "all_skipped_rerun_in_process_s": round(rerun, 3),
        "all_skipped_rerun_cli_s": round(cli_rerun, 3),
        "status_cli_s": round(cli_status, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--work-seconds", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=20, help="pretrain steps of the real pipeline")
    parser.add_argument("--skip-real", action="store_true", help="only the sleep chain (no JAX)")
    parser.add_argument("--sweep", type=int, default=100, help="points of the all-finished sweep (0: skip it)")
    parser.add_argument("--only-sweep", action="store_true", help="only the sweep measurement")
    args = parser.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    server = "PREFECT_API_URL" if "PREFECT_API_URL" in os.environ else "local test server (SQLite)"
    root = Path(tempfile.mkdtemp(prefix="trainflow-bench-"))
    harness = nullcontext() if "PREFECT_API_URL" in os.environ else prefect_test_harness(server_startup_timeout=180)
    try:
        with harness:
            if "PREFECT_API_URL" not in os.environ:  # children (`trainflow run`) report to the same server
                from prefect.settings import PREFECT_API_URL

                os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()
            chain_rows = bench_chain(1 if args.only_sweep else args.stages, args.work_seconds, root)
            sweep_row = bench_sweep(args.sweep, root, args.work_seconds) if args.sweep else None
            real = None if args.skip_real or args.only_sweep else bench_real(root, args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nchain of {1 if args.only_sweep else args.stages} stages, {args.work_seconds} s of work each")
    print(f"{'runner':<10}{'first run s':>13}{'overhead/stage s':>18}{'all-skipped s':>15}{'per stage s':>13}")
    for mode, row in chain_rows.items():
        print(
            f"{mode:<10}{row['first_run_s']:>13.2f}{row['overhead_per_stage_s']:>18.3f}"
            f"{row['all_skipped_rerun_s']:>15.2f}{row['skipped_per_stage_s']:>13.3f}"
        )
    if sweep_row:
        print(
            f"\nsweep of {sweep_row['points']} finished points: expand {sweep_row['expand_s']:.2f} s, "
            f"skip all through Prefect {sweep_row['all_skipped_prefect_s']:.2f} s "
            f"({sweep_row['skipped_per_point_s']:.3f} s per point; "
            f"plain loop {sweep_row['all_skipped_plain_s']:.2f} s), "
            f"expand + skip {sweep_row['expand_plus_skip_s']:.2f} s (target < 10 s); "
            f"a single-stage skip through Prefect {sweep_row['single_stage_skip_prefect_s']:.2f} s"
        )
    if real:
        print(f"\n{real['pipeline']}")
        print(f"{'stage':<10}{'status':>8}{'task s':>9}{'work s':>9}{'store s':>9}")
        for name, row in real["stages"].items():
            print(
                f"{name:<10}{row['status']:>8}{row['task_s']:>9.2f}{row['work_s']:>9.2f}"
                f"{row['store_bookkeeping_s']:>9.2f}"
            )
        print(
            f"first run {real['first_run_s']:.2f} s (flow + task overhead {real['flow_overhead_s']:.2f} s); "
            f"all-skipped re-run {real['all_skipped_rerun_in_process_s']:.2f} s in process, "
            f"{real['all_skipped_rerun_cli_s']:.2f} s as `trainflow run`; "
            f"`trainflow status` {real['status_cli_s']:.2f} s"
        )

    # --only-sweep records apart, so the chain and tiny-pipeline figures of a full run stay.
    out = REPO / "bench" / "results" / f"pipeline_overhead{'_sweep' if args.only_sweep else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "description": "Orchestration overhead of trainflow pipelines (Prefect flow + artifact store) beside "
                "the stages' own work; see bench/pipeline_overhead.py",
                "command": " ".join(["python -m bench.pipeline_overhead", *sys.argv[1:]]),
                "machine": machine(
                    prefect=version("prefect"), prefect_server=server, load_average_at_start=LOAD_AT_START
                ),
                "chain": {"stages": args.stages, "work_seconds_per_stage": args.work_seconds, **chain_rows},
                "sweep": sweep_row,
                "tiny_pipeline": real,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
