"""Stage kinds as one definition each: the artifact ids of the shipped pipelines are pinned
(a refactor of the kinds, the registry or the planner must not move them), and a kind
defined in a test module runs, resumes and is planned through the interface the built-in
kinds use."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import Field

from engine.config import Strict, resolve_model_preset, validate
from engine.contract import CHECKPOINT_CADENCE_FIELDS, CHECKPOINT_DIR, MANIFEST, METRICS_FILE, NON_SEMANTIC_FIELDS
from engine.models.config import ComputeConfig, ModelConfig
from engine.train.config import OptimizerConfig, RunFields, TrainConfig, trainer_view
from engine.train.plan import StepSpec
from flows import cli
from flows.spec import Pipeline, load_plan
from tasks.engine_stage import EngineStage
from tasks.plan import plan_pipeline
from tasks.registry import (
    BUILTIN_STAGES,
    Input,
    StageContext,
    StageHooks,
    entry_points,
    get_stage_kind,
    planner_of,
    register_stage,
    stage_kind_names,
    training_kinds,
)
from tasks.runner import RAN, RESUMED, execute_stage
from tasks.store.records import read_manifest
from tests.conftest import REPO, child_xla_flags

PIPELINES = REPO / "configs" / "pipelines"

# The ids `trainflow status` shows for the shipped pipelines on an empty store (the README's
# quickstart output shows the same for quickstart). A change here is a change users see: every
# finished stage of their stores would run again.
SHIPPED_IDS = {
    "quickstart": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "a4b7b72ff158c4e6",
        "sft": "c82e84fb27fdaba7",
        "grpo": "f7ff91297020fbfa",
        "evaluate": "922e4ee894f31038",
    },
    "tiny": {"tokenize": "01b9e0d01ca57d13", "pretrain": "fcc982a3dcd4f08d"},
    "posttrain": {
        "problems": "e34e7bdfb02d3024",
        "tokenize": "7dd53ccb95bf09d9",
        "pretrain": "6c39daa1dc696826",
        "sft": "8857546d4e1237d6",
        "reward_model": "a51d9942e9283ae4",
        "dpo": "3e99bbe40a1ce48d",
        "grpo": "988a08f748f31ff1",
        "pretrain_small": "0d335299016abcda",
        "distill": "8c3ab0d8d4fd965f",
        "evaluate": "de2e9895d1f06b05",
    },
    "sweep": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "1da926cb3268a252",
        "early": "99e9d615d03659a8",
        "sft[lr=0.001,rank=8]": "28ea72b52c3d006c",
        "sft[lr=0.001,rank=16]": "aa2ec8335a1a72af",
        "sft[lr=0.005,rank=8]": "0782e95ea433216f",
        "sft[lr=0.005,rank=16]": "778b2ad5dbc381e6",
        "evaluate": "1dad27d48836e96e",
        "export": "",  # after a selection: known once the sweep has run
    },
    "tools": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "a4b7b72ff158c4e6",
        "sft": "c82e84fb27fdaba7",
        "grpo": "cbd8e78db70bfbd8",
    },
}


@pytest.mark.parametrize("name", sorted(SHIPPED_IDS))
def test_the_shipped_pipelines_keep_their_artifact_ids(name, tmp_path):
    plan = load_plan(PIPELINES / f"{name}.yaml", store=tmp_path)
    assert {stage: planned.job.artifact_id for stage, planned in plan.stages.items()} == SHIPPED_IDS[name]


# --------------------------------------------------------------------------- a kind of a test's own


class ToyData(Strict):
    seq_len: int = Field(32, gt=1)
    batch_size: int = Field(8, gt=0)


class ToyLMConfig(RunFields):
    """A training kind's schema: the shared training fields, a model and rows of its own."""

    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-2)
    data: ToyData = ToyData()


def toy_trainer_view(cfg: ToyLMConfig, data_path: str | None = None) -> TrainConfig:
    rows = {"seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "path": data_path}
    return trainer_view(cfg, cfg.model, ComputeConfig(), rows, stage="toy-lm")


def toy_step_spec(cfg: ToyLMConfig, models) -> StepSpec:
    """The toy kind's planner hook: language modelling from random weights."""
    return StepSpec(toy_trainer_view(cfg), from_scratch=True)


@register_stage
class ToyLMStage(EngineStage):
    """Pretraining on a dataset artifact, defined outside trainflow."""

    task = "toy-lm"
    entry_point = "engine.train"
    planner = f"{__name__}:toy_step_spec"
    output = "checkpoint"
    inputs = {"dataset": Input("dataset")}
    config_schema = ToyLMConfig
    non_semantic = (*NON_SEMANTIC_FIELDS, *CHECKPOINT_CADENCE_FIELDS)

    def resolve_config(self, raw: dict, source: str) -> ToyLMConfig:
        resolve_model_preset(raw, source)
        return validate(ToyLMConfig, raw, source)

    def run(self, ctx: StageContext) -> dict[str, Any]:
        dataset = ctx.inputs["dataset"]
        cfg = toy_trainer_view(ctx.config, dataset.data_dir).model_copy(
            update={
                "checkpoint": ctx.config.checkpoint.model_copy(update={"directory": ctx.checkpoint_dir}),
                "metrics_dir": str(ctx.out_dir),
                "progress": False,
            }
        )
        self.carry_tokenizer(ctx, dataset.path)
        return self.train(ctx, cfg, "train.yaml", cfg.steps)


def toy_pipeline(store: Path, **toy_config) -> Pipeline:
    p = Pipeline("toy", store=store)
    p.stage("problems", task="arithmetic", config=PROBLEMS)
    p.stage(
        "tokenize",
        task="tokenize",
        inputs={"corpus": "problems"},
        config={
            "sources": [{"format": "text", "path": "{input:corpus}/pretrain.txt", "unit": "line"}],
            "tokenizer": {"vocab_size": 300},
            "validation_fraction": 0.1,
        },
    )
    p.stage(
        "toy",
        task="toy-lm",
        inputs={"dataset": "tokenize"},
        launcher=ONE_DEVICE,
        config={
            "model": {"preset": "tiny", "vocab_size": 300, "num_layers": 2},
            "steps": 4,
            "log_every": 1,
            "checkpoint": {"every_steps": 2, "keep": 4},
            **toy_config,
        },
    )
    return p


PROBLEMS = {"pretrain_problems": 200, "sft_problems": 1, "rl_problems": 1, "eval_problems": 1, "preference_pairs": 0}
ONE_DEVICE = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}


