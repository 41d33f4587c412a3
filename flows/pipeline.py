"""The Prefect flow that runs a pipeline: one flow run, one task run per stage.

Stages are submitted in topological order to a thread pool, each waiting only for its own
inputs, so independent stages run concurrently. Each task calls tasks.runner.execute_stage
(skip / lock / verify / run / manifest) and reports to Prefect:

- tags on every run: the flow run `trainflow` and `pipeline:<name>`; each task run adds
  `stage:<stage>`, `task:<kind>` and, where the stage runs an engine, `engine` (so a
  tag-based concurrency limit can hold such stages to one at a time);
- one flow, `trainflow-pipeline`, whose runs are named `<pipeline>-<YYYYmmdd-HHMMSS>`,
  whether `trainflow run` or a schedule starts them;
- each stage's artifact as a Prefect asset (`trainflow://<stage>/<artifact id>`) that the
  task run materialises from its inputs' assets, so the event feed and the asset graph
  show what was made from what (a skipped stage materialises nothing);
- the stage's log, the child's output at the level the child logged it, and each metrics
  record as `step n/N ... tokens/s, ETA`; a progress artifact while it runs, and at the end
  one markdown summary (status, metrics, lineage, config; an evaluation's report with its
  plots inlined).

Prefect observes; it never holds the stages up. Everything a running stage sends to the API
goes through the reporter (flows/reporter.py), which drops records with one warning when
the API does not answer, and the run's result is the stages' even if the API cannot record
the flow run's final state (run_plan).
"""

from __future__ import annotations

import contextvars
import logging
import re
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, runtime, tags
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.assets import Asset, AssetProperties, add_asset_metadata
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import AssetContext
from prefect.exceptions import TerminationSignal
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Failed, State
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import MaterializingTask, Task

from engine.config import ConfigError
from flows.gates import SKIPPED_CONDITION
from flows.links import run_links
from flows.reporter import Reporter, observing, unreachable
from flows.server import ApiUnreachable, api_answers
from flows.spec import Pipeline as SpecPipeline
from flows.spec import Plan, apply_pipeline_overrides, build_plan, load_plan, parse_spec
from flows.stage_rules import after_stage, before_stage, skip_stage
from flows.summary import Eta, PipelineProgress, asset_key, line_level, step_line, summary_markdown
from flows.sweep import label_value
from flows.sweep_report import sweep_markdown
from tasks.cutoff import REUSED_WHY
from tasks.launch.gang import stopping, terminate_children
from tasks.launch.run import Interrupted, PermanentFailure
from tasks.registry import StageHooks
from tasks.runner import REUSED, SKIPPED, StageResult, execute_stage
from tasks.store.records import ArtifactError, read_manifest

# Failures a retry cannot fix: a bad config, a tampered input, a deliberate stop, a full
# disk or a diverged loss.
NOT_RETRIED = (ConfigError, ArtifactError, Interrupted, PermanentFailure)


class _NoTracebackOfOneSentence(logging.Filter):
    """Prefect logs a failed task run's exception with its traceback; for the failures whose
    message is the whole story (NOT_RETRIED: an empty corpus, a run that cannot fit, a full
    disk) the line alone stays, so that a user's mistake reads as one sentence."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], NOT_RETRIED):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("prefect.task_runs").addFilter(_NoTracebackOfOneSentence())

# Once the stages are done: how long the reporter gets to send their artifacts, and
# Prefect's engine to record the flow run's final state, before the run goes on without.
PUBLISH_SECONDS = 30.0
FINAL_STATE_SECONDS = 30.0


class PipelineFailed(RuntimeError):
    def __init__(self, message: str, summary: dict[str, dict]):
        super().__init__(message)
        self.summary = summary


FLOW_NAME = "trainflow-pipeline"
TAG = "trainflow"
ENGINE_TAG = "engine"
"""Tags the task runs of stages that run an engine (training, sampling, evaluating)."""
_MATERIALIZED_BY = "trainflow"


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")


def flow_run_tags(pipeline: str) -> list[str]:
    return [TAG, f"pipeline:{pipeline}"]


def stage_tags(plan: Plan, stage: str) -> list[str]:
    """A sweep point's also name its sweep and its parameters: `sweep:sft`, `lr=1e-05`, `rank=8`."""
    planned = plan.stages[stage]
    job = planned.job
    return [
        *flow_run_tags(plan.name),
        f"stage:{stage}",
        f"task:{job.task}",
        *([ENGINE_TAG] if job.kind.launches_child else []),
        *([f"sweep:{planned.base}"] if planned.params else []),
        *(f"{k}={label_value(v)}" for k, v in planned.params.items()),
    ]


