"""The `trainflow` command.

    trainflow run PIPELINE.yaml [--store DIR] [key=value ...]   run / resume a pipeline
    trainflow status PIPELINE.yaml [--store DIR] [--json]       each stage: complete/partial/pending + id
    trainflow lineage PATH|ID [--store DIR] [--json]            ancestors with configs and metrics
    trainflow verify PATH|ID [--store DIR]                      re-hash an artifact (exit 1 on mismatch)
    trainflow ls [--store DIR] [--json]                         artifacts in a store
    trainflow serve PIPELINE.yaml --cron "0 3 * * *"            a scheduled Prefect deployment
    trainflow plan PIPELINE.yaml --target v5e-16|h100x8|local   compile each training stage for a target: fits?
    trainflow convert HF_DIR|URL [--store DIR] [--dtype bfloat16] [--json]  a Hugging Face model -> checkpoint artifact
    trainflow convert PEFT_DIR --base PATH|ID                      a PEFT LoRA adapter -> adapter artifact
    trainflow export PATH|ID [--store DIR] [--out DIR|URL] [--json]  a checkpoint artifact -> Hugging Face model
    trainflow generate PATH|ID --prompt TEXT [--temperature T]  sample completions from a checkpoint artifact
    trainflow gc [--store S] [--keep PIPELINE.yaml ...] [--keep-steps N] [--dry-run]   delete what nothing reaches
    trainflow diff A B [--store S] [--json]                      two artifacts: config, metrics, lineage

Overrides: `pretrain.steps=200` sets stages.pretrain.config.steps; other keys start at the
top of the pipeline (`store=/data/artifacts`, `stages.pretrain.retries=3`).
Exit codes (the table in docs/pipelines.md, "Exit codes"): 0 success, 1 a stage or check
failed (or PREFECT_API_URL does not answer), 2 bad input (arguments, pipeline, store, path or
id, artifact kind), 141 stdout closed early (`trainflow ls | head`: quiet, as coreutils), 143
stopped by a signal (SIGTERM, or Ctrl-C's SIGINT) after the engines checkpointed. Every error
is one line on stderr. `trainflow --version` prints the installed version.

This module is the one documented place where imports sit inside functions: Prefect (seconds
to import) loads only for `run` and `serve`, JAX only for `generate` and `plan`, so validating a
pipeline, `status`, `lineage`, `ls` and `verify` answer without either. tests/test_imports.py
holds every other module to module-level imports.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
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
from flows.inspection import format_lineage, format_table, human, lineage, list_rows, status_rows
from flows.retention import apply, collect
from flows.spec import load_plan
from tasks.launch.gang import terminate_children
from tasks.launch.run import PermanentFailure, StageFailed
from tasks.registry import MODEL_KINDS, StageHooks, get_stage_kind
from tasks.runner import StageJob, execute_stage
from tasks.stages.export import check_export_target, copy_export
from tasks.store.base import ArtifactStore, resolve_artifact, split_artifact_url
from tasks.store.names import folder_stage
from tasks.store.records import COMPLETE, ArtifactError, InputError, artifact_id, read_manifest, verify_artifact
from tasks.store.urls import is_url

DEFAULT_STORE = "artifacts"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_PIPE = 141  # stdout closed before the output ended (128 + SIGPIPE, as coreutils and git)
EXIT_SIGNAL = 143  # stopped by SIGTERM or SIGINT (Ctrl-C), after the engines checkpointed
EXIT_CODES = (EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PIPE, EXIT_SIGNAL)
"""Every code the command exits with; docs/pipelines.md's table lists each (tests/test_cli_messages.py)."""


def _store_arg(args) -> str:
    return args.store or os.environ.get("TRAINFLOW_STORE") or DEFAULT_STORE


def _kinds_text(kinds: tuple[str, ...]) -> str:
    return " or ".join(", ".join(kinds).rsplit(", ", 1))


