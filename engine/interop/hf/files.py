"""The files of a Hugging Face model directory that a conversion reads, without JAX:
`tasks/convert.py` fingerprints a source while validating a pipeline."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


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
