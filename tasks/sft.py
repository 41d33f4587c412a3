"""The sft stage: a checkpoint artifact and a JSONL file of examples in, a checkpoint artifact out.

    <out>/checkpoint/     Orbax checkpoints (engine.checkpoint.load_params), as pretrain writes
    <out>/tokenizer/      the input checkpoint's tokenizer, carried along
    <out>/sft.yaml        the resolved engine config the child ran
    <out>/metrics.jsonl   train and held-out metrics; <out>/tensorboard/

The engine runs in a child process (`python -m engine.sft <out>/sft.yaml`) started by the
stage's launcher; a re-run resumes from the latest checkpoint. The examples live outside
the store, so the artifact id covers their bytes: editing the data makes a new artifact.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, ClassVar

from engine.config import ConfigError, resolve_model_preset, to_yaml, validate
from engine.sft import SFTConfig
from tasks.artifacts import sha256_file
from tasks.pretrain import _get, _last_metrics
from tasks.registry import Input, StageContext, StageKind, has_input_ref

PIPELINE_OWNED = {
    "checkpoint.directory": "the artifact directory",
    "checkpoint.init_from": "input 'checkpoint'",
    "metrics_dir": "the artifact directory",
    "tokenizer": "input 'checkpoint' (its tokenizer/)",
}
NON_SEMANTIC = ("log_every", "progress", "metrics_dir", "checkpoint.async_save", "checkpoint.every_steps",
                "checkpoint.keep", *PIPELINE_OWNED)


def reject_pipeline_owned(raw: dict, source: str, owned: dict[str, str]) -> None:
    for key, owner in owned.items():
        if _get(raw, key) is not None:
            raise ConfigError(f"{source}: key '{key}' is set by the pipeline (from {owner}); remove it")


def file_digests(path: str | None) -> dict[str, str]:
    """sha256 of a data file, or of each *.jsonl file of a directory (by name)."""
    if not path or has_input_ref(path):  # inside an input artifact: its id covers the bytes
        return {}
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    return {f.name: sha256_file(f) for f in files}


def absolute_data_path(value: str | None, key: str, source: str) -> str | None:
    if value is None or has_input_ref(value):
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{source}: key '{key}': {value} does not exist")
    return str(path.absolute())


def launch_engine(ctx: StageContext, module: str, config_name: str, cfg, steps: int) -> dict[str, Any]:
    """Write the child's config, carry the tokenizer, run `python -m <module>`, return final metrics."""
    out = ctx.out_dir
    checkpoint_input = ctx.inputs["checkpoint"].path
    if (checkpoint_input / "tokenizer").is_dir():
        shutil.copytree(checkpoint_input / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    (out / config_name).write_text(to_yaml(cfg))
    if ctx.resumed:
        ctx.log(f"resuming from the checkpoints in {out / 'checkpoint'}")
    result = ctx.launch([sys.executable, "-m", module, str(out / config_name)],
                        metrics_file=out / "metrics.jsonl", total_steps=steps)
    metrics = result.result or _last_metrics(out / "metrics.jsonl")
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, type(None)))}


def owned_values(ctx: StageContext) -> dict[str, str]:
    out, checkpoint_input = ctx.out_dir, ctx.inputs["checkpoint"].path
    tokenizer = out / "tokenizer" if (checkpoint_input / "tokenizer").is_dir() else None
    if tokenizer is None:
        raise ConfigError(f"stage '{ctx.stage}': input checkpoint {checkpoint_input} has no tokenizer/")
    return {"checkpoint.directory": str(out / "checkpoint"), "checkpoint.init_from": str(checkpoint_input / "checkpoint"),
            "metrics_dir": str(out), "tokenizer": str(tokenizer)}


def with_owned(tree: dict, values: dict[str, str]) -> dict:
    for dotted, value in values.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    tree["progress"] = False  # progress reaches the pipeline log through metrics.jsonl
    return tree


class FineTuneStage(StageKind):
    """What the SFT and GRPO stages share: a checkpoint (and optionally a corpus) in, a
    checkpoint out, a JSONL `data.path`, and `python -m engine.<task>` in a child process."""

    output = "checkpoint"
    non_semantic = NON_SEMANTIC
    launches_child = True
    data_doc: ClassVar[str]
    """What data.path holds, for the error when it is missing."""

    @staticmethod
    def checkpoint_inputs(doc: str) -> dict[str, Input]:
        return {"checkpoint": Input("checkpoint", doc=doc),
                "corpus": Input("corpus", required=False, doc="files that data paths name as {input:corpus}/...")}

    def validate_raw(self, raw: dict, source: str):
        """The config validated, with data.path required; pipeline-owned keys refused."""
        reject_pipeline_owned(raw, source, PIPELINE_OWNED)
        resolve_model_preset(raw, source)
        cfg = validate(self.config_schema, raw, source)
        if not cfg.data.path:
            raise ConfigError(f"{source}: missing required key 'data.path' ({self.data_doc})")
        return cfg

    def fingerprint_without_paths(self, config, keys: tuple[str, ...]) -> dict:
        """The fingerprint less data paths outside the store: their files' bytes identify them
        (added by the caller), not where they lie. A path inside an input names which file."""
        fp = super().fingerprint(config)
        for key in keys:
            if not has_input_ref(fp["data"].get(key) or ""):
                fp["data"].pop(key, None)
        return fp

    def run(self, ctx: StageContext) -> dict[str, Any]:
        tree = with_owned(ctx.config.model_dump(mode="json"), owned_values(ctx))
        cfg = self.config_schema.model_validate(tree)
        return launch_engine(ctx, f"engine.{self.task}", f"{self.task}.yaml", cfg, cfg.steps)


class SFTStage(FineTuneStage):
    task = "sft"
    inputs = FineTuneStage.checkpoint_inputs("the model to fine-tune (params; a fresh optimizer) and its tokenizer/")
    config_schema = SFTConfig
    version = 1
    data_doc = "a JSONL file of examples"

    def resolve_config(self, raw: dict, source: str) -> SFTConfig:
        cfg = self.validate_raw(raw, source)
        data = cfg.data.model_copy(update={
            "path": absolute_data_path(cfg.data.path, "data.path", source),
            "eval_path": absolute_data_path(cfg.data.eval_path, "data.eval_path", source)})
        return cfg.model_copy(update={"data": data})

    def fingerprint(self, config: SFTConfig) -> dict:
        fp = self.fingerprint_without_paths(config, ("path", "eval_path"))
        return {**fp, "data_files": file_digests(config.data.path), "eval_files": file_digests(config.data.eval_path)}