def _artifact(args, command: str, kinds: tuple[str, ...] | None = None, complete: bool = True) -> tuple[Path, dict]:
    """The artifact argument's directory and manifest, refused in one sentence (InputError, exit
    2) before any work when it is no artifact, not of one of `kinds`, or (with `complete`) unfinished."""
    directory = resolve_artifact(args.artifact, _store_arg(args))
    remote_store = _store_of(args)
    shown = remote_store.location(directory.parent.name, directory.name) if remote_store else str(directory)
    manifest = read_manifest(directory)
    takes = f"`trainflow {command}` takes " + (f"a {_kinds_text(kinds)} artifact" if kinds else "an artifact")
    if manifest is None:
        raise InputError(f"{shown} is not an artifact (no readable {MANIFEST}); {takes}")
    if kinds and manifest.get("kind") not in kinds:
        raise InputError(f"{shown} is a {manifest.get('kind')} artifact; {takes}")
    if complete and manifest.get("status") != COMPLETE:
        store = remote_store or ArtifactStore(directory.parent.parent)
        state = store.state(directory.parent.name, directory.name)
        raise InputError(f"{shown} is {state}, not complete; run the pipeline that makes it again to finish it")
    return directory, manifest


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
        shown = plan.store.location(name, result["artifact_id"]) if "artifact_id" in result else str(path)
        if (path / "report.md").is_file():
            table = [line for line in (path / "report.md").read_text().splitlines() if line.startswith("|")]
            print(f"\n{name}: {shown}/report.md\n" + "\n".join(table))
        if name in plan.stages and plan.stages[name].fan_in:  # a fan-in: the sweep's summary
            from flows.sweep_report import sweep_rows, table_text  # matplotlib loads only here

            for input_name, rows in sweep_rows(plan, name).items():
                labels = list(plan.stages[rows[0]["point"]].params) if rows else []
                print(f"\n{name}: sweep over {input_name} ({len(rows)} points)\n" + table_text(rows, labels))
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
    try:
        plan.store.require()
    except InputError as e:
        raise InputError(f"{e}: {args.pipeline} is valid, nothing has run there (`trainflow run` creates it)") from None
    rows = status_rows(plan)
    if args.json:
        print(json.dumps({"pipeline": plan.name, "store": plan.store.url, "stages": rows}, indent=2))
    else:
        print(f"pipeline {plan.name}  store {plan.store.url}")
        print(format_table(rows, ["stage", "task", "state", "artifact_id", "inputs", "finished_at"]))
    return 0


def cmd_lineage(args) -> int:
    directory, _ = _artifact(args, "lineage", complete=False)
    tree = lineage(directory, store=_store_of(args))
    print(json.dumps(tree, indent=2) if args.json else format_lineage(tree))
    return 0


def cmd_verify(args) -> int:
    directory, _ = _artifact(args, "verify", complete=False)
    remote_store = _store_of(args)
    problems = remote_store.verify(directory) if remote_store else verify_artifact(directory)
    label = remote_store.location(directory.parent.name, directory.name) if remote_store else directory
    if problems:  # each on stdout, the verdict in one line on stderr
        for problem in problems:
            print(problem)
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        print(f"error: {label} does not match its manifest: {shown}", file=sys.stderr)
        return EXIT_FAILED
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
    store.require()
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
    for given, directory in zip((args.a, args.b), dirs):
        if read_manifest(directory) is None:
            raise InputError(f"{given} is not an artifact (no readable {MANIFEST}); `trainflow diff` takes two")
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
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.settings import PREFECT_API_URL
    from pydantic import ValidationError

    try:
        CronSchedule(cron=args.cron)
    except ValidationError:
        raise ConfigError(
            f"--cron {args.cron!r} is not a cron schedule: five fields, minute hour day-of-month month "
            f'day-of-week, e.g. "0 3 * * *" (03:00 every day)'
        ) from None

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
    local = Path(args.artifact).expanduser()
    if local.is_dir() and not (local / MANIFEST).exists():
        args.checkpoint = str(local.resolve())  # a plain checkpoint directory (an engine run's) also works
    else:
        directory, _ = _artifact(args, "generate", MODEL_KINDS)  # a wrong kind: refused before JAX loads
        if _store_of(args) is None:  # truncated files: one sentence, not a dozen tracebacks of the loader
            ArtifactStore(directory.parent.parent).check_sizes(folder_stage(directory.parent.name), directory.name)
        args.checkpoint = str(_local_artifact(args))  # a bucket's copy is checked as it comes down
    from engine.inference.generate import generate  # JAX loads only for this command

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


