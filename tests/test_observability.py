"""What a user sees in the tools they already use: Prefect (tags, assets, one summary per
stage, the report's images), the console (child log levels, step n/N with an ETA) and the
metric sinks beside TensorBoard (a real local MLflow server; Weights & Biases offline).
"""

import base64
import functools
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import tests.pipeline_toys  # noqa: F401
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.metrics import read_metrics
from engine.train.pretrain import run_pretrain
from flows.links import input_links
from flows.pipeline import FLOW_NAME, PrefectHooks, run_plan
from flows.spec import Pipeline
from flows.summary import format_number, line_level
from tasks.registry import Input, StageContext, StageKind, register_stage
from tests.deps import need
from tests.pipeline_toys import ValueConfig

# A 1x1 PNG: what an evaluation report's plot is to the stage summary.
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


@register_stage
class ToyReport(StageKind):
    """An eval_report with a report.md that shows a plot, as the evaluate stage writes it."""

    task = "toy-report"
    output = "eval_report"
    inputs = {"checkpoint": Input("checkpoint")}
    config_schema = ValueConfig

    def run(self, ctx: StageContext) -> dict:
        (ctx.out_dir / "plot.png").write_bytes(PNG)
        (ctx.out_dir / "report.md").write_text(
            "# Evaluation\n\n| model | loss |\n|---|---|\n| m | 1.5 |\n\n![plot](plot.png)\n"
        )
        return {"loss": 1.23456789, "tokens": 123456}


def client():
    from prefect import get_client

    return get_client(sync_client=True)


def lineage_pipeline(store: Path) -> Pipeline:
    p = Pipeline("observed", store=store)
    a = p.stage("a", task="toy-source", config={"value": 1})
    b = p.stage("b", task="toy-source", config={"value": 2})
    ab = p.stage("ab", task="toy-sum", inputs={"a": a, "b": b})
    p.stage("report", task="toy-report", inputs={"checkpoint": ab})
    return p


