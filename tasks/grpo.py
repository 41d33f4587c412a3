"""The grpo stage (GRPO or GSPO): a checkpoint artifact and a JSONL file of prompts in, a
checkpoint artifact out.

    <out>/checkpoint/     Orbax checkpoints (engine.checkpoint.load_params)
    <out>/tokenizer/      the input checkpoint's tokenizer, carried along
    <out>/grpo.yaml       the resolved engine config the child ran
    <out>/metrics.jsonl   per step: rewards per function, KL, clip ratios, lengths, timings

The engine runs in a child process (`python -m engine.grpo <out>/grpo.yaml`); a re-run
resumes from the latest checkpoint. The artifact id covers the prompts' bytes and the
source of every user reward module (`module:function`), so editing either makes a new one.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from engine.config import ConfigError, resolve_model_preset, validate
from engine.grpo import GRPOConfig
from engine.rewards import BUILTIN
from tasks.artifacts import sha256_file
from tasks.registry import Input, StageContext, StageKind, has_input_ref
from tasks.sft import (NON_SEMANTIC, PIPELINE_OWNED, absolute_data_path, file_digests, launch_engine, owned_values,
                       reject_pipeline_owned, with_owned)


def reward_sources(cfg: GRPOConfig) -> dict[str, str | None]:
    """sha256 of each user reward module's source file (found without importing it)."""
    digests = {}
    for spec in cfg.rewards:
        if spec.function in BUILTIN:
            continue
        module = spec.function.partition(":")[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        origin = getattr(found, "origin", None)
        digests[module] = sha256_file(origin) if origin and origin.endswith(".py") else None
    return digests


class GRPOStage(StageKind):
    task = "grpo"
    output = "checkpoint"
    inputs = {"checkpoint": Input("checkpoint", doc="the policy to start from (and the KL reference) and its "
                                                    "tokenizer/"),
              "corpus": Input("corpus", required=False, doc="files that data paths name as {input:corpus}/...")}
    config_schema = GRPOConfig
    version = 1
    non_semantic = NON_SEMANTIC
    launches_child = True

    def resolve_config(self, raw: dict, source: str) -> GRPOConfig:
        reject_pipeline_owned(raw, source, PIPELINE_OWNED)
        resolve_model_preset(raw, source)
        cfg = validate(GRPOConfig, raw, source)
        if not cfg.data.path:
            raise ConfigError(f"{source}: missing required key 'data.path' (a JSONL file of prompts)")
        for i, spec in enumerate(cfg.rewards):  # a misspelt reward fails validation, not the run
            module, sep, name = spec.function.partition(":")
            if spec.function in BUILTIN:
                continue
            if not sep or not module or not name:
                raise ConfigError(f"{source}: key 'rewards.{i}.function': '{spec.function}' is neither a built-in "
                                  f"({', '.join(BUILTIN)}) nor of the form module:function")
            if reward_sources(cfg.model_copy(update={"rewards": [spec]})).get(module) is None:
                raise ConfigError(f"{source}: key 'rewards.{i}.function': cannot find module '{module}' "
                                  "(run from its directory or add it to PYTHONPATH)")
        data = cfg.data.model_copy(update={"path": absolute_data_path(cfg.data.path, "data.path", source)})
        return cfg.model_copy(update={"data": data})

    def fingerprint(self, config: GRPOConfig) -> dict:
        fp = super().fingerprint(config)
        if not has_input_ref(fp["data"].get("path") or ""):  # inside an input: the path names which file
            fp["data"].pop("path", None)
        return {**fp, "prompt_files": file_digests(config.data.path), "reward_sources": reward_sources(config)}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        tree = with_owned(ctx.config.model_dump(mode="json"), owned_values(ctx))
        cfg = GRPOConfig.model_validate(tree)
        return launch_engine(ctx, "engine.grpo", "grpo.yaml", cfg, cfg.steps)
