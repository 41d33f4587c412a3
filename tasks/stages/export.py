"""The export stage: a checkpoint artifact in, a Hugging Face model directory out.

    <out>/hf/   config.json, generation_config.json, model.safetensors (or
                model-0000i-of-0000n.safetensors + model.safetensors.index.json past
                max_shard_gb) and the checkpoint's tokenizer files:
                transformers.AutoModelForCausalLM.from_pretrained("<out>/hf") loads it; a
                reward_model artifact is written as its family's *ForSequenceClassification
                (AutoModelForSequenceClassification, one label, score.weight the head)

The engine runs in a child process (`python -m engine.interop.hf export`). The checkpoint's model
config must be expressible in its family's transformers class (e.g. a `llama` with
qk_norm is not); the error names the field. `trainflow export --out` copies <out>/hf to a
directory or a folder in a bucket (`check_export_target`, `copy_export`).
"""

from __future__ import annotations

import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from pydantic import Field

from engine.config import ConfigError, Strict
from engine.contract import MANIFEST, TOKENIZER_DIR
from engine.interop.hf.files import WEIGHT_FILES, check_export_dir, remove_stale_weights
from tasks.engine_stage import EngineStage
from tasks.registry import MODEL_KINDS, Input, StageContext
from tasks.stages.reward_model import REWARD_MODEL
from tasks.store.objects import StoreAccessError, list_url, remove_url_files, upload_dir
from tasks.store.urls import is_url


class ExportConfig(Strict):
    """Write a checkpoint as a Hugging Face model directory."""

    step: int | None = Field(None, ge=0)
    """Checkpoint step to export (None: the latest)."""
    max_shard_gb: float = Field(5.0, gt=0)
    """Largest safetensors shard, in GB (10^9 bytes)."""
    merged: bool = False
    """An adapter input: write the whole model with the adapter folded in; False writes
    PEFT's adapter format (adapter_config.json + adapter_model.safetensors)."""


class ExportStage(EngineStage):
    task = "export"
    entry_point = "engine.interop.hf"
    output = "hf_model"
    inputs = {
        "checkpoint": Input(
            (*MODEL_KINDS, REWARD_MODEL),
            doc="a checkpoint, adapter or reward_model artifact (convert, pretrain, SFT, ...)",
        )
    }
    config_schema = ExportConfig
    version = 2  # 2: one shard is model.safetensors; config.json has every key transformers 5 writes

    def run(self, ctx: StageContext) -> dict[str, Any]:
        source = ctx.inputs["checkpoint"].path
        # --overwrite: <out>/hf is this artifact's own; what is there is an earlier attempt's.
        argv = [
            "export",
            ctx.inputs["checkpoint"].checkpoint_dir,
            str(ctx.out_dir / "hf"),
            "--max-shard-gb",
            str(ctx.config.max_shard_gb),
            "--overwrite",
        ]
        if ctx.config.step is not None:
            argv += ["--step", str(ctx.config.step)]
        if ctx.config.merged:
            argv.append("--merged")
        if (source / TOKENIZER_DIR).is_dir():
            argv += ["--tokenizer", str(source / TOKENIZER_DIR)]
        result = self.launch_engine(ctx, *argv)
        return {key: result.get(key) for key in ("architecture", "step", "bytes", "shards", "seconds")}


def check_export_target(out: str, overwrite: bool) -> None:
    """Refuse a non-empty target unless `overwrite`: a directory, or a folder in a bucket; and
    a directory inside an artifact (`..` and symlinks resolved), whose files its manifest lists."""
    if not is_url(out):
        target = Path(out).expanduser().resolve()
        inside = next((d for d in (target, *target.parents) if (d / MANIFEST).is_file()), None)
        if inside is not None:
            raise ConfigError(f"{out} lies inside the artifact {inside}; export into a directory outside any artifact")
        return check_export_dir(out, overwrite)
    try:
        present = list_url(out)
    except StoreAccessError as e:
        raise ConfigError(str(e)) from None
    if present and not overwrite:
        raise ConfigError(
            f"{out} is not empty; export into an empty folder, or pass --overwrite to replace the model there"
        )


def copy_export(hf_dir: Path, out: str) -> None:
    """Copy an export's Hugging Face directory to `out`, first deleting the weights an earlier
    model left there (they could shadow the new ones)."""
    if not is_url(out):
        remove_stale_weights(out)
        shutil.copytree(hf_dir, out, dirs_exist_ok=True)
        return
    remove_url_files(out, [name for name in list_url(out) if any(fnmatch(name, p) for p in WEIGHT_FILES)])
    upload_dir(hf_dir, out)