def asset_events(since, keys: set[str], expected: int, timeout: float = 60.0) -> list:
    """Asset events about `keys` since `since`, once `expected` of them are stored (the server
    persists events in batches)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    deadline = time.monotonic() + timeout
    while True:
        with client() as c:
            page = c.read_events(
                EventFilter(
                    occurred=EventOccurredFilter(since=since), event=EventNameFilter(prefix=["prefect.asset."])
                ),
                limit=50,
            )
        events = [e for e in page.events if e.resource.id in keys]
        if len(events) >= expected or time.monotonic() > deadline:
            return events
        time.sleep(1.0)


def test_runs_are_tagged_stages_materialise_assets_from_their_inputs_and_publish_one_summary(prefect_server, tmp_path):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
    from prefect.types._datetime import now

    since = now("UTC")
    result = run_plan(lineage_pipeline(tmp_path / "store").plan())
    ids = {stage: r["artifact_id"] for stage, r in result.items()}
    flow_run_id = result["a"]["flow_run_id"]
    with client() as c:
        flow_run = c.read_flow_run(flow_run_id)
        flow = c.read_flow(flow_run.flow_id)
        task_runs = {
            r.name: r for r in c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        }
        artifacts = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )

    # One flow and one naming scheme, tags a concurrency limit can use.
    assert flow.name == FLOW_NAME and flow_run.name.startswith("observed-20")
    assert {"trainflow", "pipeline:observed"} <= set(flow_run.tags)
    assert set(task_runs["ab"].tags) >= {"trainflow", "pipeline:observed", "stage:ab", "task:toy-sum"}
    assert set(task_runs["report"].tags) >= {"stage:report", "task:toy-report"}

    # Each stage materialises its artifact's asset, with its inputs' assets as upstream.
    keys = {stage: f"trainflow://{stage}/{artifact_id}" for stage, artifact_id in ids.items()}
    events = asset_events(since, set(keys.values()), expected=4 + 3)  # 4 materialisations, 3 references
    materialised = {e.resource.id: e for e in events if e.event == "prefect.asset.materialization.succeeded"}
    assert set(materialised) == set(keys.values())
    upstream = sorted(r.id for r in materialised[keys["ab"]].related if r.role == "asset")
    assert upstream == sorted([keys["a"], keys["b"]])
    assert [r.id for r in materialised[keys["report"]].related if r.role == "asset"] == [keys["ab"]]
    assert materialised[keys["ab"]].payload["metrics"] == {"value": 4}
    assert any(
        r.role == "task-run" and r.id == f"prefect.task-run.{task_runs['ab'].id}"
        for r in materialised[keys["ab"]].related
    )

    # One summary per stage (plus its progress): rounded metrics, lineage, the plot inline.
    by_key = {a.key: a for a in artifacts}
    assert sorted(k for k, a in by_key.items() if a.type == "markdown") == sorted(f"observed-{stage}" for stage in ids)
    report = by_key["observed-report"].data
    assert "| loss | 1.235 |" in report and "| tokens | 123,456 |" in report
    assert f"![plot](data:image/png;base64,{base64.b64encode(PNG).decode()})" in report
    assert "file://" not in report

    # Lineage in the UI: each input is linked to the task run that made it, the summary that
    # run published and its asset's events (the pinned UI's closest view of an asset), at
    # addresses the installed UI routes, whose records the API serves.
    ui = prefect_server.removesuffix("/api")
    ab = json.loads((Path(result["ab"]["path"]) / "artifact.json").read_text())
    links = input_links(ab, keys["ab"])
    assert links["task run"] == f"{ui}/runs/task-run/{task_runs['ab'].id}"
    assert links["summary"] == f"{ui}/artifacts/key/observed-ab"
    # The asset's events: the feed the server's UI shows at /events, filtered by the plain
    # resource id (a JSON list there is a prefix with brackets: an empty feed) over a range
    # that covers the run (the parameters its event page reads; without them, the last day).
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(links["asset events"]).query)
    assert query["resource"] == [keys["ab"]] and query["type"] == ["range"]
    assert query["startDate"][0] < ab["created_at"] and query["endDate"][0] > ab["finished_at"]
    assert events_page_parameters() >= {"resource", "type", "startDate", "endDate"}
    assert (
        f"| checkpoint | ab/{ids['ab']} | checkpoint | [`{keys['ab']}`]({links['asset events']}) "
        f"| [task run]({links['task run']}) · [summary]({links['summary']}) |"
    ) in report
    assert ab["prefect"]["ui_url"] == f"{ui}/runs/flow-run/{flow_run_id}"
    for url in (*links.values(), ab["prefect"]["ui_url"]):
        assert ui_routed(url), url
    assert not ui_routed(f"{ui}/assets") and not ui_routed(f"{ui}/assets/{keys['ab']}")  # no asset page in 3.9
    assert http_json(ab["prefect"]["api_url"])["id"] == flow_run_id  # was .../flow-runs/flow-run/<id>: a 404
    assert http_json(f"{prefect_server}/task_runs/{task_runs['ab'].id}")["name"] == "ab"
    assert http_json(f"{prefect_server}/artifacts/observed-ab/latest")["data"].startswith("# ab (toy-sum)")
    shown = http_json(
        f"{prefect_server}/events/filter",
        {
            "filter": {
                "occurred": {"since": query["startDate"][0], "until": query["endDate"][0]},
                "any_resource": {"id_prefix": query["resource"]},
            }
        },
    )["events"]
    assert {e["event"] for e in shown} >= {"prefect.asset.materialization.succeeded", "prefect.asset.referenced"}
    # trainflow lineage prints the UI address of each run, absolute.
    from flows.inspection import format_lineage, lineage

    assert f"         {links['task run']}" in format_lineage(lineage(Path(result["report"]["path"])), width=200)

    # A re-run skips every stage and materialises nothing.
    since = now("UTC")
    again = run_plan(lineage_pipeline(tmp_path / "store").plan())
    assert {r["status"] for r in again.values()} == {"skipped"}
    time.sleep(3.0)  # what the server would have persisted by now
    assert not [
        e
        for e in asset_events(since, set(keys.values()), expected=1, timeout=3.0)
        if e.event.startswith("prefect.asset.materialization")
    ]


def http_json(url: str, body: dict | None = None) -> dict:
    """GET (or POST `body` to) a URL of the server; raises HTTPError on a 404."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status in (200, 201)
        return json.loads(response.read())


