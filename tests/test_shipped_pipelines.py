"""The shipped pipelines of configs/pipelines/ run to completion, as `trainflow run` runs
them, shrunk only by command-line overrides (fewer problems, steps and points; nothing
else of the file changes), on the session's Prefect server and an S3 store (moto on
127.0.0.1, one server and one bucket for the module): every stage's engine reads its inputs
and writes its checkpoint at the bucket's URL, evaluate and export included, as on a machine
that shares no disk with the runner.

Which test runs which shipped pipeline:
    quickstart.yaml  here (and tests/test_quickstart.py: as shipped, full size, a local store)
    tiny.yaml        tests/test_object_store.py (on an S3 store, a smaller corpus and fewer steps)
    sweep.yaml, posttrain.yaml, tools.yaml, reasoning_gym.yaml, openenv.yaml   here
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import yaml

from engine.data.tokenizer import load_saved
from engine.data.urls import local_folder, read_text
from engine.posttrain.sandbox import FAILURE_KINDS
from flows.spec import load_plan
from tasks.store.base import ArtifactStore
from tasks.store.names import stage_folder
from tests.conftest import REPO
from tests.deps import need
from tests.test_object_store import boto3, s3_endpoint, trainflow  # noqa: F401  (the module's moto server)

PIPELINES = REPO / "configs" / "pipelines"

# The same problems for every pipeline (the stages they share are made once, in one store).
SMALL_PROBLEMS = [
    "problems.pretrain_problems=2000",
    "problems.sft_problems=160",  # the sweep's sft holds out 5%: 8 examples
    "problems.rl_problems=8",
    "problems.eval_problems=8",
    "problems.preference_pairs=48",  # reward_model and dpo hold out 10%
]

SWEEP_SMALL = [
    *SMALL_PROBLEMS,
    "pretrain.steps=4",
    "pretrain.data.batch_size=4",
    "pretrain.data.seq_len=64",
    "pretrain.checkpoint.every_steps=2",
    "stages.early.inputs.pretrain=pretrain@2",
    "early.loss_batches=1",
    # 2 points of the grid: the gate below names lr=0.001, rank=16.
    "stages.sft.matrix={optimizer.learning_rate: [1.0e-3], lora.rank: [8, 16]}",
    "sft.steps=4",
    "sft.eval_every=2",
    "sft.data.batch_size=4",
    "sft.data.seq_len=64",
    "evaluate.loss_batches=1",
    "evaluate.tasks.0.limit=4",
    # A few steps teach no arithmetic: the gate's threshold is lowered so export runs too.
    'stages.export.when=evaluate.metrics["models[lr=0.001,rank=16]/arithmetic/accuracy"] >= 0',
]


SMALL_LM = ["steps=2", "data.batch_size=4", "data.seq_len=64", "checkpoint.every_steps=2"]
SMALL_PAIRS = ["steps=2", "data.batch_size=4", "eval_every=2", "checkpoint.every_steps=2"]
SMALL_GRPO = ["steps=2", "prompts_per_step=2", "num_generations=2", "checkpoint.every_steps=2"]
SMALL_EVALUATE = ["evaluate.loss_batches=1", "evaluate.tasks.0.limit=4"]


def at(stage: str, overrides: list[str]) -> list[str]:
    return [f"{stage}.{item}" for item in overrides]


POSTTRAIN_SMALL = [
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("pretrain_small", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("distill", SMALL_LM),
    *at("reward_model", SMALL_PAIRS),
    *at("dpo", SMALL_PAIRS),
    *at("grpo", SMALL_GRPO),
    *SMALL_EVALUATE,
]

QUICKSTART_SMALL = [
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("grpo", SMALL_GRPO),
    *SMALL_EVALUATE,
]

TOOLS_SMALL = [
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("grpo", SMALL_GRPO),
    "grpo.environment.max_turns=2",
    "grpo.environment.max_turn_tokens=4",
    "grpo.max_completion_length=16",
]

REASONING_GYM_SMALL = [  # tools.yaml's stages before grpo, at TOOLS_SMALL's sizes: made once
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("grpo", SMALL_GRPO),
    "grpo.data.reasoning_gym.size=8",
]

OPENENV_SMALL = [  # tools.yaml's stages before grpo, at TOOLS_SMALL's sizes: made once
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("grpo", SMALL_GRPO),
    "grpo.environment.max_turns=2",
    "grpo.environment.max_turn_tokens=4",
    "grpo.max_completion_length=16",
]


@pytest.fixture(scope="module")
def store(s3_endpoint) -> str:  # noqa: F811
    """One S3 store for the module: a stage two pipelines share at the same config runs once."""
    name = f"trainflow-shipped-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}/artifacts"


def run_to_completion(name: str, overrides: list[str], store: str) -> dict[str, dict]:
    """`trainflow run` of a shipped pipeline, then `trainflow status`: stage -> its row."""
    pipeline = PIPELINES / name
    trainflow("run", pipeline, "--store", store, *overrides, timeout=1200)
    status = json.loads(trainflow("status", pipeline, "--store", store, *overrides, "--json").stdout)
    return {row["stage"]: row for row in status["stages"]}


def in_bucket(store: str, stage: str, artifact_id: str, rel: str) -> str:
    """The URL of a file of an artifact (a sweep point's folder: its name with parentheses)."""
    return f"{store}/{stage_folder(stage)}/{artifact_id}/{rel}"


def test_a_shipped_selection_by_a_held_out_metric_ranks_points_that_hold_data_out():
    """What the run below finds after minutes, found at once: `select: {by: metrics.eval_...}`
    needs candidates that measure a held-out metric (eval_fraction or eval_path)."""
    checked = []
    for path in sorted(PIPELINES.glob("*.yaml")):
        plan, stages = load_plan(path), yaml.safe_load(path.read_text())["stages"]
        for name, stage in stages.items():
            for input_name, source in (stage.get("inputs") or {}).items():
                select = source.get("select") if isinstance(source, dict) else None
                if not select or not select["by"].startswith("metrics.eval_"):
                    continue
                sweep = select["from"].removesuffix("[*]")
                for point, planned in plan.stages.items():
                    if point.startswith(f"{sweep}["):
                        data = planned.job.config.data
                        assert data.eval_fraction > 0 or data.eval_path, f"{path.name}: {name}.{input_name}: {point}"
                        checked.append(point)
    assert checked  # sweep.yaml's export selects among its sft points


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("posttrain.yaml", POSTTRAIN_SMALL),
        ("tools.yaml", TOOLS_SMALL),
        ("reasoning_gym.yaml", REASONING_GYM_SMALL),
        ("openenv.yaml", OPENENV_SMALL),
    ],
)
def test_a_shipped_pipeline_runs_to_completion(prefect_server, store, name, overrides):
    if name in ("reasoning_gym.yaml", "openenv.yaml"):
        need("reasoning_gym" if name == "reasoning_gym.yaml" else "openenv")
    rows = run_to_completion(name, overrides, store)
    states = {stage: row["state"] for stage, row in rows.items()}
    assert set(states.values()) == {"complete"}, states
    if name == "posttrain.yaml":  # every model of the report was read at the bucket's URL
        report = json.loads(read_text(in_bucket(store, "evaluate", rows["evaluate"]["artifact_id"], "report.json")))
        assert set(report["models"]) == {"sft", "dpo", "grpo", "student", "student_before"}, report["models"]
        assert all(str(path).startswith(f"{store}/") for path in report["checkpoints"].values()), report["checkpoints"]
    if name == "tools.yaml":  # the python tool ran under bubblewrap, and the manifest says so
        metrics = ArtifactStore(store).manifest("grpo", rows["grpo"]["artifact_id"])["metrics"]
        assert metrics["tool_sandbox"] == "bubblewrap" and metrics["env/tool_sandbox_weaker"] == 0.0, metrics
        assert {f"env/tool_failures/{kind}" for kind in FAILURE_KINDS} <= set(metrics), metrics
    if name == "reasoning_gym.yaml":  # the manifest names the library, its version and the dataset's config
        manifest = ArtifactStore(store).manifest("grpo", rows["grpo"]["artifact_id"])
        [record] = manifest["metrics"]["environments"]
        assert record["name"] == "reasoning-gym" and record["version"] == importlib.metadata.version("reasoning-gym")
        assert record["config"] == manifest["config"]["data"]["reasoning_gym"] and record["config"]["size"] == 8
        assert "reward/reasoning_gym/mean" in manifest["metrics"], manifest["metrics"]
    if name == "openenv.yaml":  # episodes on the echo server the stage started; the manifest names it
        manifest = ArtifactStore(store).manifest("grpo", rows["grpo"]["artifact_id"])
        [record] = manifest["metrics"]["environments"]
        assert record["name"] == "openenv-core" and record["version"] == importlib.metadata.version("openenv-core")
        assert record["config"] == manifest["config"]["environment"], record
        assert manifest["metrics"]["env/failed"] == 0.0 and manifest["metrics"]["reward/environment/mean"] > 0


