"""The distill stage: a student checkpoint (or adapter) artifact, a teacher checkpoint (or
adapter) artifact and a JSONL file of examples in, the student's checkpoint (or, with
`lora:`, adapter) artifact out.

    <out>/checkpoint/     Orbax checkpoints of the student (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the student's tokenizer, carried along (the teacher's must equal it)
    <out>/distill.yaml    the resolved engine config the child ran
    <out>/metrics.jsonl   per step and held out: loss, jsd, nll/student, nll/teacher; on_policy

The engine runs in a child process (`python -m engine.posttrain.distill <out>/distill.yaml`); a
re-run resumes from the latest checkpoint. A teacher of another vocabulary exits 2 in one
sentence naming both. The artifact id covers both inputs' ids and the examples' bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.contract import TOKENIZER_DIR
from engine.posttrain.distill_config import DistillConfig
from tasks.engine_stage import FineTuneStage
from tasks.registry import MODEL_KINDS, Input, StageContext


class DistillStage(FineTuneStage):
    task = "distill"
    entry_point = "engine.posttrain.distill"
    planner = "engine.posttrain.distill:step_spec"
    inputs = {
        **FineTuneStage.checkpoint_inputs(
            "the student: the model trained (params; a fresh optimizer) and its tokenizer/"
        ),
        "teacher": Input(MODEL_KINDS, doc="the frozen teacher, of the student's vocabulary"),
    }
    pipeline_owned = {
        **FineTuneStage.pipeline_owned,
        "teacher.checkpoint": "input 'teacher'",
        "teacher.tokenizer": "input 'teacher' (its tokenizer/)",
    }
    non_semantic = (*FineTuneStage.non_semantic, "teacher.checkpoint", "teacher.tokenizer")
    config_schema = DistillConfig
    console_metrics = ("loss", "jsd")
    version = 1
    data_doc = "a JSONL file of examples (prompt/completion or messages)"

    def run(self, ctx: StageContext) -> dict[str, Any]:
        teacher = ctx.inputs["teacher"]
        cfg = ctx.config.model_copy(
            update={
                "teacher": ctx.config.teacher.model_copy(
                    update={
                        "checkpoint": teacher.checkpoint_dir,
                        "tokenizer": teacher.for_ranks(str(teacher.path / TOKENIZER_DIR)),
                    }
                )
            }
        )
        return super().run(dataclasses.replace(ctx, config=cfg))