@functools.cache
def ui_routes() -> list[re.Pattern]:
    """The page routes of the installed Prefect's default UI (the React one: its router's
    route ids, e.g. `/runs/task-run/$id`), as patterns of URL paths. The test server serves
    no UI (Prefect's harness turns it off), and the UI answers every path with its page:
    the route table is what says whether an address opens a view."""
    import prefect

    static = Path(prefect.__ui_v2_static_path__)
    entry = re.search(r'src="[^"]*/(assets/index-[^"/]*\.js)"', (static / "index.html").read_text()).group(1)
    ids = set(re.findall(r"id:`(/[^`]*)`", (static / entry).read_text()))
    assert {"/runs/task-run/$id", "/artifacts/key/$key", "/events/"} <= ids, sorted(ids)
    return [re.compile("^" + re.sub(r"\$\w+", "[^/]+", i.rstrip("/") or "/") + "/?$") for i in ids]


def events_page_parameters() -> set[str]:
    """The query parameters the event page of the UI the server answers `/events` with (its
    original one; the newer one lives under `/v2`) reads: the array of resource-id prefixes
    in its page component, the date range's in the shared bundle (minified: `f(`name`, ...)`)."""
    import prefect

    static = Path(prefect.__ui_static_path__) / "assets"
    (page,) = static.glob("Events-*.js")
    names = set(re.findall(r"\b\w+\(`(\w+)`,\[\]\)", page.read_text()))
    for bundle in static.glob("index-*.js"):
        text = bundle.read_text()
        ranged = re.search(r"\w+\(`endDate`,(\w+)\).{0,300}?\w+\(`startDate`,\1\).{0,100}?\w+\(`type`,\w+\)", text)
        if ranged:
            names |= set(re.findall(r"\w+\(`(\w+)`,\w+\)", ranged.group(0)))
    return names


def ui_routed(url: str) -> bool:
    path = urllib.parse.urlsplit(url).path
    return any(pattern.match(path) for pattern in ui_routes())


def test_ui_addresses_are_recorded_only_where_the_ui_has_one():
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    from flows.inspection import shown_url
    from flows.links import run_links

    api = "http://127.0.0.1:4200/api"
    with temporary_settings({PREFECT_API_URL: api}):  # a configured server: its UI's addresses
        assert run_links("f", "t") == {
            "api_url": f"{api}/flow_runs/f",
            "ui": "http://127.0.0.1:4200",
            "ui_url": "http://127.0.0.1:4200/runs/flow-run/f",
            "task_run_ui_url": "http://127.0.0.1:4200/runs/task-run/t",
        }
    with temporary_settings({PREFECT_API_URL: api, PREFECT_UI_URL: ""}):  # the local server of a run: no UI
        assert run_links("f", "t") == {"api_url": f"{api}/flow_runs/f"}
    assert input_links({"prefect": {"api_url": f"{api}/flow_runs/f"}}, "trainflow://a/1") == {}
    # lineage: absolute addresses only; a manifest of before this fix has prefect.runtime's.
    assert shown_url({"ui_url": "/flow-runs/flow-run/f"}) is None
    assert shown_url({"ui_url": "http://h:4200/flow-runs/flow-run/f"}) == "http://h:4200/runs/flow-run/f"
    assert shown_url({"ui_url": "http://h/runs/flow-run/f", "task_run_ui_url": "http://h/runs/task-run/t"}) == (
        "http://h/runs/task-run/t"
    )


def test_a_tag_concurrency_limit_holds_a_pipelines_stages_to_one_at_a_time(prefect_server, tmp_path):
    """The recipe in docs/pipelines.md: `prefect concurrency-limit create pipeline:<name> 1`."""
    p = Pipeline("limited", store=tmp_path / "store")
    for name in ("left", "right"):  # independent: without the limit they run at once
        p.stage(name, task="toy-source", config={"value": len(name), "sleep": 1.0})
    with client() as c:
        c.create_concurrency_limit(tag="pipeline:limited", concurrency_limit=1)
    try:
        result = run_plan(p.plan())
    finally:
        with client() as c:
            c.delete_concurrency_limit_by_tag("pipeline:limited")
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = sorted(
            c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[result["left"]["flow_run_id"]]))),
            key=lambda run: run.start_time,
        )
    assert [run.state.is_completed() for run in runs] == [True, True]
    assert runs[1].start_time >= runs[0].end_time  # one after the other


