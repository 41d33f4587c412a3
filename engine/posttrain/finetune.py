"""What SFT and GRPO share before training: the model to start from, its tokenizer, JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.contract import TOKENIZER_DIR
from engine.data import urls
from engine.data.tokenizer import TokenizerBundle, load_saved
from engine.models.config import ComputeConfig, ModelConfig
from engine.train.checkpoint import stored_configs


def read_jsonl(path: str | Path) -> list[tuple[str, dict]]:
    """[(\"file:line\", record)] of a JSONL file or of a directory's *.jsonl files."""
    files: list[str | Path]
    if urls.is_url(path):  # at a bucket URL (a stage on a bucket store): a file or a folder's *.jsonl
        url = str(path).rstrip("/")
        # A folder's listing shows its files are there; a single file needs its own check.
        files = (
            list(urls.list_files(url, ".jsonl")) if not url.endswith(".jsonl") else [url] if urls.exists(url) else []
        )
        if not files:
            raise ConfigError(f"data: no JSONL examples at {url}")
    else:
        local = Path(path)
        files = list(sorted(local.glob("*.jsonl")) if local.is_dir() else [local])
        if not files or not all(Path(f).is_file() for f in files):
            raise ConfigError(f"data: no JSONL examples at {local}")
    records = []
    for file in files:
        for number, line in enumerate(urls.read_text(file).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}:{number}: not valid JSON: {e}") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{file}:{number}: expected a JSON object")
            records.append((f"{file}:{number}", record))
    return records


def resolve_model(cfg: Any) -> tuple[ModelConfig, ComputeConfig]:
    """The architecture stored with checkpoint.init_from (a config's `model` must equal it) and
    the run's compute settings (by default the ones the checkpoint was saved with)."""
    if not cfg.checkpoint.init_from:
        raise ConfigError("checkpoint.init_from is required: the checkpoint to fine-tune")
    stored, stored_compute = stored_configs(cfg.checkpoint.init_from)
    if cfg.model is not None and cfg.model != stored:
        raise ConfigError(f"model: differs from the architecture in {cfg.checkpoint.init_from}; omit `model`")
    return stored, cfg.compute or stored_compute


def tokenizer_dir(cfg: Any) -> Path:
    """The tokenizer's local directory: `tokenizer`, else the one beside checkpoint.init_from;
    at a bucket URL, this host's cached copy of it."""
    where = cfg.tokenizer or urls.join(urls.parent(cfg.checkpoint.init_from), TOKENIZER_DIR)
    path = urls.existing_folder(where)
    if path is None:
        raise ConfigError(f"tokenizer: no tokenizer directory at {where}; set `tokenizer`")
    return path


def finetune_start(cfg: Any) -> tuple[ModelConfig, ComputeConfig, TokenizerBundle]:
    """The model to fine-tune, how to compute with it, and its tokenizer, for an SFT or GRPO
    config: checks that checkpoint.directory is set and that the tokenizer fits the model."""
    if not cfg.checkpoint.directory:
        raise ConfigError("checkpoint.directory is required")
    model_cfg, compute = resolve_model(cfg)
    if getattr(cfg, "lora", None) is not None:
        try:
            cfg.lora.targets(model_cfg)
        except ValueError as e:
            raise ConfigError(f"lora.target_modules: {e}") from None
    bundle = load_saved(tokenizer_dir(cfg))
    if bundle.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer's vocabulary ({bundle.vocab_size}) is larger than the model's ({model_cfg.vocab_size})"
        )
    return model_cfg, compute, bundle
