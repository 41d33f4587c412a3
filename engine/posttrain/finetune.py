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


def frozen_model_of_same_vocab(
    key: str,
    path: str,
    role: str,
    trained: ModelConfig,
    trained_role: str,
    trained_from: str | None,
    bundle: TokenizerBundle,
    why: str,
    *,
    tokenizer: str | None = None,
    tokenizer_key: str | None = None,
    trained_tokenizer: str | Path | None = None,
) -> tuple[ModelConfig, ComputeConfig]:
    """(ModelConfig, stored ComputeConfig) of a frozen second model read beside the trained one
    (DPO's reference, distillation's teacher), once it is known to score the same token ids:
    the same vocab_size and, where its tokenizer is found (`tokenizer`, else tokenizer/ beside
    the checkpoint), the same tokens and ids. Else one sentence naming `key` (`tokenizer_key`
    for the tokenizer, which is then required) and ending with `why`."""
    if not urls.exists(path) or not (urls.is_url(path) or Path(path).is_dir()):
        raise ConfigError(f"{key}: no checkpoint directory at {path}")
    model_cfg, stored_compute = stored_configs(path)
    if model_cfg.vocab_size != trained.vocab_size:
        raise ConfigError(
            f"{key}: the {role}'s vocab_size ({model_cfg.vocab_size}, {path}) differs from the {trained_role}'s "
            f"({trained.vocab_size}, {trained_from}); {why}"
        )
    where = tokenizer or urls.join(urls.parent(path), TOKENIZER_DIR)
    folder = urls.existing_folder(where)  # at a bucket URL: this host's cached copy
    if folder is None:
        if tokenizer_key:
            raise ConfigError(f"{tokenizer_key}: no tokenizer directory at {where}; set {tokenizer_key}")
        return model_cfg, stored_compute
    theirs = load_saved(folder).tokenizer.get_vocab(with_added_tokens=True)
    ours = bundle.tokenizer.get_vocab(with_added_tokens=True)
    changed = {t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t)}
    differ = sorted(changed, key=lambda t: ours[t] if t in ours else theirs[t])  # by id
    if differ:
        raise ConfigError(
            f"{tokenizer_key or key}: the {role}'s tokenizer ({folder}) is not the {trained_role}'s"
            + (f" ({trained_tokenizer})" if trained_tokenizer else "")
            + f": "
            f"{len(differ)} of {len(ours | theirs)} tokens differ (first {differ[0]!r}: id {ours.get(differ[0])} for "
            f"the {trained_role}, {theirs.get(differ[0])} for the {role}); {why}"
        )
    return model_cfg, stored_compute