def test_child_lines_keep_their_level_and_metrics_read_step_of_total_with_an_eta():
    assert line_level("WARNING:absl:something") == logging.WARNING
    assert line_level("[rank 1] E1130 11:02:14.640 12345 client.cc:12] lost") == logging.ERROR
    assert line_level("/x/y.py:12: UserWarning: careful") == logging.WARNING
    assert line_level("error: steps: must be even") == logging.ERROR
    assert line_level("step 10: loss=1.0") == logging.INFO

    hooks = PrefectHooks(logging.getLogger("test"), reporter=None, progress_key="k", description="d", total_steps=300)
    first = hooks.format_metrics({"step": 10, "loss": 6.23612, "tokens_per_second": 9323.4, "mfu": 0.17}, now=100.0)
    assert first == "step 10/300 (3%): loss=6.236 | 9,323 tokens/s"
    later = hooks.format_metrics({"step": 60, "loss": 5.9, "tokens_per_second": 12431.0}, now=110.0)
    assert later == "step 60/300 (20%): loss=5.9 | 12,431 tokens/s, ETA 48s"  # 0.2 s a step, 240 to go
    assert format_number(16.260341347000008) == "16.26" and format_number(None) == "n/a"


# A GRPO metrics record as the engine logs it (engine/posttrain/grpo.py, policy_loss.py,
# engine/train/hooks.py): 31 keys, 570-656 characters a line when every one was shown.
GRPO_RECORD = {
    "step": 35,
    "loss": 0.0041,
    "pg_loss": 0.0039,
    "kl": 0.00213,
    "entropy": 1.2931,
    "clip_ratio": 0.0,
    "clip_ratio_low": 0.0,
    "clip_ratio_high": 0.0,
    "grad_norm": 0.41632,
    "reward": 0.55078125,
    "reward_std": 0.31245,
    "frac_reward_zero_std": 0.40625,
    "reward_invalid": 0.0,
    "completion_length": 3.91796875,
    "completion_length_min": 2.0,
    "completion_length_max": 6.0,
    "completion_clipped_ratio": 0.0234375,
    "reward/correct/mean": 0.55078125,
    "reward/correct/std": 0.49741,
    "reward/length/mean": -0.0123,
    "reward/length/std": 0.0456,
    "rollout_seconds": 0.61234,
    "update_seconds": 0.4132,
    "staleness": 0.0,
    "learning_rate": 2.9e-05,
    "updates": 1,
    "prompts": 32,
    "completions": 256,
    "tokens_per_second": 1874.3,
    "tflops_per_device": 0.0123,
    "mfu": 0.0061,
}


