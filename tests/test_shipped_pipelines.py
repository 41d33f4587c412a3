"""The shipped pipelines of configs/pipelines/ run to completion, as `trainflow run` runs
them, shrunk only by command-line overrides (fewer problems, steps and points; nothing
else of the file changes), on the session's Prefect server.

Which test runs which shipped pipeline:
    quickstart.yaml  tests/test_quickstart.py (as shipped, full size)
    tiny.yaml        tests/test_object_store.py (on an S3 store, a smaller corpus and fewer steps)
    sweep.yaml, posttrain.yaml, tools.yaml   here
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.data.tokenizer import load_saved
from engine.posttrain.sandbox import FAILURE_KINDS
from flows.spec import load_plan
from tasks.store.records import read_manifest
from tests.conftest import REPO
from tests.test_object_store import trainflow

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

TOOLS_SMALL = [
    *SMALL_PROBLEMS,
    *at("pretrain", SMALL_LM),
    *at("sft", SMALL_LM),
    *at("grpo", SMALL_GRPO),
    "grpo.environment.max_turns=2",
    "grpo.environment.max_turn_tokens=4",
    "grpo.max_completion_length=16",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One store for the module: a stage two pipelines share at the same config runs once."""
    return tmp_path_factory.mktemp("shipped") / "store"


def run_to_completion(name: str, overrides: list[str], store: Path) -> dict[str, dict]:
    """`trainflow run` of a shipped pipeline, then `trainflow status`: stage -> its row."""
    pipeline = PIPELINES / name
    trainflow("run", pipeline, "--store", store, *overrides, timeout=1200)
    status = json.loads(trainflow("status", pipeline, "--store", store, *overrides, "--json").stdout)
    return {row["stage"]: row for row in status["stages"]}


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
@pytest.mark.parametrize("name, overrides", [("posttrain.yaml", POSTTRAIN_SMALL), ("tools.yaml", TOOLS_SMALL)])
def test_a_shipped_pipeline_runs_to_completion(prefect_server, store, name, overrides):
    rows = run_to_completion(name, overrides, store)
    states = {stage: row["state"] for stage, row in rows.items()}
    assert set(states.values()) == {"complete"}, states
    if name == "tools.yaml":  # the python tool ran under bubblewrap, and the manifest says so
        metrics = read_manifest(store / "grpo" / rows["grpo"]["artifact_id"])["metrics"]
        assert metrics["tool_sandbox"] == "bubblewrap" and metrics["env/tool_sandbox_weaker"] == 0.0, metrics
        assert {f"env/tool_failures/{kind}" for kind in FAILURE_KINDS} <= set(metrics), metrics


@pytest.mark.slow
def test_the_shipped_sweep_runs_to_its_export_of_the_point_with_the_best_held_out_loss(prefect_server, store):
    rows = run_to_completion("sweep.yaml", SWEEP_SMALL, store)
    points = ["sft[lr=0.001,rank=8]", "sft[lr=0.001,rank=16]"]
    stages = ["problems", "tokenize", "pretrain", "early", *points, "evaluate", "export"]
    assert {stage: row["state"] for stage, row in rows.items()} == dict.fromkeys(stages, "complete"), rows
    ids = {stage: row["artifact_id"] for stage, row in rows.items()}

    # The selection ranked the points by the held-out loss each one's manifest records.
    def artifact(stage: str) -> Path:  # a point's folder: its name with parentheses
        return store / stage.replace("[", "(").replace("]", ")") / ids[stage]

    held_out = {p: read_manifest(artifact(p))["metrics"]["eval_loss"] for p in points}
    chosen = read_manifest(artifact("export"))["decisions"]["select"]["checkpoint"]
    assert chosen["values"] == held_out and chosen["chosen"] == min(points, key=held_out.get), (chosen, held_out)

    # The merged export says which token ends a text (transformers' generate() stops there).
    config = json.loads((artifact("export") / "hf" / "config.json").read_text())
    tokenizer = load_saved(artifact(chosen["chosen"]) / "tokenizer")
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
