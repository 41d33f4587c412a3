"""The `trainflow` command.

    trainflow run PIPELINE.yaml [--store DIR] [key=value ...]   run / resume a pipeline
    trainflow status PIPELINE.yaml [--store DIR] [--json]       each stage: complete/partial/pending + id
    trainflow lineage PATH|ID [--store DIR] [--json]            ancestors with configs and metrics
    trainflow verify PATH|ID [--store DIR]                      re-hash an artifact (exit 1 on mismatch)
    trainflow ls [--store DIR] [--json]                         artifacts in a store
    trainflow serve PIPELINE.yaml --cron "0 3 * * *"            a scheduled Prefect deployment
    trainflow plan PIPELINE.yaml --target v5e-16|h100x8|local   compile each training stage for a target: fits?
    trainflow convert HF_DIR|URL [--store DIR] [--dtype bfloat16]  a Hugging Face model -> checkpoint artifact
    trainflow convert PEFT_DIR --base PATH|ID                      a PEFT LoRA adapter -> adapter artifact
    trainflow export PATH|ID [--store DIR] [--out DIR|URL]      a checkpoint artifact -> Hugging Face model
    trainflow generate PATH|ID --prompt TEXT [--temperature T]  sample completions from a checkpoint artifact
    trainflow gc [--store S] [--keep PIPELINE.yaml ...] [--keep-steps N] [--dry-run]   delete what nothing reaches
    trainflow diff A B [--store S] [--json]                      two artifacts: config, metrics, lineage

Overrides: `pretrain.steps=200` sets stages.pretrain.config.steps; other keys start at the
top of the pipeline (`store=/data/artifacts`, `stages.pretrain.retries=3`).
Exit codes: 0 success, 1 a stage or check failed (or PREFECT_API_URL does not answer), 2 bad
input, 143 stopped by a signal (SIGTERM, or Ctrl-C's SIGINT) after the engines checkpointed.
`trainflow --version` prints the installed version.

This module is the one documented place where imports sit inside functions: Prefect (seconds
to import) loads only for `run` and `serve`, JAX only for `generate` and `plan`, so validating a
pipeline, `status`, `lineage`, `ls` and `verify` answer without either. tests/test_imports.py
holds every other module to module-level imports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

from engine import __version__
from engine.config import ConfigError
from engine.contract import MANIFEST
from engine.inference.options import add_sampling_arguments
from flows.diff import diff, format_diff
from flows.inspection import format_lineage, format_table, lineage, list_rows, status_rows
from flows.retention import apply, collect, human
from flows.spec import load_plan
from tasks.artifacts import (
    ArtifactError,
    ArtifactStore,
    artifact_id,
    resolve_artifact,
    split_artifact_url,
    verify_artifact,
)
from tasks.launch.gang import terminate_children
from tasks.launch.run import PermanentFailure, StageFailed
from tasks.objectstore import is_url
from tasks.registry import StageHooks, get_stage_kind
from tasks.runner import StageJob, execute_stage
from tasks.stages.export import check_export_target, copy_export

DEFAULT_STORE = "artifacts"
EXIT_SIGNAL = 143  # stopped by SIGTERM or SIGINT (Ctrl-C), after the engines checkpointed


def _store_arg(args) -> str:
    return args.store or os.environ.get("TRAINFLOW_STORE") or DEFAULT_STORE


def cmd_run(args) -> int:
    plan = load_plan(args.pipeline, args.overrides, args.store)  # all validation before Prefect starts
    stopping = threading.Event()

    def on_signal(signum, frame):
        # Ctrl-C reaches the whole foreground process group, but the engines and the local
        # Prefect server run in sessions of their own: only trainflow gets it, and decides.
        if stopping.is_set():  # a second signal: stop waiting for a clean checkpoint
            os._exit(EXIT_SIGNAL)
        stopping.set()
        count = terminate_children(signal.SIGTERM)
        print(
            f"trainflow: {signal.Signals(signum).name}: asked {count} engine process(es) to checkpoint "
            f"and exit; re-run the same command to resume",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from flows.server import ApiUnreachable, prefect_api  # Prefect takes seconds to import

    try:
        with prefect_api() as api_url:
            from flows.pipeline import PipelineFailed, run_plan
            from flows.reporter import reporter_for

            try:
                summary, code = run_plan(plan, max_workers=args.max_parallel), 0
            except PipelineFailed as e:
                summary, code = e.summary, 1
            reporter = reporter_for(api_url)
            reporter.close()  # before a local server stops
            api_down = reporter.down
    except ApiUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [{**s, "seconds": f"{s.get('seconds', 0):.1f}" if "seconds" in s else "-"} for s in summary.values()]
    print(format_table(rows, ["stage", "task", "status", "artifact_id", "seconds"]))
    if code == 0:
        _print_reports(plan, summary)
    for s in summary.values():
        if s.get("error"):
            print(f"error: {s['error']}", file=sys.stderr)
    code = EXIT_SIGNAL if stopping.is_set() else code
    if api_down:  # what Prefect still buffers would wait on a dead API at exit; none of it matters now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _print_reports(plan, summary: dict) -> None:
    """After a run: each evaluation report's table, and the lineage tree of the pipeline's
    final artifacts (those no other stage consumes)."""
    consumed = {up for planned in plan.stages.values() for up in planned.depends_on}
    for name, result in summary.items():
        path = Path(result.get("path", ""))
        # Where users find it: the artifact's URL on a bucket store (`path` is its staging copy).
        shown = (
            plan.store.location(name, result["artifact_id"])
            if plan.store.remote and "artifact_id" in result
            else str(path)
        )
        if (path / "report.md").is_file():
            table = [line for line in (path / "report.md").read_text().splitlines() if line.startswith("|")]
            print(f"\n{name}: {shown}/report.md\n" + "\n".join(table))
        if name in plan.stages and plan.stages[name].fan_in:  # a fan-in: the sweep's summary
            from flows.sweep_report import sweep_rows, table_markdown  # matplotlib loads only here

            for input_name, rows in sweep_rows(plan, name).items():
                labels = list(plan.stages[rows[0]["point"]].params) if rows else []
                print(f"\n{name}: sweep over {input_name} ({len(rows)} points)\n" + table_markdown(rows, labels))
        if name not in consumed and (path / "artifact.json").is_file():
            # The tree's artifact lines only; `trainflow lineage PATH` shows configs and metrics too.
            tree = [
                line
                for line in format_lineage(lineage(path, store=plan.store)).splitlines()
                if re.search(r"\S+/[0-9a-f]{16}\s+\S+\s+(complete|running|failed)", line)
            ]
            print(f"\nlineage of {name} (trainflow lineage {shown}):\n" + "\n".join(tree))


def cmd_status(args) -> int:
    plan = load_plan(args.pipeline, args.overrides, args.store)
    rows = status_rows(plan)
    if args.json:
        print(json.dumps({"pipeline": plan.name, "store": plan.store.url, "stages": rows}, indent=2))
    else:
        print(f"pipeline {plan.name}  store {plan.store.url}")
        print(format_table(rows, ["stage", "task", "state", "artifact_id", "inputs", "finished_at"]))
    return 0


def cmd_lineage(args) -> int:
    tree = lineage(resolve_artifact(args.artifact, _store_arg(args)), store=_store_of(args))
    if "error" in tree:  # not an artifact directory: main prints the one line, exit 1
        raise ArtifactError(f"{tree['path']} is not an artifact ({tree['error']})")
    print(json.dumps(tree, indent=2) if args.json else format_lineage(tree))
    return 0


def cmd_verify(args) -> int:
    directory = resolve_artifact(args.artifact, _store_arg(args))
    remote_store = _store_of(args)
    problems = remote_store.verify(directory) if remote_store else verify_artifact(directory)
    label = remote_store.location(directory.parent.name, directory.name) if remote_store else directory
    if problems:
        print(f"FAILED {label}", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    files = json.loads((directory / "artifact.json").read_text()).get("files") or {}
    print(f"OK {label} ({len(files)} files match their digests)")
    return 0


def _store_of(args) -> ArtifactStore | None:
    """The bucket store an artifact argument lives in (its URL's, or --store's for an id)."""
    split = split_artifact_url(args.artifact)
    if split is not None:
        return ArtifactStore(split[0])
    store = _store_arg(args)
    if is_url(store) and not Path(args.artifact).expanduser().exists():
        return ArtifactStore(store)
    return None


def cmd_ls(args) -> int:
    store = ArtifactStore(_store_arg(args))
    rows = list_rows(store)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no artifacts in {store.url}")
    else:
        print(format_table(rows, ["stage", "id", "kind", "status", "size", "finished_at", "metrics"]))
    return 0


def cmd_gc(args) -> int:
    """Delete the artifacts no kept pipeline reaches and old checkpoint steps (flows/retention.py)."""
    if args.keep_steps is not None and args.keep_steps < 1:
        raise ConfigError(f"gc: --keep-steps {args.keep_steps}: keep at least the newest step (1)")
    store_arg = args.store
    plans = []
    for path in args.keep:
        plan = load_plan(path, [], store_arg)  # a bad pipeline: exit 2 before anything is listed
        store_arg = store_arg or plan.store.url
        plans.append(plan)
    store_arg = store_arg or _store_arg(args)
    try:
        store = ArtifactStore(store_arg)
    except ArtifactError as e:
        raise ConfigError(f"gc: {e}") from None
    if plans and any(plan.store.url != store.url for plan in plans):
        plans = [load_plan(path, [], store.url) for path in args.keep]
    found = collect(store, plans, args.keep_steps)
    verb = "would delete" if args.dry_run else "delete"
    for entry in found.delete:
        kind = (entry.manifest or {}).get("kind", "?")
        print(f"{verb}  {entry.name}  {kind}  {entry.state}  {human(entry.size)}")
    for entry, steps, size in found.prune:
        print(
            f"{'would prune' if args.dry_run else 'prune'}  {entry.name}  "
            f"steps {', '.join(map(str, steps))}  {human(size)}"
        )
    for entry in found.in_use:
        print(f"in use  {entry.name}  (a run is writing it: left alone)")
    if not plans:
        print("gc: no --keep pipeline given: no artifact is deleted, only checkpoint steps (--keep-steps)")
    if args.dry_run:
        print(
            f"gc: would free {human(found.freed)} in {store.url} ({len(found.delete)} artifact(s), "
            f"{len(found.prune)} with old steps; {found.kept} kept)"
        )
        return 0
    freed, busy = apply(store, found, log=lambda _: None)
    for entry in busy:
        print(f"in use  {entry.name}  (a run took it meanwhile: left alone)")
    print(
        f"gc: freed {human(freed)} in {store.url} ({len(found.delete) - len(busy)} artifact(s) deleted, "
        f"{len(found.prune)} pruned; {found.kept} kept)"
    )
    return 0


def cmd_diff(args) -> int:
    store = _store_arg(args)
    dirs = [resolve_artifact(a, store) for a in (args.a, args.b)]
    stores = []
    for given in (args.a, args.b):
        split = split_artifact_url(given)
        stores.append(
            ArtifactStore(split[0])
            if split
            else (ArtifactStore(store) if is_url(store) and not Path(given).expanduser().exists() else None)
        )
    result = diff(dirs[0], dirs[1], stores[0], stores[1])
    print(json.dumps(result, indent=2, default=str) if args.json else format_diff(result))
    return 0


def cmd_serve(args) -> int:
    plan = load_plan(args.pipeline, args.overrides, args.store)
    from prefect.settings import PREFECT_API_URL

    from flows.server import ApiUnreachable, check_api

    if not PREFECT_API_URL.value():  # a run's temporary server has no scheduler: nothing would ever run
        print(
            "error: `trainflow serve` needs a persistent Prefect server to schedule runs: start one with "
            "`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 1
    try:
        check_api(PREFECT_API_URL.value())
        from prefect.types.entrypoint import EntrypointType

        from flows.pipeline import flow_run_tags, run_pipeline

        # The deployment runs the flow by module (flows.pipeline.run_pipeline, whatever the
        # working directory) with the pipeline's absolute path, so edits to the YAML apply
        # to the next scheduled run.
        run_pipeline.serve(
            name=args.name or plan.name,
            cron=args.cron,
            parameters={
                "pipeline": str(Path(args.pipeline).resolve()),
                "store": plan.store.url,
                "overrides": list(args.overrides),
            },
            description=f"trainflow pipeline {plan.name} ({args.pipeline})",
            tags=flow_run_tags(plan.name),
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
    except ApiUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args) -> int:
    from engine.inference.generate import generate  # JAX loads only for this command

    try:
        args.checkpoint = str(_local_artifact(args))
    except ArtifactError:
        if not Path(args.artifact).is_dir():  # a plain checkpoint directory also works
            raise
        args.checkpoint = args.artifact
    return generate(args)


def cmd_plan(args) -> int:
    plan = load_plan(args.pipeline, args.overrides, args.store)
    from engine.train.plan import DoesNotFit  # JAX loads only for this command
    from tasks.plan import print_pipeline_plan

    try:
        print_pipeline_plan(plan, args.target)
    except DoesNotFit as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _run_one_stage(task: str, config: dict, inputs: dict, store: ArtifactStore):
    """Run a single stage outside a pipeline (no Prefect), with the usual skip, manifest and lineage."""
    kind = get_stage_kind(task)
    cfg = kind.resolve_config(dict(config), f"trainflow {task}")
    ids = {name: aid for name, (_, aid) in inputs.items()}
    job = StageJob(
        stage=task,
        kind=kind,
        config=cfg,
        config_as_written=config,
        inputs=inputs,
        artifact_id=artifact_id(kind.task, kind.version, kind.fingerprint(cfg), ids),
        pipeline=task,
    )
    try:
        result = execute_stage(job, store, StageHooks(log=lambda m: print(m, file=sys.stderr, flush=True)))
    except (StageFailed, PermanentFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    print(
        json.dumps(
            {
                "stage": task,
                "status": result.status,
                "artifact_id": result.artifact_id,
                "path": store.location(task, result.artifact_id),
                "metrics": result.metrics,
            }
        )
    )
    return result


def cmd_convert(args) -> int:
    config = {"source": args.hf_dir, **({"dtype": args.dtype} if args.dtype else {})}
    inputs, store = {}, ArtifactStore(_store_arg(args))
    if args.base:  # a PEFT adapter onto the checkpoint artifact it adapts, stored beside it
        directory = resolve_artifact(args.base, _store_arg(args))
        manifest = json.loads((directory / MANIFEST).read_text())
        inputs, store = {"base": (manifest["stage"], manifest["id"])}, ArtifactStore(directory.parent.parent)
    return 0 if _run_one_stage("convert", config, inputs, store) else 1


def _local_artifact(args) -> Path:
    """The artifact argument's directory; on a bucket, its verified local copy (downloaded)."""
    directory = resolve_artifact(args.artifact, _store_arg(args))
    remote_store = _store_of(args)
    if remote_store is None:
        return directory
    return remote_store.open_input(directory.parent.name, directory.name, local_checkpoint=True).path


