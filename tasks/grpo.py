"""The grpo stage (GRPO or GSPO): a checkpoint artifact and a JSONL file of prompts in, a
checkpoint artifact out.

    <out>/checkpoint/     Orbax checkpoints (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the input checkpoint's tokenizer, carried along
    <out>/grpo.yaml       the resolved engine config the child ran
    <out>/metrics.jsonl   per step: rewards per function, KL, clip ratios, lengths, timings

The engine runs in a child process (`python -m engine.posttrain.grpo <out>/grpo.yaml`); a re-run
resumes from the latest checkpoint. The artifact id covers the prompts' bytes and the
source of every user reward module (`module:function`), so editing either makes a new one.
"""

from __future__ import annotations

import importlib.util

from engine.config import ConfigError
from engine.posttrain.config import GRPOConfig
from engine.posttrain.rewards import BUILTIN
from tasks.artifacts import sha256_file
from tasks.engine_stage import FineTuneStage, absolute_data_path, file_digests


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


class GRPOStage(FineTuneStage):
    task = "grpo"
    entry_point = "grpo"
    inputs = FineTuneStage.checkpoint_inputs("the policy to start from (and the KL reference) and its tokenizer/")
    config_schema = GRPOConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture
    data_doc = "a JSONL file of prompts"

    def resolve_config(self, raw: dict, source: str) -> GRPOConfig:
        cfg = self.validate_raw(raw, source)
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
        fp = self.fingerprint_without_paths(config, ("path",))
        return {**fp, "prompt_files": file_digests(config.data.path), "reward_sources": reward_sources(config)}
