"""The convert stage: a Hugging Face model directory in, a checkpoint artifact out.

    <out>/checkpoint/   Orbax CheckpointManager directory, step 0, params + meta only
                        (engine.train.checkpoint.load_params; a pretrain/SFT stage's `init` input)
    <out>/tokenizer/    the source's tokenizer files
    <out>/model.yaml    the engine ModelConfig the weights were converted to

The engine runs in a child process (`python -m engine.interop.hf convert SOURCE <out>`). The
source is outside the store, so the artifact id covers its files (engine.interop.hf.files):
replacing the weights makes a new artifact rather than silently reusing the old one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml

from engine.config import ConfigError, Strict, validate
from engine.interop.hf.files import source_fingerprint
from engine.interop.hf.mapping import model_config_from_hf
from tasks.engine_stage import EngineStage
from tasks.registry import StageContext


class ConvertConfig(Strict):
    """Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 1/2/3) for the engine."""

    source: str
    """A Hugging Face model directory: config.json, model.safetensors or a sharded
    model.safetensors.index.json, and usually tokenizer files."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """Stored parameter dtype. None keeps the source's: bfloat16 stays, others become float32."""


class ConvertStage(EngineStage):
    task = "convert"
    entry_point = "hf"
    output = "checkpoint"
    inputs = {}
    config_schema = ConvertConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture

    def resolve_config(self, raw: dict, source: str) -> ConvertConfig:
        cfg = validate(ConvertConfig, raw, source)
        config_path = Path(cfg.source).expanduser() / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{source}: key 'source': {cfg.source} is not a Hugging Face model directory "
                              f"(no config.json)")
        try:  # an unsupported architecture fails here, before anything runs
            model_config_from_hf(json.loads(config_path.read_text()), where=str(config_path))
        except (ConfigError, json.JSONDecodeError) as e:
            raise ConfigError(f"{source}: key 'source': {e}") from None
        return cfg.model_copy(update={"source": str(Path(cfg.source).expanduser().absolute())})

    def fingerprint(self, config: ConvertConfig) -> dict:
        # The source's files, not its path: the same weights elsewhere are the same artifact.
        return {"dtype": config.dtype, "source_files": source_fingerprint(config.source)}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        cfg, out = ctx.config, ctx.out_dir
        argv = ["convert", cfg.source, str(out)]
        if cfg.dtype:
            argv += ["--dtype", cfg.dtype]
        result = self.launch_engine(ctx, *argv)
        if "model" in result:
            (out / "model.yaml").write_text(yaml.safe_dump(result["model"], sort_keys=False))
        seconds = result.get("seconds") or float("nan")
        return {
            "architecture": result.get("architecture"), "num_params": result.get("num_params"),
            "source_bytes": result.get("source_bytes"), "dtype": result.get("dtype"), "seconds": seconds,
            "gb_per_second": (result.get("source_bytes") or 0) / 1e9 / seconds,
        }