@pytest.mark.slow
def test_the_shipped_sweep_runs_to_its_export_of_the_point_with_the_best_held_out_loss(prefect_server, store):
    rows = run_to_completion("sweep.yaml", SWEEP_SMALL, store)
    points = ["sft[lr=0.001,rank=8]", "sft[lr=0.001,rank=16]"]
    stages = ["problems", "tokenize", "pretrain", "early", *points, "evaluate", "export"]
    assert {stage: row["state"] for stage, row in rows.items()} == dict.fromkeys(stages, "complete"), rows
    ids = {stage: row["artifact_id"] for stage, row in rows.items()}
    bucket = ArtifactStore(store)

    # The selection ranked the points by the held-out loss each one's manifest records.
    held_out = {p: bucket.manifest(p, ids[p])["metrics"]["eval_loss"] for p in points}
    chosen = bucket.manifest("export", ids["export"])["decisions"]["select"]["checkpoint"]
    assert chosen["values"] == held_out and chosen["chosen"] == min(points, key=held_out.get), (chosen, held_out)

    # `early` read step 2 of pretrain, taken while pretrain went on to step 4, at the bucket's URL.
    early = json.loads(read_text(in_bucket(store, "early", ids["early"], "report.json")))
    assert early["checkpoints"] == {"pretrain": in_bucket(store, "pretrain@2", ids["pretrain"], "checkpoint")}
    assert early["models"]["pretrain"]["step"] == 2
    assert trainflow("verify", in_bucket(store, "pretrain@2", ids["pretrain"], "")).stdout.startswith(
        f"OK {store}/pretrain@2/{ids['pretrain']}"
    )

    # The merged export says which token ends a text (transformers' generate() stops there).
    config = json.loads(read_text(in_bucket(store, "export", ids["export"], "hf/config.json")))
    tokenizer = load_saved(local_folder(in_bucket(store, chosen["chosen"], ids[chosen["chosen"]], "tokenizer")))
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)


