"""The export stage: a checkpoint artifact in, a Hugging Face model directory out.

    <out>/hf/   config.json, generation_config.json, model.safetensors (or
                model-0000i-of-0000n.safetensors + model.safetensors.index.json past
                max_shard_gb) and the checkpoint's tokenizer files:
                transformers.AutoModelForCausalLM.from_pretrained("<out>/hf") loads it

The engine runs in a child process (`python -m engine.interop.hf export`). The checkpoint's model
config must be expressible in its family's transformers class (e.g. a `llama` with
qk_norm is not); the error names the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.config import Strict
from engine.contract import CHECKPOINT_DIR, TOKENIZER_DIR
from tasks.engine_stage import EngineStage
from tasks.registry import Input, StageContext


class ExportConfig(Strict):
    """Write a checkpoint as a Hugging Face model directory."""

    step: int | None = Field(None, ge=0)
    """Checkpoint step to export (None: the latest)."""
    max_shard_gb: float = Field(5.0, gt=0)
    """Largest safetensors shard, in GB (10^9 bytes)."""


class ExportStage(EngineStage):
    task = "export"
    entry_point = "hf"
    output = "hf_model"
    inputs = {"checkpoint": Input("checkpoint", doc="a checkpoint artifact (convert, pretrain, SFT, ...)")}
    config_schema = ExportConfig
    version = 2  # 2: one shard is model.safetensors; config.json has every key transformers 5 writes

    def run(self, ctx: StageContext) -> dict[str, Any]:
        source = ctx.inputs["checkpoint"].path
        # --overwrite: <out>/hf is this artifact's own; what is there is an earlier attempt's.
        argv = ["export", str(source / CHECKPOINT_DIR), str(ctx.out_dir / "hf"), "--max-shard-gb",
                str(ctx.config.max_shard_gb), "--overwrite"]
        if ctx.config.step is not None:
            argv += ["--step", str(ctx.config.step)]
        if (source / TOKENIZER_DIR).is_dir():
            argv += ["--tokenizer", str(source / TOKENIZER_DIR)]
        result = self.launch_engine(ctx, *argv)
        return {key: result.get(key) for key in ("architecture", "step", "bytes", "shards", "seconds")}
