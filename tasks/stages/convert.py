"""The convert stage: a Hugging Face model directory in, a checkpoint artifact out (a
*ForSequenceClassification with one label: a reward_model artifact, the same layout).

    <out>/checkpoint/   Orbax CheckpointManager directory, step 0, params + meta only
                        (engine.train.checkpoint.load_params; a pretrain/SFT stage's `init` input)
    <out>/tokenizer/    the source's tokenizer files
    <out>/model.yaml    the engine ModelConfig the weights were converted to

The engine runs in a child process (`python -m engine.interop.hf convert SOURCE <out>`). The
source is outside the store, so the artifact id covers its files (engine.interop.hf.files):
replacing the weights makes a new artifact rather than silently reusing the old one.

A source may be a folder in a bucket (`s3://bucket/models/llama`, `gs://...`). Its config.json
is read there while validating; the id covers the JSON files' sha256 and the other files'
size and object version (ETag, generation), so nothing large is read before the stage runs.
The stage then downloads the folder into the local cache, converts it, and deletes the copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from engine.config import ConfigError, Strict, validate
from engine.interop.hf.files import TOKENIZER_FILES, source_fingerprint
from engine.interop.hf.mapping import causal_view, is_sequence_classification, model_config_from_hf
from engine.interop.hf.peft import ADAPTER_CONFIG, lora_config_from_peft
from tasks.engine_stage import EngineStage
from tasks.registry import MODEL_KINDS, Input, StageContext
from tasks.stages.reward_model import REWARD_MODEL
from tasks.store.objects import StoreAccessError, download_dir, list_url, read_url, url_cache
from tasks.store.urls import is_url


class ConvertConfig(Strict):
    """Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 1/2/3) for the engine."""

    source: str
    """A Hugging Face model directory: config.json, model.safetensors or a sharded
    model.safetensors.index.json, and usually tokenizer files. A local path, or a folder in a
    bucket (s3://bucket/prefix, gs://bucket/prefix)."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """Stored parameter dtype. None keeps the source's: bfloat16 stays, others become float32."""


def is_peft_adapter(source: str) -> bool:
    """A local PEFT adapter directory (adapter_config.json), not a model."""
    return not is_url(source) and (Path(source).expanduser() / ADAPTER_CONFIG).is_file()


class ConvertStage(EngineStage):
    task = "convert"
    entry_point = "engine.interop.hf"
    output = "checkpoint"
    possible_outputs = ("adapter", REWARD_MODEL)
    inputs = {
        "base": Input(MODEL_KINDS, required=False, doc="a PEFT adapter source's base model (the checkpoint it adapts)")
    }
    config_schema = ConvertConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture

    def output_kind(self, config: BaseModel) -> str:
        assert isinstance(config, ConvertConfig)
        if is_peft_adapter(config.source):
            return "adapter"
        return REWARD_MODEL if is_reward_model_source(config.source) else "checkpoint"

    def resolve_config(self, raw: dict, source: str) -> ConvertConfig:
        cfg = validate(ConvertConfig, raw, source)
        if is_url(cfg.source):
            return self._resolve_url(cfg, source)
        if is_peft_adapter(cfg.source):  # a LoRA adapter; its base comes as input `base`
            try:
                lora_config_from_peft(Path(cfg.source).expanduser())
            except ConfigError as e:
                raise ConfigError(f"{source}: key 'source': {e}") from None
            return cfg.model_copy(update={"source": str(Path(cfg.source).expanduser().resolve())})
        config_path = Path(cfg.source).expanduser() / "config.json"
        if not config_path.is_file():
            raise ConfigError(
                f"{source}: key 'source': {cfg.source} is not a Hugging Face model directory (no config.json)"
            )
        try:  # an unsupported architecture fails here, before anything runs
            model_config_from_hf(causal_view(json.loads(config_path.read_text())), where=str(config_path))
        except (ConfigError, json.JSONDecodeError) as e:
            raise ConfigError(f"{source}: key 'source': {e}") from None
        return cfg.model_copy(update={"source": str(Path(cfg.source).expanduser().resolve())})

    @staticmethod
    def _resolve_url(cfg: ConvertConfig, source: str) -> ConvertConfig:
        url = cfg.source.rstrip("/")
        try:
            files = list_url(url)
            text = read_url(f"{url}/config.json") if "config.json" in files else None
        except StoreAccessError as e:
            raise ConfigError(f"{source}: key 'source': {e}") from None
        if text is None:
            raise ConfigError(f"{source}: key 'source': {url} is not a Hugging Face model directory (no config.json)")
        try:
            model_config_from_hf(causal_view(json.loads(text)), where=f"{url}/config.json")
        except (ConfigError, json.JSONDecodeError) as e:
            raise ConfigError(f"{source}: key 'source': {e}") from None
        return cfg.model_copy(update={"source": url})

    def fingerprint(self, config: BaseModel) -> dict:
        assert isinstance(config, ConvertConfig)
        # The source's files, not its path: the same weights elsewhere are the same artifact.
        files = url_fingerprint(config.source) if is_url(config.source) else source_fingerprint(config.source)
        return {"dtype": config.dtype, "source_files": files}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        cfg, out = ctx.config, ctx.out_dir
        if is_peft_adapter(cfg.source):
            return self._run_adapter(ctx)
        if "base" in ctx.inputs:
            raise ConfigError(
                f"stage '{ctx.stage}': input 'base' is only for a PEFT adapter source; {cfg.source} is a whole model"
            )
        local = url_cache(cfg.source) / "hf" if is_url(cfg.source) else None
        if local is not None:
            ctx.log(f"downloading {cfg.source} into {local}")
            download_dir(cfg.source, local)
        argv = ["convert", str(local or cfg.source), str(out), "--checkpoint", ctx.checkpoint_dir]
        if cfg.dtype:
            argv += ["--dtype", cfg.dtype]
        try:
            result = self.launch_engine(ctx, *argv)
        finally:
            if local is not None:  # the cache keeps no copy of a source: it is read once
                shutil.rmtree(local, ignore_errors=True)
        if "model" in result:
            (out / "model.yaml").write_text(yaml.safe_dump(result["model"], sort_keys=False))
        seconds = result.get("seconds") or float("nan")
        return {
            "architecture": result.get("architecture"),
            "num_params": result.get("num_params"),
            "source_bytes": result.get("source_bytes"),
            "dtype": result.get("dtype"),
            "seconds": seconds,
            "gb_per_second": (result.get("source_bytes") or 0) / 1e9 / seconds,
        }

    def _run_adapter(self, ctx: StageContext) -> dict[str, Any]:
        if "base" not in ctx.inputs:
            raise ConfigError(
                f"stage '{ctx.stage}': {ctx.config.source} is a PEFT adapter: give the model it adapts "
                "as input 'base' (a checkpoint artifact, e.g. the convert of its base model)"
            )
        base = ctx.inputs["base"]
        self.carry_tokenizer(ctx, base.path)
        # The base's checkpoint where the engine reads it: at the bucket's URL, or in the store.
        result = self.launch_engine(
            ctx, "convert-adapter", ctx.config.source, str(ctx.out_dir), "--base", base.checkpoint_dir
        )
        return {key: result.get(key) for key in ("architecture", "family", "rank")}


def is_reward_model_source(source: str) -> bool:
    """A *ForSequenceClassification directory (local or in a bucket): it converts to a reward model."""
    try:
        text = (
            read_url(f"{source.rstrip('/')}/config.json")
            if is_url(source)
            else ((Path(source).expanduser() / "config.json").read_text())
        )
        return is_sequence_classification(json.loads(text))
    except (OSError, StoreAccessError, json.JSONDecodeError, TypeError):
        return False


def url_fingerprint(url: str) -> dict[str, Any]:
    """source_fingerprint for a folder in a bucket: sha256 of the small JSON files, size and
    object version (ETag or generation) of the weights and tokenizer files."""
    out: dict[str, Any] = {}
    for name, info in sorted(list_url(url).items()):
        if name.endswith(".json") and info["size"] < 10**7:
            out[name] = hashlib.sha256(read_url(f"{url}/{name}")).hexdigest()
        elif name.endswith(".safetensors") or name in TOKENIZER_FILES:
            out[name] = [info["size"], info["version"]]
    return out