def _asset_key(stage: str, artifact_id: str) -> str:
    """asset_key, with a sweep point's brackets as parentheses (Prefect refuses [ and ] in keys)."""
    return asset_key(stage.replace("[", "(").replace("]", ")"), artifact_id)


def stage_asset(plan: Plan, stage: str) -> Asset:
    job = plan.stages[stage].job
    return Asset(
        key=_asset_key(stage, job.artifact_id),
        properties=AssetProperties(
            name=f"{stage}/{job.artifact_id}",
            description=f"{job.kind.output_kind(job.config)} artifact of stage '{stage}' (task {job.task}) "
            f"in pipeline '{plan.name}', "
            f"at {plan.store.location(stage, job.artifact_id)}",
        ),
    )


def pipeline_name(pipeline: str | dict | None) -> str:
    """The `name` of a pipeline given as a spec or a YAML path (else the file's stem)."""
    if isinstance(pipeline, dict):
        return str(pipeline.get("name") or "pipeline")
    try:
        name = (yaml.safe_load(Path(str(pipeline)).read_text()) or {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None
    return str(name or Path(str(pipeline)).stem)


def flow_run_name() -> str:
    """`<pipeline>-<YYYYmmdd-HHMMSS>`: the name of every run, manual or scheduled."""
    return f"{pipeline_name(runtime.flow_run.parameters.get('pipeline'))}-{time.strftime('%Y%m%d-%H%M%S')}"


class PrefectHooks(StageHooks):
    """Stage reports -> the task run's log, and a progress artifact (updates rate-limited).

    A child's lines keep their level; metrics records become `step n/N (p%): loss=... |
    tokens/s, ETA`, the few metrics of the stage's kind (flows/summary.step_line). Nothing
    here waits on the API: log records and artifact calls are handed to the reporter
    (flows/reporter.py), which sends them from its own thread or drops them.
    """

    def __init__(
        self,
        logger,
        reporter: Reporter,
        progress_key: str,
        description: str,
        min_interval: float = 2.0,
        total_steps: int | None = None,
        task: str = "",
    ):
        self._logger = logger
        self._reporter = reporter
        self._progress_id: Any = None
        self._started = False
        self._key, self._description = progress_key, description
        self._last = (0.0, -1.0)
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._total_steps, self._task = total_steps, task
        self._eta = Eta(total_steps)
        super().__init__(log=self._log, metrics=self._metrics, progress=self._progress)

    def _log(self, message: str) -> None:
        self._logger.log(line_level(message), message)

    def _metrics(self, record: dict) -> None:
        self._logger.info(self.format_metrics(record))

    def format_metrics(self, record: dict, now: float | None = None) -> str:
        return step_line(self._task, record, self._total_steps, self._eta, now)

    def start(self) -> None:
        self._started = True
        self._reporter.call(self._create_progress)

    def _create_progress(self) -> None:  # on the reporter's thread, before any update
        self._progress_id = create_progress_artifact(0.0, key=self._key, description=self._description)

    def _progress(self, fraction: float) -> None:
        percent = round(100.0 * fraction, 1)
        with self._lock:
            last_time, last_percent = self._last
            if not self._started or percent == last_percent:
                return
            if percent < 100.0 and time.monotonic() - last_time < self._min_interval:
                return
            self._last = (time.monotonic(), percent)
        self._reporter.call(self._update_progress, percent)

    def _update_progress(self, percent: float) -> None:
        if self._progress_id is not None:
            update_progress_artifact(self._progress_id, percent)


def _publish(plan: Plan, stage: str, result: StageResult) -> None:
    manifest = read_manifest(result.path) or {}
    text = summary_markdown(plan, stage, result, manifest)
    for input_name, rows in ((manifest.get("decisions") or {}).get("sweep") or {}).items():
        labels = list(plan.stages[rows[0]["point"]].params) if rows and rows[0]["point"] in plan.stages else []
        text += "\n\n" + sweep_markdown(stage, input_name, rows, labels).replace("# ", "## ", 1)  # a fan-in's sweep
    create_markdown_artifact(
        text,
        key=artifact_key(plan.name, stage),
        description=f"{stage}: {result.status}",
    )


def _retryable(task, task_run, state: State) -> bool:
    try:
        state.result()
    except NOT_RETRIED:
        return False
    except Exception:
        return True
    return True


@dataclass
class _Run:
    """What the stages of one flow run share: who was skipped by a gate, their futures (to
    know whether a stage whose steps another reads has ended) and each sweep's slots."""

    plan: Plan
    skipped: set[str] = field(default_factory=set)
    futures: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, threading.Semaphore] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    materializing: set[str] = field(default_factory=set)
    """Stages whose task runs declare their asset (ids known when submitted)."""
    progress: PipelineProgress = field(init=False)
    """The pipeline's line as each stage ends: stages done of all, elapsed, skipped."""

    def __post_init__(self) -> None:
        self.progress = PipelineProgress(self.plan.name, len(self.plan.stages))

    def slot(self, stage: str):
        """The sweep's semaphore (max_parallel points at once), else a no-op."""
        planned = self.plan.stages[stage]
        if planned.max_parallel is None:
            return nullcontext()
        with self.lock:
            return self.slots.setdefault(planned.base, threading.Semaphore(planned.max_parallel))

    def ended(self, stage: str) -> bool:
        future = self.futures.get(stage)
        return future is not None and future.wrapped_future.done()


def _skip_for_condition(
    plan: Plan, stage: str, job, record: dict, run_info: dict, reporter: Reporter, logger, progress: PipelineProgress
) -> State:
    outcome, why = skip_stage(plan, stage, job, record)
    outcome = {**outcome, "flow_run_id": run_info["flow_run_id"], "task_run_id": run_info["task_run_id"]}
    logger.info(f"{stage}: {SKIPPED_CONDITION}: {why}")
    logger.info(progress.finished(stage, SKIPPED_CONDITION))
    reporter.call(
        create_markdown_artifact,
        f"# {stage} ({job.task}): {SKIPPED_CONDITION}\n\n{why}",
        key=artifact_key(plan.name, stage),
        description=f"{stage}: {SKIPPED_CONDITION}",
    )
    return Completed(name="Skipped (condition)", message=why, data=outcome)


def _publish_sweep(plan: Plan, stage: str, rows: dict[str, list[dict]]) -> None:
    for input_name, points in rows.items():
        labels = list(plan.stages[points[0]["point"]].params) if points else []
        key = artifact_key(plan.name, stage, "sweep", *([input_name] if len(rows) > 1 else []))
        create_table_artifact(points, key=key + "-table", description=f"{stage}: sweep over {input_name}")
        create_markdown_artifact(
            sweep_markdown(stage, input_name, points, labels), key=key, description=f"{stage}: sweep over {input_name}"
        )


def _run_stage(plan: Plan, stage: str, reporter: Reporter, run: _Run) -> Any:
    logger = get_run_logger()
    planned = plan.stages[stage]
    if stopping():  # the run was asked to stop before this stage began
        raise Interrupted(f"stage '{stage}': not started, the run is stopping; re-run to resume")
    run_info = {
        "flow_run_id": str(runtime.flow_run.id),
        "flow_run_name": runtime.flow_run.name,
        "flow_name": runtime.flow_run.flow_name,
        "task_run_id": str(runtime.task_run.id),
        "task_run_name": runtime.task_run.name,
        "summary_key": artifact_key(plan.name, stage),
        **run_links(str(runtime.flow_run.id), str(runtime.task_run.id)),  # UI addresses where there is a UI
    }
    before = before_stage(plan, stage, run.skipped, run.ended, logger.info)
    job, decisions = before.job, before.decisions
    if before.skip is not None:
        run.skipped.add(stage)
        return _skip_for_condition(plan, stage, job, before.skip, run_info, reporter, logger, run.progress)
    hooks = PrefectHooks(
        logger,
        reporter,
        artifact_key(plan.name, stage, "progress"),
        f"{stage}: progress",
        total_steps=getattr(job.config, "steps", None),
        task=job.task,
    )
    complete = plan.store.is_complete(stage, job.artifact_id)
    if not complete:
        hooks.start()
        run.progress.started(stage)
    with nullcontext() if complete else run.slot(stage):  # a sweep's max_parallel bounds its work, not its skips
        result = execute_stage(job, plan.store, hooks, run_info)
    rows = after_stage(plan, stage, job, decisions)
    if rows:
        reporter.call(_publish_sweep, plan, stage, rows)
    assets = AssetContext.get() if stage in run.materializing else None
    if result.status == SKIPPED and assets is not None:
        assets.downstream_assets = set()  # made by an earlier run: nothing materialised now
    elif assets is not None:
        add_asset_metadata(
            _asset_key(stage, job.artifact_id),
            {
                "stage": stage,
                "task": job.task,
                "status": result.status,
                "location": plan.store.location(stage, job.artifact_id),
                "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))},
            },
        )
    # Artifacts are published by the reporter's thread (in this task run's context), so a
    # chain of skipped stages does not wait on API round trips. A skipped sweep point's
    # summary is the one the run that made it published: a grown grid of 100 points does
    # not send 100 unchanged pages again.
    if not (result.status == SKIPPED and planned.params):
        reporter.call(_publish, plan, stage, result)
    logger.info(f"{stage}: {result.status} in {result.seconds:.1f} s -> {result.path}")
    logger.info(run.progress.finished(stage, result.status))
    outcome = {**result.to_dict(), "flow_run_id": run_info["flow_run_id"], "task_run_id": run_info["task_run_id"]}
    if decisions.get("select"):
        outcome["selected"] = {name: d["chosen"] for name, d in decisions["select"].items()}
    if result.status == SKIPPED:
        return Completed(name="Skipped", message=f"artifact {job.artifact_id} is complete", data=outcome)
    if result.status == REUSED:  # early cutoff (tasks/cutoff.py): nothing ran, an equal artifact's bytes taken
        return Completed(name="Reused", message=REUSED_WHY, data=outcome)
    return outcome


def _execute(plan: Plan) -> dict[str, dict] | State:
    logger = get_run_logger()
    logger.info(f"pipeline '{plan.name}': {len(plan.stages)} stages, store {plan.store.url}")
    with observing(_api_url()) as reporter:
        summary = _run_stages(plan, reporter, logger)
        failed = [n for n, s in summary.items() if s["status"] in ("failed", "not run")]
        message = f"pipeline '{plan.name}': stages did not finish: {', '.join(failed)}" if failed else None
        sink = _OUTCOME.get()
        if sink is not None:  # run_plan learns the outcome before Prefect records it
            sink.stages_done(summary, message)
        reporter.flush(timeout=0 if reporter.down else PUBLISH_SECONDS)
    if message:
        # A Failed state, not an exception: the summary is the result, without a traceback.
        return Failed(message=message, data=summary)
    return summary


def _finished_points(plan: Plan) -> dict[str, list[str]]:
    """Sweep -> its points that are complete now and need nothing but a skip (no gate, no
    checkpoint-step input, no fan-in to publish): they share one task run, so expanding and
    skipping a finished grid of hundreds of points costs about what one stage's skip does."""
    out: dict[str, list[str]] = {}
    for name, planned in plan.stages.items():
        if (
            planned.params
            and planned.resolved
            and planned.gate is None
            and not planned.fan_in
            and not planned.follows
            and plan.store.is_complete(name, planned.job.artifact_id)
        ):
            out.setdefault(planned.base, []).append(name)
    return {base: points for base, points in out.items() if len(points) > 1}


def _skip_points(plan: Plan, base: str, points: list[str], progress: PipelineProgress) -> State:
    """The task run of a sweep's finished points: each skipped through execute_stage."""
    logger = get_run_logger()
    run_info = {"flow_run_id": str(runtime.flow_run.id), "task_run_id": str(runtime.task_run.id)}
    outcomes = {}
    for point in points:
        result = execute_stage(plan.stages[point].job, plan.store, StageHooks(log=lambda _: None), run_info)
        outcomes[point] = {**result.to_dict(), **run_info}
    logger.info(f"{base}: {len(points)} finished points skipped ({', '.join(points)})")
    logger.info([progress.finished(point, SKIPPED) for point in points][-1])
    return Completed(name="Skipped", message=f"{len(points)} points of {base} are complete", data=outcomes)


def _run_stages(plan: Plan, reporter: Reporter, logger) -> dict[str, dict]:
    """Submit every stage as a task run, wait for all of them; returns {stage: summary}."""

    run = _Run(plan)

    def run_stage(stage: str) -> Any:
        return _run_stage(plan, stage, reporter, run)

    def skip_points(base: str, points: list[str]) -> Any:
        return _skip_points(plan, base, points, run.progress)

    futures = run.futures
    grouped = _finished_points(plan)
    groups: dict[str, Any] = {}
    for base, points in grouped.items():  # one task run per sweep for the points already made
        group_task = Task(
            skip_points,
            name=f"{base}[*]",
            task_run_name=f"{base}[{len(points)} finished points]",
            tags=[*flow_run_tags(plan.name), f"sweep:{base}", f"task:{plan.stages[points[0]].job.task}"],
            cache_policy=NO_CACHE,
            persist_result=False,
        )
        groups[base] = group_task.submit(base, points)
        for point in points:
            futures[point] = groups[base]
    for name, planned in plan.stages.items():
        if name in futures:
            continue
        options: dict[str, Any] = dict(
            name=name,
            task_run_name=name,
            tags=stage_tags(plan, name),
            retries=planned.retries,
            retry_delay_seconds=planned.retry_delays or 0,
            retry_condition_fn=_retryable,
            cache_policy=NO_CACHE,
            persist_result=False,
        )
        upstream = [*planned.depends_on, *planned.follows]
        stage_task: Task[[str], Any]
        if planned.resolved and all(plan.stages[u].resolved for u in upstream):
            stage_task = MaterializingTask(
                run_stage,
                assets=[stage_asset(plan, name)],
                materialized_by=_MATERIALIZED_BY,
                asset_deps=[stage_asset(plan, u) for u in upstream],  # as their tasks name them
                **options,
            )
            run.materializing.add(name)
        else:  # its id waits on a selection: no asset key to declare yet
            stage_task = Task(run_stage, **options)
        futures[name] = stage_task.submit(name, wait_for=[futures[d] for d in planned.depends_on], return_state=False)
    try:
        _wait_all(futures.values())
    except TerminationSignal:
        # Where the flow runs in a main thread (a deployment), Prefect turns SIGTERM into
        # this exception (a cancel from the UI arrives the same way): ask the engines to
        # checkpoint and exit, let the stages fail, then re-raise so Prefect records it.
        count = terminate_children(signal.SIGTERM)
        logger.warning(f"SIGTERM: asked {count} engine process(es) to checkpoint and exit; re-run to resume")
        _wait_all(futures.values())
        raise
    summary: dict[str, dict] = {}
    for name, future in futures.items():
        state = future.state
        job = plan.stages[name].job
        if state.is_completed():
            result = future.result()
            summary[name] = result[name] if plan.stages[name].base in groups and name in result else result
            continue
        error = state.result(raise_on_failure=False) if (state.is_failed() or state.is_crashed()) else None
        summary[name] = {
            "stage": name,
            "task": job.task,
            "artifact_id": job.artifact_id or "-",
            "path": str(plan.store.artifact_dir(name, job.artifact_id)) if job.artifact_id else "-",
            "status": "failed" if isinstance(error, BaseException) else "not run",
            "error": _describe(name, error)
            if isinstance(error, BaseException)
            else f"stage '{name}': not run, an input stage did not finish",
        }
    for name, s in summary.items():
        logger.info(f"{name}: {s['status']} {s['artifact_id']}")
    return summary


def _wait_all(futures) -> None:
    """Wait for every future in short slices, so that signal handlers run promptly."""
    futures = list(futures)
    pending = futures
    while pending:
        pending[0].wait(timeout=0.25)
        pending = [f for f in pending if not f.wrapped_future.done()]
    for future in futures:
        future.wait()  # all done: this records each final state on its future (no API read)


def _describe(stage: str, error: BaseException) -> str:
    """One line naming the stage; the type too where it is not a user-facing error."""
    text = str(error) if isinstance(error, NOT_RETRIED) else f"{type(error).__name__}: {error}"
    return text if text.startswith(f"stage '{stage}'") else f"stage '{stage}': {text}"


def _plan_from(pipeline: str | dict, store: str | None, overrides: list[str] | None) -> Plan:
    if isinstance(pipeline, dict):
        source = f"pipeline '{pipeline.get('name', '?')}'"
        tree = apply_pipeline_overrides(dict(pipeline), overrides or [], source)
        return build_plan(parse_spec(tree, source), source, store)
    return load_plan(pipeline, overrides, store)


@flow(name=FLOW_NAME, flow_run_name=flow_run_name, persist_result=False)
def run_pipeline(
    pipeline: str | dict, store: str | None = None, overrides: list[str] | None = None
) -> dict[str, dict] | State:
    """Run a pipeline: a path to its YAML, or the spec as a dict (the Python API).

    Deployments (`trainflow serve`, configs/prefect.yaml) run this flow with a path; their
    runs are named and tagged as those of `trainflow run`.
    """
    return _execute(_plan_from(pipeline, store, overrides))


def pipeline_flow(plan: Plan, max_workers: int | None = None):
    """`run_pipeline` with a thread per stage that can run at once (`max_workers`: fewer).

    By default every stage has a thread, so a stage waiting for its inputs or for a tag's
    concurrency slot never holds up another. Prefect warns of a dead-lock whenever a task
    has as many tags as the pool has threads; as there can be none here, the pool is sized
    past the tag count too (threads start only when used)."""
    most_tags = max(len(stage_tags(plan, stage)) for stage in plan.stages)
    runner: Any = ThreadPoolTaskRunner(max_workers=max_workers or max(len(plan.stages), most_tags + 1))
    return run_pipeline.with_options(task_runner=runner)  # Any: Prefect types the runner by its futures


class _Outcome:
    """What run_plan learns from the flow running on its own thread: the stages' summary as
    soon as they are done, then the flow call's own return (or exception)."""

    def __init__(self) -> None:
        self.settled = threading.Event()
        """The stages are done, or the flow call returned."""
        self.returned = threading.Event()
        self.summary: dict[str, dict] | None = None
        self.message: str | None = None
        self.state: State | None = None
        self.error: BaseException | None = None

    def stages_done(self, summary: dict[str, dict], message: str | None) -> None:
        self.summary, self.message = summary, message
        self.settled.set()

    def run(self, flow_obj, *args) -> None:
        _OUTCOME.set(self)
        try:
            self.state = flow_obj(*args, return_state=True)
        except BaseException as e:  # the flow call broke, e.g. its API went away
            self.error = e
        finally:
            self.returned.set()
            self.settled.set()


_OUTCOME: contextvars.ContextVar[_Outcome | None] = contextvars.ContextVar("trainflow_outcome", default=None)


def run_plan(plan: Plan, *, max_workers: int | None = None, raise_on_failure: bool = True) -> dict[str, dict]:
    """Run a validated plan as one Prefect flow run; returns {stage: result summary}.

    The flow gets the spec itself (overrides applied) as its parameter, so the Prefect UI
    shows exactly what ran. It runs on a thread of its own and the outcome is the stages':
    once they are done, Prefect gets FINAL_STATE_SECONDS to record the flow run's final
    state, and an API that does not answer costs one warning, not the result. (Signals stay
    with the caller's handlers — the CLI's — as Prefect handles them only on a main thread.)
    """
    flow_obj = pipeline_flow(plan, max_workers)
    spec = plan.spec.model_dump(mode="json", exclude_unset=True, by_alias=True)
    api_url = _api_url()
    outcome = _Outcome()

    def call() -> None:
        with tags(*flow_run_tags(plan.name)):
            outcome.run(flow_obj, spec, plan.store.url)

    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(call,), name=f"flow-{plan.name}", daemon=True
    )
    with observing(api_url) as reporter:  # the flow engine's own log records too
        thread.start()
        try:
            while not outcome.settled.wait(0.25):  # short slices: signal handlers run promptly
                pass
        except KeyboardInterrupt:  # Ctrl-C in-process: the engines checkpoint, the stages end
            terminate_children(signal.SIGTERM)
            outcome.settled.wait()
            raise
        if not outcome.returned.is_set():
            _wait_for_final_state(outcome, reporter)
        reporter.flush(timeout=0 if reporter.down else PUBLISH_SECONDS)  # the flow engine's last records
    if outcome.returned.is_set() and outcome.summary is None:  # the flow broke before the stages ended
        if outcome.error is not None:
            if unreachable(outcome.error):
                raise ApiUnreachable(
                    f"the Prefect API at {api_url} is unreachable ({type(outcome.error).__name__}: {outcome.error})"
                ) from outcome.error
            raise outcome.error
        assert outcome.state is not None  # returned: the flow's final state is known
        result = outcome.state.result(raise_on_failure=False)
        if isinstance(result, BaseException):
            raise result
        outcome.summary, outcome.message = result, outcome.state.message if outcome.state.is_failed() else None
    elif outcome.error is not None:  # the stages finished, then recording the flow run failed
        if not unreachable(outcome.error):
            raise outcome.error
        reporter.api_failed(f"{type(outcome.error).__name__}: {outcome.error}")
    assert outcome.summary is not None  # the stages ended, or the flow's result said how
    if outcome.message and raise_on_failure:
        raise PipelineFailed(outcome.message, outcome.summary)
    return outcome.summary


