"""The files of a Hugging Face model directory, without JAX: what a conversion reads
(`tasks/stages/convert.py` fingerprints a source while validating a pipeline) and what an export
replaces (`trainflow export --out` checks its target before any work)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.contract import TOKENIZER_DIR
from engine.data.tokenizer import load_saved
from engine.data.urls import is_url

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
"""An earlier model's weights: left beside new ones, transformers could load them instead
(it prefers model.safetensors to an index, and any safetensors to .bin)."""


def check_export_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Refuse to export into a non-empty `out_dir` unless `overwrite`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file, not a directory to export into")
    if not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ConfigError(
            f"{out_dir} is not empty; export into an empty directory, or pass --overwrite to replace the model there"
        )


def remove_stale_weights(out_dir: str | Path) -> list[str]:
    """Delete the weight files (WEIGHT_FILES) directly in `out_dir`; their names."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    stale = sorted({path for pattern in WEIGHT_FILES for path in out_dir.glob(pattern) if path.is_file()})
    for path in stale:
        path.unlink()
    return [path.name for path in stale]


def source_fingerprint(hf_dir: str | Path) -> dict[str, Any]:
    """What a conversion depends on, cheaply: sha256 of the small JSON files, size and
    modification time of the weights and tokenizer files (hashing GBs would take minutes)."""
    hf_dir = Path(hf_dir)
    out: dict[str, Any] = {}
    for path in sorted(hf_dir.iterdir()):
        if path.suffix == ".json" and path.stat().st_size < 10**7:
            out[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.suffix == ".safetensors" or path.name in TOKENIZER_FILES:
            out[path.name] = [path.stat().st_size, path.stat().st_mtime_ns]
    return out


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of `src` into `dst`; their names."""
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(src / name, dst / name)
    return names


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_beside(checkpoint_dir: Path) -> Path | None:
    """The `tokenizer/` next to a local checkpoint directory (an artifact's), if there is one."""
    if is_url(checkpoint_dir):
        return None
    here = Path(checkpoint_dir).parent / TOKENIZER_DIR
    return here if here.is_dir() else None


def tokenizer_token_ids(tokenizer_dir: str | Path) -> dict[str, int | None]:
    """A saved tokenizer's bos/eos/pad ids, under config.json's names."""
    bundle = load_saved(Path(tokenizer_dir))
    return dict(zip(TOKEN_ID_KEYS, (bundle.bos_id, bundle.eos_id, bundle.pad_id), strict=True))


def export_token_ids(source: dict | None, tokenizer_dir: str | Path | None) -> dict[str, int | None]:
    """bos/eos/pad ids for a causal LM export's config.json and generation_config.json. A
    checkpoint converted from Hugging Face keeps those its source wrote (`source`: its `hf`
    meta, even where they are null); one trained here from scratch has no source and takes its
    tokenizer's, so transformers' generate() stops at its eos."""
    if source is not None or tokenizer_dir is None:
        given = (source or {}).get("token_ids") or {}
        return {key: given.get(key) for key in TOKEN_ID_KEYS}
    return tokenizer_token_ids(tokenizer_dir)