def cmd_export(args) -> int:
    if args.out:
        check_export_target(args.out, args.overwrite)  # refused before any work, nothing written
    directory = resolve_artifact(args.artifact, _store_arg(args))
    manifest = json.loads((directory / MANIFEST).read_text())
    # The export lands beside its input: in the same bucket store, or the same directory.
    store = _store_of(args) or ArtifactStore(directory.parent.parent)
    config = {
        "max_shard_gb": args.max_shard_gb,
        **({"step": args.step} if args.step is not None else {}),
        **({"merged": True} if args.merged else {}),
    }
    result = _run_one_stage("export", config, {"checkpoint": (manifest["stage"], manifest["id"])}, store)
    if result is None:
        return 1
    if args.out:
        copy_export(result.path / "hf", args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainflow", description="Declarative LLM training pipelines on Prefect.")
    parser.add_argument("--version", action="version", version=f"trainflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text, pipeline=False, artifact=False):
        p = sub.add_parser(name, help=help_text, description=help_text)
        if pipeline:
            p.add_argument("pipeline", help="pipeline YAML file")
        if artifact:
            p.add_argument("artifact", help="artifact directory, its artifact.json, or an id (prefix) in --store")
        p.add_argument(
            "--store",
            help="artifact store directory (default: the pipeline's `store`, else $TRAINFLOW_STORE, else ./artifacts)",
        )
        if pipeline:
            # default=[]: without a default argparse counts a "*" positional as required, and a
            # bare `trainflow status` would say key=value is required.
            p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="e.g. pretrain.steps=200")
        p.set_defaults(func=func)
        return p

    p = add("run", cmd_run, "run a pipeline, skipping finished stages and resuming partial ones", pipeline=True)
    p.add_argument("--max-parallel", type=int, default=None, help="stages run at once (default: all ready)")
    p = add("status", cmd_status, "show each stage's state and artifact id without running anything", pipeline=True)
    p.add_argument("--json", action="store_true")
    p = add("lineage", cmd_lineage, "show the artifacts an artifact was made from", artifact=True)
    p.add_argument("--json", action="store_true")
    add("verify", cmd_verify, "re-hash an artifact's files against its manifest", artifact=True)
    p = add("ls", cmd_ls, "list the artifacts in a store")
    p.add_argument("--json", action="store_true")
    p = add("serve", cmd_serve, "serve the pipeline as a scheduled Prefect deployment", pipeline=True)
    p.add_argument("--cron", required=True, help='cron schedule, e.g. "0 3 * * *"')
    p.add_argument("--name", help="deployment name (default: the pipeline's name)")
    p = add("plan", cmd_plan, "compile each training stage for a target and say whether it fits", pipeline=True)
    p.add_argument(
        "--target",
        default="local",
        help="a TPU slice (v5e-16, v5p-128, v6e-8, ...), a GPU host (h100x8, h200x8, a100x8) or local",
    )
    p = add("convert", cmd_convert, "convert a Hugging Face model (or, with --base, a PEFT adapter) into an artifact")
    p.add_argument(
        "hf_dir",
        help="directory with config.json and safetensors weights (or a folder URL: "
        "s3://bucket/prefix, gs://bucket/prefix)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="stored dtype (default: the source's)")
    p.add_argument(
        "--base",
        help="hf_dir is a PEFT LoRA adapter: the checkpoint artifact (path or id) it adapts; "
        "the result is an adapter artifact",
    )
    p = add("export", cmd_export, "export a checkpoint artifact as a Hugging Face model directory", artifact=True)
    p.add_argument("--out", help="also copy the Hugging Face directory here (a directory or a folder URL)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.add_argument("--overwrite", action="store_true", help="copy into a non-empty --out, deleting its weights")
    p.add_argument(
        "--merged",
        action="store_true",
        help="an adapter artifact: the whole model with the adapter folded in (default: PEFT's adapter format)",
    )
    p = add("gc", cmd_gc, "delete the artifacts no kept pipeline reaches, and old checkpoint steps")
    p.add_argument(
        "--keep", action="append", default=[], metavar="PIPELINE.yaml", help="a pipeline whose artifacts stay (repeat)"
    )
    p.add_argument("--keep-steps", type=int, help="in each kept artifact, keep only the newest N checkpoint steps")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p = add("diff", cmd_diff, "compare two artifacts: config, metrics and lineage side by side")
    p.add_argument("a", help="artifact directory, URL or id (prefix) in --store")
    p.add_argument("b", help="artifact directory, URL or id (prefix) in --store")
    p.add_argument("--json", action="store_true")
    p = add("generate", cmd_generate, "sample completions of prompts from a checkpoint artifact", artifact=True)
    add_sampling_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options: collect them from the leftovers.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except (ConfigError, ArtifactError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
