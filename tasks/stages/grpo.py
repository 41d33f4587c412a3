"""The grpo stage (GRPO or GSPO): a checkpoint artifact and a JSONL file of prompts in, a
checkpoint artifact out.

    <out>/checkpoint/     Orbax checkpoints (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the input checkpoint's tokenizer, carried along
    <out>/grpo.yaml       the resolved engine config the child ran
    <out>/metrics.jsonl   per step: rewards per function, KL, clip ratios, lengths, timings

The engine runs in a child process (`python -m engine.posttrain.grpo <out>/grpo.yaml`); a re-run
resumes from the latest checkpoint. The artifact id covers the prompts' bytes and the
source of every user reward module (`module:function`), so editing either makes a new one.

A reward model scores completions with `rewards: [{model: rm, weight: 1.0}]`, where `rm` is
an input of the stage (any name besides checkpoint and corpus: a reward_model artifact,
its own lineage edge); its tokenizer must be the policy's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.config import ConfigError
from engine.posttrain import openenv_env, procedural_tasks
from engine.posttrain.config import GRPOConfig
from engine.posttrain.environments import BUILTIN_ENVIRONMENTS
from engine.posttrain.registry import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from engine.posttrain.rewards import BUILTIN
from tasks.engine_stage import FineTuneStage
from tasks.registry import Input, StageContext
from tasks.stages.reward_model import REWARD_MODEL
from tasks.store.consume import sha256_file
from tasks.store.records import code_version


def module_digest(module: str) -> str | None:
    """sha256 of a user module's source file (found without importing it); None if not found."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    return sha256_file(origin) if origin and origin.endswith(".py") else None


def reward_sources(cfg: GRPOConfig) -> dict[str, str | None]:
    """sha256 of each user reward module's source file."""
    digests = {}
    for spec in cfg.rewards:
        if spec.function is None or spec.function in BUILTIN:  # a reward model's bytes: its input's id
            continue
        module = spec.function.partition(":")[0]
        digests[module] = module_digest(module)
    return digests


OBJECTIVE_KEYS = {
    "loss_type": POLICY_LOSSES,
    "loss_aggregation": LOSS_AGGREGATIONS,
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "rollout_correction.mode": ROLLOUT_CORRECTIONS,
}


