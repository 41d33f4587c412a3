"""The merge stage: an adapter artifact in, a checkpoint artifact out (the adapter folded into
its base: engine/posttrain/merge.py).

    <out>/checkpoint/   a params-only Orbax checkpoint of the merged model
    <out>/tokenizer/    the adapter's tokenizer, carried along

Where the next stage needs a plain model (a full fine-tune, an export that must not depend
on the base artifact staying in the store) rather than base + adapter.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.config import ConfigError, Strict
from engine.contract import TOKENIZER_DIR
from tasks.engine_stage import EngineStage
from tasks.registry import Input, StageContext


class MergeConfig(Strict):
    """Fold a LoRA adapter into its base model."""

    step: int | None = Field(None, ge=0)
    """The adapter's checkpoint step (None: the latest)."""


class MergeStage(EngineStage):
    task = "merge"
    entry_point = "engine.posttrain.merge"
    output = "checkpoint"
    inputs = {"adapter": Input("adapter", doc="a LoRA adapter artifact (an SFT or GRPO stage with lora:, a convert)")}
    config_schema = MergeConfig
    version = 1

    def run(self, ctx: StageContext) -> dict[str, Any]:
        source = ctx.inputs["adapter"]
        if not self.carry_tokenizer(ctx, source.path):
            raise ConfigError(f"stage '{ctx.stage}': input adapter {source.path} has no {TOKENIZER_DIR}/")
        argv = [source.checkpoint_dir, ctx.checkpoint_dir]
        if ctx.config.step is not None:
            argv += ["--step", str(ctx.config.step)]
        result = self.launch_engine(ctx, *argv)
        return {key: result.get(key) for key in ("family", "rank", "adapter_step", "num_params")}