@pytest.mark.slow
def test_the_shipped_quickstart_evaluates_and_exports_from_the_bucket(prefect_server, store, tmp_path):
    """The quickstart's evaluate reads its three checkpoints at the bucket's URL (it once made
    them paths, `.../s3:/bucket/...`, and failed), and `trainflow export` of its GRPO model from
    the bucket gives a directory transformers loads."""
    transformers = need("transformers")
    rows = run_to_completion("quickstart.yaml", QUICKSTART_SMALL, store)
    assert {row["state"] for row in rows.values()} == {"complete"}, rows
    ids = {stage: row["artifact_id"] for stage, row in rows.items()}
    report = json.loads(read_text(in_bucket(store, "evaluate", ids["evaluate"], "report.json")))
    assert report["checkpoints"] == {m: in_bucket(store, m, ids[m], "checkpoint") for m in ("pretrain", "sft", "grpo")}
    for metrics in report["models"].values():
        assert metrics["arithmetic/prompts"] == 4 and 0 <= metrics["arithmetic/accuracy"] <= 1, metrics
    # The prompts were read at the corpus's URL; the report names them by artifact.
    report_md = read_text(in_bucket(store, "evaluate", ids["evaluate"], "report.md"))
    assert f"4 prompts of problems/{ids['problems'][:8]}/eval.jsonl," in report_md, report_md[:2000]

    trainflow("export", in_bucket(store, "grpo", ids["grpo"], ""), "--out", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.num_parameters() == ArtifactStore(store).manifest("grpo", ids["grpo"])["metrics"]["num_params"]
