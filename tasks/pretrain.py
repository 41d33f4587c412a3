"""The pretrain stage: a dataset artifact in, a checkpoint artifact out.

The engine runs in a child process (`python -m engine.train <out>/train.yaml`) started by
the stage's launcher. Artifact layout, which later stages (SFT, GRPO, evaluate, export)
rely on:

    <out>/checkpoint/     Orbax CheckpointManager directory (engine.checkpoint.load_params)
    <out>/tokenizer/      the dataset's tokenizer, so a checkpoint carries its tokenizer
    <out>/train.yaml      the resolved engine config the child ran
    <out>/metrics.jsonl   one JSON object per log step (and eval lines)
    <out>/tensorboard/

A re-run on the same directory resumes from the latest checkpoint (the engine does that).
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

from engine.config import NON_SEMANTIC_FIELDS, ConfigError, TrainConfig, resolve_model_preset, to_yaml, validate
from tasks.registry import Input, StageContext, StageKind

# Set by the stage from its inputs and output directory, never by the user.
PIPELINE_OWNED = {
    "data.path": "input 'dataset'",
    "checkpoint.directory": "the artifact directory",
    "checkpoint.init_from": "input 'init'",
    "metrics_dir": "the artifact directory",
}


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


class PretrainStage(StageKind):
    task = "pretrain"
    output = "checkpoint"
    inputs = {
        "dataset": Input("dataset", doc="token shards (data/) and tokenizer (tokenizer/) from a tokenize stage"),
        "init": Input("checkpoint", required=False, doc="start from these parameters (fresh optimizer)"),
    }
    config_schema = TrainConfig
    version = 1
    # Checkpoint cadence and retention change what is kept on disk, not the final result.
    non_semantic = (*NON_SEMANTIC_FIELDS, *PIPELINE_OWNED, "checkpoint.every_steps", "checkpoint.keep")
    launches_child = True

    def resolve_config(self, raw: dict, source: str) -> TrainConfig:
        for key, owner in PIPELINE_OWNED.items():
            if _get(raw, key) is not None:
                raise ConfigError(f"{source}: key '{key}' is set by the pipeline (from {owner}); remove it")
        resolve_model_preset(raw, source)
        return validate(TrainConfig, raw, source)

    def run(self, ctx: StageContext) -> dict[str, Any]:
        out = ctx.out_dir
        dataset = ctx.inputs["dataset"].path
        tree = ctx.config.model_dump(mode="json")
        tree["data"]["path"] = str(dataset / "data")
        tree["checkpoint"]["directory"] = str(out / "checkpoint")
        if "init" in ctx.inputs:
            tree["checkpoint"]["init_from"] = str(ctx.inputs["init"].path / "checkpoint")
        tree["metrics_dir"] = str(out)
        tree["progress"] = False  # progress goes to the pipeline log through metrics.jsonl
        cfg = TrainConfig.model_validate(tree)
        (out / "train.yaml").write_text(to_yaml(cfg))
        if (dataset / "tokenizer").is_dir():
            shutil.copytree(dataset / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
        if ctx.resumed:
            ctx.log(f"resuming from the checkpoints in {out / 'checkpoint'}")
        result = ctx.launch(
            [sys.executable, "-m", "engine.train", str(out / "train.yaml")],
            metrics_file=out / "metrics.jsonl", total_steps=cfg.steps,
        )
        metrics = result.result or _last_metrics(out / "metrics.jsonl")
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, type(None)))}


def _last_metrics(path) -> dict:
    final: dict = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                final.update(json.loads(line))
            except json.JSONDecodeError:
                pass
    return final
