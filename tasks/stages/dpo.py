"""The dpo stage: a checkpoint (or adapter) artifact and a JSONL file of preference pairs in,
optionally a `reference` checkpoint (or adapter) artifact (TRL's `ref_model`; without it the
reference is the start policy), a checkpoint (or, with `lora:`, an adapter) artifact out.

    <out>/checkpoint/     Orbax checkpoints of the policy (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the input's tokenizer, carried along
    <out>/dpo.yaml        the resolved engine config the child ran
    <out>/metrics.jsonl   per step and held out: loss, rewards/{chosen,rejected,margins,accuracies}, logps/...

The engine runs in a child process (`python -m engine.posttrain.dpo <out>/dpo.yaml`); a re-run
resumes from the latest checkpoint. The artifact id covers the inputs' ids (the reference's
too) and the pairs' bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import BaseModel

from engine.posttrain.config import DPOConfig
from tasks.engine_stage import FineTuneStage
from tasks.registry import MODEL_KINDS, Input, StageContext


class DPOStage(FineTuneStage):
    task = "dpo"
    entry_point = "engine.posttrain.dpo"
    planner = "engine.posttrain.dpo:step_spec"
    inputs = {
        **FineTuneStage.checkpoint_inputs(
            "the policy to start from (and the frozen reference, unless `reference` is given) and its tokenizer/"
        ),
        "reference": Input(
            MODEL_KINDS, required=False, doc="the frozen reference (TRL's ref_model), of the policy's vocabulary"
        ),
    }
    pipeline_owned = {**FineTuneStage.pipeline_owned, "reference.checkpoint": "input 'reference'"}
    non_semantic = (*FineTuneStage.non_semantic, "reference.checkpoint")
    config_schema: ClassVar[type[BaseModel]] = DPOConfig  # a subclass's (KTO's) is its own
    console_metrics = ("loss", "rewards/accuracies", "rewards/margins")
    version = 1
    data_doc = "a JSONL file of preference pairs (prompt, chosen, rejected)"

    def run(self, ctx: StageContext) -> dict[str, Any]:
        reference = ctx.inputs.get("reference")
        if reference is None:
            return super().run(ctx)
        update = {"reference": ctx.config.reference.model_copy(update={"checkpoint": reference.checkpoint_dir})}
        return super().run(dataclasses.replace(ctx, config=ctx.config.model_copy(update=update)))