def objective_value(cfg: GRPOConfig, key: str) -> str | None:
    """The config's value at a dotted key of OBJECTIVE_KEYS (None where a section is unset)."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part) if value is not None else None
    return value


def objective_sources(cfg: GRPOConfig) -> dict[str, str | None]:
    """sha256 of the user modules that a module:function loss, aggregation, advantage estimator
    or rollout correction names (registered built-ins are the package's code)."""
    digests = {}
    for key, registry in OBJECTIVE_KEYS.items():
        value = objective_value(cfg, key)
        if value is not None and value not in registry.names():
            module = value.partition(":")[0]
            digests[module] = module_digest(module)
    return digests


def environment_module(cfg: GRPOConfig) -> str | None:
    """The user module a `module:Class` environment names (None: none, or a built-in)."""
    if cfg.environment is None or cfg.environment.factory in BUILTIN_ENVIRONMENTS:
        return None
    return cfg.environment.factory.partition(":")[0]


ENVIRONMENT_LIBRARIES = (procedural_tasks.PACKAGE, openenv_env.PACKAGE)
"""Third-party environment libraries: their installed version is part of a run's id."""


def environment_records(cfg: GRPOConfig) -> list[dict]:
    """Each environment the run uses, for its manifest: its name, version and config (a library's
    installed version; a built-in's, trainflow's; a user module's, its source's sha256)."""
    records = []
    if cfg.data.reasoning_gym is not None:
        records.append(
            {
                "name": procedural_tasks.PACKAGE,
                "version": procedural_tasks.package_version(),
                "config": cfg.data.reasoning_gym.model_dump(mode="json"),
            }
        )
    environment = cfg.environment
    if environment is not None:
        module = environment_module(cfg)
        if environment.factory == "openenv":
            name, version = openenv_env.PACKAGE, openenv_env.package_version()
        elif module is None:  # a built-in: trainflow's own code
            name, version = environment.factory, code_version()["version"]
        else:
            name, version = environment.factory, f"sha256:{module_digest(module)}"
        records.append({"name": name, "version": version, "config": environment.model_dump(mode="json")})
    return records


def environment_versions(cfg: GRPOConfig) -> dict[str, str | None]:
    """{library: version} of the third-party environment libraries a run uses (part of its id)."""
    return {r["name"]: r["version"] for r in environment_records(cfg) if r["name"] in ENVIRONMENT_LIBRARIES}


ROLLOUT_SERVER_ENTRY_POINT = "engine.posttrain.vllm_rollout"
"""GRPO with `rollout:`: the entry point whose sampler is a vLLM server."""


class GRPOStage(FineTuneStage):
    task = "grpo"
    entry_point = "engine.posttrain.grpo"
    planner = "engine.posttrain.grpo:step_spec"
    inputs = FineTuneStage.checkpoint_inputs("the policy to start from (and the KL reference) and its tokenizer/")
    other_inputs = Input(REWARD_MODEL, doc="a reward model that `rewards: [{model: <this input>}]` scores with")
    config_schema = GRPOConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture
    data_doc = "a JSONL file of prompts, or data.reasoning_gym"
    data_files = {"data.path": "prompt_files"}
    console_metrics = ("reward", "reward_std", "completion_length", "kl", "entropy")

    def has_data(self, cfg) -> bool:
        return bool(cfg.data.path) or cfg.data.reasoning_gym is not None

    def entry_module(self, ctx: StageContext) -> str:
        """With `rollout:` GRPO's entry point whose sampler is the server (it writes the weights
        with the HF exporter, engine/posttrain/vllm_rollout.py)."""
        return ROLLOUT_SERVER_ENTRY_POINT if ctx.config.rollout is not None else super().entry_module(ctx)

    def resolve_config(self, raw: dict, source: str) -> GRPOConfig:
        cfg = super().resolve_config(raw, source)
        for i, spec in enumerate(cfg.rewards):  # a misspelt reward fails validation, not the run
            if spec.function is None or spec.function in BUILTIN:
                continue
            module, sep, name = spec.function.partition(":")
            if not sep or not module or not name:
                raise ConfigError(
                    f"{source}: key 'rewards.{i}.function': '{spec.function}' is neither a built-in "
                    f"({', '.join(BUILTIN)}) nor of the form module:function"
                )
            if reward_sources(cfg.model_copy(update={"rewards": [spec]})).get(module) is None:
                raise ConfigError(
                    f"{source}: key 'rewards.{i}.function': cannot find module '{module}' "
                    "(run from its directory or add it to PYTHONPATH)"
                )
        for key in OBJECTIVE_KEYS:  # a misspelt user module fails validation too
            value = objective_value(cfg, key)
            if value is not None and value not in OBJECTIVE_KEYS[key].names():
                module = value.partition(":")[0]
                if module_digest(module) is None:
                    raise ConfigError(
                        f"{source}: key '{key}': cannot find module '{module}' of '{value}' "
                        "(run from its directory or add it to PYTHONPATH)"
                    )
        if cfg.data.reasoning_gym is not None and procedural_tasks.package_version() is None:
            raise ConfigError(
                f"{source}: key 'data.reasoning_gym': needs the {procedural_tasks.PACKAGE} package "
                f"({procedural_tasks.INSTALL})"
            )
        if cfg.environment is not None and cfg.environment.factory == "openenv":
            if openenv_env.package_version() is None:
                raise ConfigError(
                    f"{source}: key 'environment.factory': openenv needs the {openenv_env.PACKAGE} package "
                    f"({openenv_env.INSTALL})"
                )
            try:
                openenv_env.OpenEnvConfig.model_validate(cfg.environment.kwargs)
            except ValidationError as e:
                first = e.errors()[0]
                key = ".".join(str(part) for part in ("environment.kwargs", *first["loc"]))
                raise ConfigError(f"{source}: key '{key}': {first['msg'].removeprefix('Value error, ')}") from None
        module = environment_module(cfg)
        if module is not None and module_digest(module) is None:  # a misspelt environment fails here too
            raise ConfigError(
                f"{source}: key 'environment.factory': cannot find module '{module}' of "
                f"'{cfg.environment.factory}' (run from its directory or add it to PYTHONPATH)"
            )
        return cfg

    def fingerprint(self, config: BaseModel) -> dict:
        assert isinstance(config, GRPOConfig)
        fp = {**super().fingerprint(config), "reward_sources": reward_sources(config)}
        objective = objective_sources(config)
        fp = {**fp, "objective_sources": objective} if objective else fp  # absent: the ids made before
        versions = environment_versions(config)  # another version may generate or score otherwise
        fp = {**fp, "environment_versions": versions} if versions else fp
        module = environment_module(config)  # a user environment's code is part of the result
        return {**fp, "environment_source": module_digest(module)} if module else fp

    def run(self, ctx: StageContext) -> dict:
        """Each `rewards[i].model` names an input (a reward_model artifact): the engine gets its
        checkpoint directory, and the term is named after the input unless it has a name."""
        rewards = []
        for i, spec in enumerate(ctx.config.rewards):
            if spec.model is not None:
                if spec.model not in ctx.inputs or ctx.inputs[spec.model].kind != REWARD_MODEL:
                    raise ConfigError(
                        f"stage '{ctx.stage}': rewards.{i}.model '{spec.model}' must name an input of "
                        f"the stage that is a reward_model artifact (its inputs: {', '.join(ctx.inputs)})"
                    )
                spec = spec.model_copy(
                    update={"model": ctx.inputs[spec.model].checkpoint_dir, "name": spec.name or spec.model}
                )
            rewards.append(spec)
        metrics = super().run(replace(ctx, config=ctx.config.model_copy(update={"rewards": rewards})))
        environments = environment_records(ctx.config)
        if environments:  # the manifest names each environment library, its version and config
            metrics["environments"] = environments
        if "env/tool_sandbox_weaker" in metrics:  # the manifest says in words how tool code was isolated
            weaker = metrics["env/tool_sandbox_weaker"]
            metrics["tool_sandbox"] = "namespaces (weaker, opted in)" if weaker else "bubblewrap"
        return metrics