def _run_one_stage(task: str, config: dict, inputs: dict, store: ArtifactStore, as_json: bool = False):
    """Run a single stage outside a pipeline (no Prefect), with the usual skip, manifest and
    lineage; print what it wrote where (a JSON line with `as_json`)."""
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
    where = store.location(task, result.artifact_id)
    if as_json:
        record = {"stage": task, "status": result.status, "artifact_id": result.artifact_id, "path": where}
        print(json.dumps({**record, "seconds": round(result.seconds, 2), "metrics": result.metrics}))
    elif result.status == "skipped":
        print(f"{task}: nothing to do, the same {task} is complete at {where}")
    else:
        manifest = store.manifest(task, result.artifact_id) or {}
        print(f"{task}: wrote a {manifest.get('kind', task)} artifact to {where} in {result.seconds:.1f} s")
    return result


def cmd_convert(args) -> int:
    config = {"source": args.hf_dir, **({"dtype": args.dtype} if args.dtype else {})}
    inputs, store = {}, ArtifactStore(_store_arg(args))
    if args.base:  # a PEFT adapter onto the checkpoint artifact it adapts, stored beside it
        args.artifact = args.base
        directory, manifest = _artifact(args, "convert --base", get_stage_kind("convert").inputs["base"].kinds)
        # Stored beside its base: in the same bucket store, or the same directory.
        inputs, store = (
            {"base": (manifest["stage"], manifest["id"])},
            _store_of(args) or ArtifactStore(directory.parent.parent),
        )
    return 0 if _run_one_stage("convert", config, inputs, store, args.json) else 1


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
    directory, manifest = _artifact(args, "export", get_stage_kind("export").inputs["checkpoint"].kinds)
    # The export lands beside its input: in the same bucket store, or the same directory.
    store = _store_of(args) or ArtifactStore(directory.parent.parent)
    config = {
        "max_shard_gb": args.max_shard_gb,
        **({"step": args.step} if args.step is not None else {}),
        **({"merged": True} if args.merged else {}),
    }
    result = _run_one_stage("export", config, {"checkpoint": (manifest["stage"], manifest["id"])}, store, args.json)
    if result is None:
        return 1
    if args.out:
        copy_export(result.path / "hf", args.out)
    if not args.json:
        print(
            f"export: the Hugging Face model is in {args.out or store.location('export', result.artifact_id) + '/hf'}"
        )
    return 0


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: what is wrong, the closest valid word where one is
    near, and where the help is (argparse's own print the usage first, then the error)."""

    commands: dict[str, argparse.ArgumentParser]
    """The top-level parser's: each command's parser, by name."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _at_least_one(text: str) -> int:
    """--max-parallel's value: a whole number of 1 or more (0 would start nothing, -3 crashed
    Prefect's thread pool with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} stages at once: give a whole number of 1 or more")
    return value


def _did_you_mean(word: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


STORE_HELP = {
    "pipeline": "artifact store: a directory or an s3:// / gs:// URL (default: the pipeline's `store`)",
    "artifact": "the store to look an id up in (default: $TRAINFLOW_STORE, else ./artifacts)",
    "ls": "the store to list (default: $TRAINFLOW_STORE, else ./artifacts)",
    "convert": "the store to write the artifact in (default: $TRAINFLOW_STORE, else ./artifacts; "
    "a missing directory is created)",
    "gc": "the store to clean (default: the first --keep pipeline's `store`, else $TRAINFLOW_STORE, else ./artifacts)",
}


def build_parser() -> Parser:
    parser = Parser(prog="trainflow", description="Declarative LLM training pipelines on Prefect.")
    parser.commands = {}
    parser.add_argument("--version", action="version", version=f"trainflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text, pipeline=False, artifact=False, store_help=None):
        p = sub.add_parser(name, help=help_text, description=help_text)
        if pipeline:
            p.add_argument("pipeline", help="pipeline YAML file")
        if artifact:
            p.add_argument("artifact", help="artifact directory, its artifact.json, or an id (prefix) in --store")
        p.add_argument(
            "--store", help=STORE_HELP[store_help or ("pipeline" if pipeline else "artifact" if artifact else name)]
        )
        if pipeline:
            # default=[]: without a default argparse counts a "*" positional as required, and a
            # bare `trainflow status` would say key=value is required.
            p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="e.g. pretrain.steps=200")
        p.set_defaults(func=func)
        parser.commands[name] = p
        return p

    def json_flag(p, what: str) -> None:
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON")

    p = add("run", cmd_run, "run a pipeline, skipping finished stages and resuming partial ones", pipeline=True)
    p.add_argument(
        "--max-parallel", type=_at_least_one, default=None, help="stages run at once, 1 or more (default: all ready)"
    )
    p = add("status", cmd_status, "show each stage's state and artifact id without running anything", pipeline=True)
    json_flag(p, "the pipeline, its store and each stage's row")
    p = add("lineage", cmd_lineage, "show the artifacts an artifact was made from", artifact=True)
    json_flag(p, "the tree (each artifact with its config, metrics and parents)")
    add("verify", cmd_verify, "re-hash an artifact's files against its manifest", artifact=True)
    p = add("ls", cmd_ls, "list the artifacts in a store")
    json_flag(p, "the rows")
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
        "the result is an adapter artifact, stored beside it",
    )
    json_flag(p, "the result (stage, status, artifact_id, path, seconds, metrics)")
    p = add("export", cmd_export, "export a checkpoint artifact as a Hugging Face model directory", artifact=True)
    p.add_argument("--out", help="also copy the Hugging Face directory here (a directory or a folder URL)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GB (default: 5, as transformers)"
    )
    p.add_argument("--overwrite", action="store_true", help="copy into a non-empty --out, deleting its weights")
    p.add_argument(
        "--merged",
        action="store_true",
        help="an adapter artifact: the whole model with the adapter folded in (default: PEFT's adapter format)",
    )
    json_flag(p, "the result (stage, status, artifact_id, path, seconds, metrics)")
    p = add("gc", cmd_gc, "delete the artifacts no kept pipeline reaches, and old checkpoint steps")
    p.add_argument(
        "--keep", action="append", default=[], metavar="PIPELINE.yaml", help="a pipeline whose artifacts stay (repeat)"
    )
    p.add_argument("--keep-steps", type=int, help="in each kept artifact, keep only the newest N checkpoint steps")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    p = add("diff", cmd_diff, "compare two artifacts: config, metrics and lineage side by side", store_help="artifact")
    p.add_argument("a", help="artifact directory, URL or id (prefix) in --store")
    p.add_argument("b", help="artifact directory, URL or id (prefix) in --store")
    json_flag(p, "the differences")
    p = add("generate", cmd_generate, "sample completions of prompts from a checkpoint artifact", artifact=True)
    add_sampling_arguments(p)
    return parser


def _parse(parser: Parser, argv: list[str]) -> argparse.Namespace:
    """The arguments; key=value overrides may come before or after options (collected from the
    leftovers). A mistyped command or option is one line naming the closest valid one."""
    commands = parser.commands
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        hint = _did_you_mean(argv[0], list(commands))
        parser.error(f"unknown command '{argv[0]}'{hint}; the commands are {', '.join(commands)}")
    args, extra = parser.parse_known_args(argv)
    command = commands[args.command]
    options = [o for action in command._actions for o in action.option_strings]
    for word in extra:
        if word.startswith("-"):
            command.error(f"unrecognized option '{word}'{_did_you_mean(word.split('=', 1)[0], options)}")
        if "=" not in word or not hasattr(args, "overrides"):
            command.error(f"unrecognized argument '{word}'")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 PID` prints every thread's stack to stderr: where a run that seems stuck waits.
    # To the process's own stderr: sys.stderr may be a stream without a descriptor (a test's capture).
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or sys.stderr, all_threads=True)
    except (ValueError, OSError):  # no descriptor at all (an embedding host): no stack dump
        pass
    args = _parse(build_parser(), sys.argv[1:] if argv is None else list(argv))
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # `trainflow ls | head`: the reader has what it wanted. Quiet, as coreutils and git;
        # stdout goes to /dev/null so that the interpreter's own flush at exit cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except (ConfigError, ArtifactError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, (ConfigError, InputError)) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
