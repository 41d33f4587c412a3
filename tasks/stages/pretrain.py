"""The pretrain stage: a dataset artifact in, a checkpoint artifact out.

The engine runs in a child process (`python -m engine.train <out>/train.yaml`) started by
the stage's launcher. Artifact layout, which later stages (SFT, GRPO, evaluate, export)
rely on (names in engine/contract.py):

    <out>/checkpoint/     Orbax CheckpointManager directory (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the dataset's tokenizer, so a checkpoint carries its tokenizer
    <out>/train.yaml      the resolved engine config the child ran
    <out>/metrics.jsonl   one JSON object per log step (and eval lines)
    <out>/tensorboard/

A re-run on the same directory resumes from the latest checkpoint (the engine does that).
"""

from __future__ import annotations

from typing import Any

from engine.config import resolve_model_preset, validate
from engine.contract import CHECKPOINT_CADENCE_FIELDS, NON_SEMANTIC_FIELDS
from engine.train.config import TrainConfig
from tasks.engine_stage import EngineStage, set_dotted
from tasks.registry import Input, StageContext


class PretrainStage(EngineStage):
    task = "pretrain"
    entry_point = "engine.train"
    planner = "engine.train.plan:step_spec"
    output = "checkpoint"
    inputs = {
        "dataset": Input("dataset", doc="token shards (data/) and tokenizer (tokenizer/) from a tokenize stage"),
        "init": Input("checkpoint", required=False, doc="start from these parameters (fresh optimizer)"),
    }
    config_schema = TrainConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture
    pipeline_owned = {
        "data.path": "input 'dataset'",
        "checkpoint.directory": "the artifact directory",
        "checkpoint.init_from": "input 'init'",
        "metrics_dir": "the artifact directory",
    }
    non_semantic = (*NON_SEMANTIC_FIELDS, *CHECKPOINT_CADENCE_FIELDS, *pipeline_owned)

    def resolve_config(self, raw: dict, source: str) -> TrainConfig:
        self.reject_pipeline_owned(raw, source)
        resolve_model_preset(raw, source)
        return validate(TrainConfig, raw, source)

    def run(self, ctx: StageContext) -> dict[str, Any]:
        out, dataset = ctx.out_dir, ctx.inputs["dataset"]
        tree = ctx.config.model_dump(mode="json")
        set_dotted(tree, "data.path", dataset.data_dir)  # the shards at the bucket's URL, or here
        set_dotted(tree, "checkpoint.directory", ctx.checkpoint_dir)
        if "init" in ctx.inputs:
            set_dotted(tree, "checkpoint.init_from", ctx.inputs["init"].checkpoint_dir)
        tree["metrics_dir"] = str(out)  # written by rank 0 only, which runs beside this process
        tree["progress"] = False  # progress goes to the pipeline log through metrics.jsonl
        cfg = TrainConfig.model_validate(tree)
        self.carry_tokenizer(ctx, dataset.path)
        return self.train(ctx, cfg, "train.yaml", cfg.steps)