def test_a_toy_kind_is_listed_with_its_entry_point_and_planned_as_itself():
    assert "toy-lm" in stage_kind_names() and "toy-lm" in training_kinds()
    assert entry_points()["toy-lm"] == "engine.train"
    assert planner_of(get_stage_kind("toy-lm")) is toy_step_spec
    # A kind without a planner hook trains nothing: never planned as another kind.
    assert planner_of(get_stage_kind("arithmetic")) is None and "evaluate" not in training_kinds()
    assert set(training_kinds()) >= {"pretrain", "sft", "grpo", "dpo", "reward_model", "distill"}


def test_the_readmes_list_of_built_in_kinds_is_the_registrys():
    text = (REPO / "README.md").read_text()
    listed = text.split("  stages/", 1)[1].split("one module per built-in stage kind", 1)[0]
    assert sorted(re.findall(r"(\w+)\.py", listed)) == sorted(BUILTIN_STAGES)


def test_every_built_in_kind_is_its_module_and_its_entry_point_exists():
    for task in BUILTIN_STAGES:
        kind = get_stage_kind(task)
        assert type(kind).__module__ == f"tasks.stages.{task}" and kind.task == task
        assert kind.entry_point is None or importlib.util.find_spec(kind.entry_point) is not None, task


def losses(out: Path) -> dict[int, float]:
    """step -> training loss in an artifact's metrics.jsonl (a resumed run's lines last)."""
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


@pytest.mark.slow
def test_a_toy_training_kind_runs_resumes_and_is_planned(tmp_path, capsys):
    plan = toy_pipeline(tmp_path).plan()
    statuses = {name: execute_stage(stage.job, plan.store).status for name, stage in plan.stages.items()}
    assert statuses == {"problems": RAN, "tokenize": RAN, "toy": RAN}
    job = plan.stages["toy"].job
    out = plan.store.artifact_dir("toy", job.artifact_id)
    first = read_manifest(out)
    assert first["kind"] == "checkpoint" and first["metrics"]["final_loss"] > 0
    assert sorted(int(p.name) for p in (out / CHECKPOINT_DIR).iterdir() if p.name.isdigit()) == [2, 4]

    trained = losses(out)
    assert sorted(trained) == [1, 2, 3, 4]
    # A crash after step 2: the last step and its lines are gone, the artifact not complete. The rerun
    # resumes from step 2 (through the same runner as every kind) and trains steps 3 and 4 again.
    shutil.rmtree(out / CHECKPOINT_DIR / "4")
    lines = (out / METRICS_FILE).read_text().splitlines()
    (out / METRICS_FILE).write_text("".join(f"{line}\n" for line in lines if json.loads(line).get("step", 0) <= 2))
    (out / MANIFEST).write_text(json.dumps({**first, "status": "failed"}))
    logged: list[str] = []
    again = execute_stage(job, plan.store, StageHooks(log=logged.append))
    assert again.status == RESUMED
    assert any("resumed from checkpoint step 2" in line for line in logged)
    resumed = losses(out)
    assert sorted(resumed) == [1, 2, 3, 4] and read_manifest(out)["status"] == "complete"
    # Steps 3 and 4 trained again from step 2's parameters, optimizer and data position: the
    # losses of the uninterrupted run, bitwise (as the built-in pretrain kind resumes).
    assert resumed == trained
    assert (
        plan.stages["toy"].job.artifact_id == toy_pipeline(tmp_path, log_every=2).plan().stages["toy"].job.artifact_id
    )

    # `trainflow plan`: the toy stage compiled through its own hook, beside nothing else.
    plans, notes = plan_pipeline(plan, "local")
    assert [p.stage for p in plans] == ["toy"] and not notes
    assert plans[0].fits and plans[0].how == "compiled"
    # The command, on the pipeline as YAML that imports this module: the same plan.
    spec = {**toy_pipeline(tmp_path).tree, "imports": [__name__]}
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    assert cli.main(["plan", str(tmp_path / "toy.yaml"), "--target", "local"]) == 0
    out = capsys.readouterr().out
    assert "stage toy on local" in out and "stage tokenize" not in out