def test_a_step_line_shows_the_few_metrics_of_its_stage_kind_in_at_most_160_characters():
    from flows.summary import CONSOLE_WIDTH, step_line

    old = ", ".join(f"{k}={format_number(v)}" for k, v in GRPO_RECORD.items())
    assert len(old) > 500  # what every metric in the line came to
    hooks = PrefectHooks(logging.getLogger("t"), None, "k", "d", total_steps=60, task="grpo")
    hooks.format_metrics({**GRPO_RECORD, "step": 5}, now=10.0)
    line = hooks.format_metrics(GRPO_RECORD, now=25.0)  # 30 steps in 15 s, 25 to go
    assert line == (
        "step 35/60 (58%): reward=0.5508 reward_std=0.3125 completion_length=3.918 kl=0.00213 entropy=1.293 "
        "| 1,874 tokens/s, ETA 12s"
    )
    # Each kind its own few; an eval record their eval_ counterparts; all within the width.
    dpo = {"step": 20, "loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.31, "logps/chosen": -41.2}
    assert step_line("dpo", dpo, 100) == "step 20/100 (20%): loss=0.61 rewards/accuracies=0.75 rewards/margins=0.31"
    assert step_line("sft", {"step": 50, "eval_loss": 2.31, "eval_perplexity": 10.1}, 150) == (
        "step 50/150 (33%): eval_loss=2.31"
    )
    assert step_line("toy", {"step": 3, "a": 1, "b": 2.5}, None) == "step 3: a=1 b=2.5"  # an unknown kind
    long_names = {"step": 1, **{f"a_rather_long_metric_name_{i}": 1.0 for i in range(20)}}
    assert len(step_line("pretrain", {**long_names, "loss": 1.0, "grad_norm": 1.0}, 10)) <= CONSOLE_WIDTH
    assert len(step_line("toy", long_names, 10)) <= CONSOLE_WIDTH


def test_the_pipeline_line_says_stages_done_of_all_elapsed_and_what_was_skipped():
    from flows.summary import PipelineProgress

    progress = PipelineProgress("quickstart", 6, now=0.0)
    first = progress.finished("problems", "skipped", now=1.0)
    assert first == "pipeline quickstart: 1/6 stages done (1 skipped: problems), 1s"
    progress.finished("tokenize", "skipped", now=1.5)
    progress.started("pretrain")
    progress.started("other")
    assert progress.finished("other", "ran", now=62.0) == (
        "pipeline quickstart: 3/6 stages done (2 skipped: problems, tokenize), 1m02s; running: pretrain"
    )
    assert progress.finished("gated", "skipped (condition)", now=63.0).startswith(
        "pipeline quickstart: 4/6 stages done (3 skipped: problems, tokenize, gated)"
    )


def test_tokenize_says_shards_done_with_an_eta():
    from engine.data.tokenize import _Progress

    lines: list[str] = []
    progress = _Progress(total=2, done=0, log=lines.append)
    for _ in range(2):
        progress.update({"stats": {"bytes": 1 << 20, "text_tokens": 1000}})
    assert re.fullmatch(r"tokenize: 2/2 shards, 2000 tokens, [\d.]+ MB/s, ETA 0s", lines[-1]), lines


def test_evaluate_says_its_share_done_and_an_eta_for_all_its_models():
    from engine.evaluate.evaluate import Progress

    lines: list[str] = []
    progress = Progress(total_batches=16, models=2, log=lines.append)  # 2 models x (4 loss + 4 prompt batches)
    progress.start_model("sft")
    progress.advance(4, "held-out loss 2.1139 (3.1 s)")
    progress.advance(1, "arithmetic 128/500 prompts")
    assert lines[0] == "evaluate: sft (1/2): held-out loss 2.1139 (3.1 s) | 25%"  # the pace is not known yet
    assert lines[1].startswith("evaluate: sft (1/2): arithmetic 128/500 prompts | 31%, ETA ")
    progress.start_model("grpo")
    progress.advance(11, "arithmetic 500/500 prompts")
    assert lines[-1].startswith("evaluate: grpo (2/2): arithmetic 500/500 prompts | 100%, ETA 0s")


# --------------------------------------------------------------------------- metric sinks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1, SQLite in a temp dir; yields its URI."""
    need("mlflow")
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root",
            str(root / "artifacts"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # no job runner: a third of the start-up
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert server.poll() is None, (root / "server.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "the MLflow server did not answer"
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGKILL)  # a throwaway server: nothing of it is kept
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def tracked_run(byte_dataset, mlflow_server, tmp_path_factory):
    """A tiny pretrain whose metrics go to TensorBoard, MLflow and (offline) W&B."""
    out = tmp_path_factory.mktemp("tracked")
    sinks = ["tensorboard", "mlflow"] + (["wandb"] if _has_wandb() else [])
    cfg = load_config(
        tree={
            "model": "tiny",
            "steps": 4,
            "log_every": 2,
            "progress": False,
            "metrics_dir": str(out),
            "data": {"path": str(byte_dataset), "seq_len": 32, "batch_size": 8, "eval_batches": 1},
            "checkpoint": {"directory": str(out / "checkpoint"), "every_steps": 4},
            "metrics": {
                "sinks": sinks,
                "run_name": "pretrain",
                "mlflow": {"tracking_uri": mlflow_server, "experiment": "observability"},
                "wandb": {"project": "observability", "mode": "offline"},
            },
        },
        schema=TrainConfig,
    )
    return out, run_pretrain(cfg), cfg


def _has_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def test_mlflow_gets_the_runs_params_and_metrics(tracked_run, mlflow_server):
    from mlflow.tracking import MlflowClient

    out, result, cfg = tracked_run
    mlflow_client = MlflowClient(tracking_uri=mlflow_server)
    experiment = mlflow_client.get_experiment_by_name("observability")
    (run,) = mlflow_client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "pretrain" and run.info.status == "FINISHED"
    assert run.data.params["steps"] == "4" and run.data.params["model.num_layers"] == str(cfg.model.num_layers)
    assert run.data.params["optimizer.learning_rate"] == str(cfg.optimizer.learning_rate)
    losses = mlflow_client.get_metric_history(run.info.run_id, "train/loss")
    logged = [r for r in read_metrics(out) if "loss" in r]
    assert [(m.step, m.value) for m in losses] == [(r["step"], pytest.approx(r["loss"])) for r in logged]
    assert mlflow_client.get_metric_history(run.info.run_id, "eval/loss")[-1].value == pytest.approx(
        result["eval_loss"]
    )


def test_evaluate_writes_each_models_results_to_tensorboard_at_its_step(tracked_run, byte_dataset, tmp_path):
    import tensorflow as tf

    from engine.evaluate.config import EvalConfig
    from engine.evaluate.evaluate import run_evaluate

    out, result, _ = tracked_run
    cfg = EvalConfig(
        data_path=str(byte_dataset), loss_batches=1, seq_len=32, batch_size=8, metrics={"run_name": "evaluate"}
    )
    report = run_evaluate(cfg, {"tiny": out / "checkpoint"}, tmp_path, log=lambda _: None)
    (events,) = (tmp_path / "tensorboard" / "evaluate").glob("events.out.tfevents*")
    logged = {
        (value.tag, event.step): value.simple_value
        for event in tf.compat.v1.train.summary_iterator(str(events))
        for value in event.summary.value
    }
    assert logged == {
        ("eval/tiny/eval_loss", result["steps"]): pytest.approx(report["models"]["tiny"]["eval_loss"]),
        ("eval/tiny/eval_perplexity", result["steps"]): pytest.approx(
            report["models"]["tiny"]["eval_perplexity"], rel=1e-6
        ),
    }


def test_tensorboard_names_the_run_by_stage(tracked_run):
    out, _, _ = tracked_run
    assert [p.name for p in (out / "tensorboard").iterdir()] == ["pretrain"]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard" / "pretrain").iterdir())


def test_engine_processes_start_without_torch_and_later_imports_of_it_still_work(tmp_path):
    """tensorboardX would import torch, boto3 and google-cloud-storage (3-6 s per engine
    process) where they are installed; the engine hides them for that import only."""
    code = f"""
import sys
import engine.train.pretrain, engine.posttrain.grpo, engine.posttrain.sft, engine.evaluate.evaluate
print(sorted(m for m in ("torch", "boto3", "google.cloud.storage") if m in sys.modules))
import torch, boto3
from google.cloud import storage
from engine.train.metrics import SummaryWriter
with SummaryWriter({str(tmp_path)!r}) as writer:
    writer.add_scalar("loss", torch.tensor(0.5).item(), 3)
print(torch.ones(2).sum().item(), storage.Client.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "2.0 Client"], out
    (events,) = tmp_path.glob("events.out.tfevents*")
    assert b"loss" in events.read_bytes()


def wandb_records(path: Path):
    """The records of a W&B transaction log (.wandb): a 7-byte file header, then LevelDB's
    log format, 32 KiB blocks of chunks with a 7-byte header (crc, length, type)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            yield pending
            pending = b""


def test_wandb_offline_keeps_the_metrics_in_the_run_directory(tracked_run):
    need("wandb")
    from wandb.proto import wandb_internal_pb2

    out, _, _ = tracked_run
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    logged = [r for r in read_metrics(out) if "loss" in r]
    assert [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h] == [
        (r["step"], pytest.approx(r["loss"])) for r in logged
    ]
    assert json.loads((out / "wandb_run.json").read_text())["run_id"] in run_file.name
