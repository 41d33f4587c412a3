"""The tokenize stage: corpora in, a dataset artifact (token shards + tokenizer) out.

    <out>/data/          meta.json + {train,validation}/shard-NNNNN.array_record (engine.data)
    <out>/tokenizer/     Hugging Face tokenizer files
    <out>/tokenize.yaml  the resolved config the child ran

The engine runs in a child process (`python -m engine.data.tokenize <out>/tokenize.yaml <out>`)
whose worker threads encode the tasks. Re-run on the same directory, it redoes only the shards
that were not finished.

The artifact id covers the corpus too: every input file's size and mtime (and a loaded
tokenizer's bytes), as engine.data.tokenize fingerprints them, so editing the corpus makes a new
dataset rather than silently reusing the old one. Files inside input artifacts enter by
their place in the store (the input's id covers their bytes), so a copied store resumes.

A finished dataset found without a complete manifest (the manifest was lost, or the run was
killed while hashing) is made again: nothing recorded its shards' digests, so nothing could
show that they are the ones the engine wrote.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import yaml
from pydantic import BaseModel

from engine.config import ConfigError, validate
from engine.contract import DATA_DIR, MANIFEST, TOKENIZE_NON_SEMANTIC_FIELDS
from engine.data.sources import plan_source
from engine.data.tokenize import MB, TokenizeConfig, fingerprint
from tasks.registry import Input, StageContext, StageKind, has_input_ref
from tasks.store.records import LOCK

_PROGRESS = re.compile(r"tokenize: (\d+)/(\d+) shards")


def _input_parts(cfg: TokenizeConfig) -> list:
    target = max(int(cfg.shard_size_mb * MB), 1)
    # A source inside an input artifact (`{input:corpus}/...`) does not exist before the
    # pipeline runs; the input's artifact id identifies its content instead.
    return [
        part for i, src in enumerate(cfg.sources) if not has_input_ref(src.path) for part in plan_source(i, src, target)
    ]


class TokenizeStage(StageKind):
    task = "tokenize"
    entry_point = "engine.data.tokenize"
    output = "dataset"
    inputs = {
        "corpus": Input(
            "corpus", required=False, doc="files that sources name as {input:corpus}/...", through_paths=True
        )
    }
    config_schema = TokenizeConfig
    version = 1
    non_semantic = TOKENIZE_NON_SEMANTIC_FIELDS

    def resolve_config(self, raw: dict, source: str) -> TokenizeConfig:
        cfg = validate(TokenizeConfig, raw, source)
        try:  # the sources must exist and parse before anything runs
            self._planned = (cfg, _input_parts(cfg))  # reused by fingerprint()
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        return cfg

    def fingerprint(self, config: BaseModel) -> dict:
        assert isinstance(config, TokenizeConfig)
        planned = getattr(self, "_planned", None)
        parts = planned[1] if planned and planned[0] is config else _input_parts(config)
        return {**super().fingerprint(config), "corpus": fingerprint(config, parts)}

    def run(self, ctx: StageContext) -> dict:
        out = ctx.out_dir
        if ctx.resumed and (out / DATA_DIR / "meta.json").is_file():
            ctx.log(
                f"{out} holds a finished dataset without a complete manifest: its shards cannot be "
                "verified, so it is made again"
            )
            for path in out.iterdir():
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.name not in (MANIFEST, LOCK):
                    path.unlink()
        # Only the keys that were set: defaults stay defaults when the child re-validates.
        (out / "tokenize.yaml").write_text(
            yaml.safe_dump(ctx.config.model_dump(mode="json", exclude_unset=True), sort_keys=False)
        )

        def on_line(line: str) -> None:
            match = _PROGRESS.search(line)
            if match:
                ctx.hooks.progress(int(match.group(1)) / max(int(match.group(2)), 1))

        ctx.launch([sys.executable, "-m", self.entry_point, str(out / "tokenize.yaml"), str(out)], on_line=on_line)
        meta = json.loads((out / DATA_DIR / "meta.json").read_text())
        stats = meta.get("stats", {})
        metrics = {key: stats[key] for key in ("documents", "tokens", "bytes") if key in stats}
        metrics["vocab_size"] = meta["vocab_size"]
        for split, info in meta["splits"].items():
            metrics[f"{split}_tokens"] = info.get("tokens")
        return metrics