def _wait_for_final_state(outcome: _Outcome, reporter: Reporter) -> None:
    """Give Prefect's engine a bounded time to record the flow run's final state."""
    if reporter.down or outcome.returned.wait(2.0):
        return
    if not api_answers(reporter.api_url, timeout=2.0):
        reporter.api_failed("the flow run's final state could not be recorded")
    elif not outcome.returned.wait(FINAL_STATE_SECONDS):
        reporter.api_failed(f"the flow run's final state was not recorded within {FINAL_STATE_SECONDS:.0f} s")


def _api_url() -> str:
    """The API this run reports to (Prefect's temporary server's, if it started one)."""
    return PREFECT_API_URL.value() or str(get_client(sync_client=True).api_url).rstrip("/")


class Pipeline(SpecPipeline):
    """flows.spec.Pipeline that runs: `Pipeline(...).run()` is one Prefect flow run of it, as
    `trainflow run` makes (docs/pipelines.md, "The Python API")."""

    def run(
        self, store: str | Path | None = None, *, max_workers: int | None = None, raise_on_failure: bool = True
    ) -> dict[str, dict]:
        """{stage: {status, artifact_id, path, metrics, ...}}; a failed stage raises
        PipelineFailed unless `raise_on_failure` is False."""
        return run_plan(self.plan(store), max_workers=max_workers, raise_on_failure=raise_on_failure)
