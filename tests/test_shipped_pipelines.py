"""The shipped pipelines of configs/pipelines/ run to completion, as `trainflow run` runs
them, shrunk only by command-line overrides (fewer problems, steps and points; nothing
else of the file changes), on the session's Prefect server.

Which test runs which shipped pipeline:
    quickstart.yaml  tests/test_quickstart.py (as shipped, full size)
    tiny.yaml        tests/test_object_store.py (on an S3 store, a smaller corpus and fewer steps)
    sweep.yaml       here
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.data.tokenizer import load_saved
from tasks.artifacts import read_manifest
from tests.conftest import REPO
from tests.test_object_store import trainflow

pytestmark = pytest.mark.slow

PIPELINES = REPO / "configs" / "pipelines"

SWEEP_SMALL = [
    "problems.pretrain_problems=2000",
    "problems.sft_problems=160",  # sft's eval_fraction 0.05: 8 held out
    "problems.rl_problems=8",
    "problems.eval_problems=16",
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


def test_the_shipped_sweep_runs_to_its_export_of_the_point_with_the_best_held_out_loss(prefect_server, tmp_path):
    pipeline, store = PIPELINES / "sweep.yaml", tmp_path / "store"
    trainflow("run", pipeline, "--store", store, *SWEEP_SMALL, timeout=1200)

    status = json.loads(trainflow("status", pipeline, "--store", store, *SWEEP_SMALL, "--json").stdout)
    states = {row["stage"]: row["state"] for row in status["stages"]}
    points = ["sft[lr=0.001,rank=8]", "sft[lr=0.001,rank=16]"]
    stages = ["problems", "tokenize", "pretrain", "early", *points, "evaluate", "export"]
    assert states == dict.fromkeys(stages, "complete"), states
    ids = {row["stage"]: row["artifact_id"] for row in status["stages"]}

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
