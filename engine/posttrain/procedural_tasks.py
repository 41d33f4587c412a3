"""reasoning-gym's procedural tasks as GRPO prompts, scored by reasoning-gym's own scorers.

    data:
      reasoning_gym: {dataset: leg_counting, config: {min_animals: 1, max_animals: 2}, size: 64, seed: 0}
    rewards:
      - function: reasoning_gym

`data.reasoning_gym` names any dataset reasoning-gym registers (`reasoning_gym.factory.DATASETS`,
`composite` for a weighted mix of several) and its config (the fields of that dataset's *Config
dataclass; `size` and `seed` are given apart). Its entries become the prompt records: the
question as the prompt (with `system_prompt`, a [system, user] message list), the `answer`
column, and a `reasoning_gym` column that says which entry of which dataset the row is. The
`reasoning_gym` reward rebuilds that dataset (procedural: the same config and seed give the same
entries) and calls its `score_answer(extract_answer(completion), entry)`, as reasoning-gym's own
evaluation does: the answer is what the completion puts between <answer> tags.

reasoning-gym is the `envs` extra; it is imported where it is used.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import metadata as importlib_metadata
from typing import Any

from pydantic import Field

from engine.config import ConfigError, Strict

PACKAGE = "reasoning-gym"
INSTALL = "pip install 'trainflow[envs]'"


class ReasoningGymConfig(Strict):
    """GRPO's prompts from one of reasoning-gym's datasets (engine/posttrain/procedural_tasks.py)."""

    dataset: str
    """A dataset reasoning-gym registers, e.g. leg_counting, basic_arithmetic, chain_sum, composite."""
    config: dict[str, Any] = Field(default_factory=dict)
    """That dataset's config fields (its *Config dataclass), e.g. {min_animals: 1, max_animals: 2};
    `size` and `seed` are the fields below."""
    size: int = Field(500, gt=0)
    """Entries generated; GRPO cycles over them in epochs, as over a JSONL file's records."""
    seed: int = 0
    """The dataset's seed (entry i is generated from it and i)."""
    system_prompt: str | None = None
    """A name from reasoning_gym.utils.SYSTEM_PROMPTS (default, DeepSeekZero, simple, direct, ...) or
    the text itself: the prompt is then [system, user] messages, rendered with the tokenizer's chat
    template. None: the question as plain text."""


def reasoning_gym_module():
    """The installed reasoning_gym, or a ConfigError saying how to install it."""
    try:
        import reasoning_gym  # the envs extra
    except ImportError:
        raise ConfigError(f"data.reasoning_gym needs the {PACKAGE} package: {INSTALL}") from None
    return reasoning_gym


def dataset_spec(cfg: ReasoningGymConfig) -> dict[str, Any]:
    """What identifies the generated entries: the dataset, its config, size and seed."""
    return {"dataset": cfg.dataset, "config": cfg.config, "size": cfg.size, "seed": cfg.seed}


@lru_cache(maxsize=16)
def _dataset(spec_json: str):
    spec = json.loads(spec_json)
    reasoning_gym = reasoning_gym_module()
    registered = reasoning_gym.factory.DATASETS
    if spec["dataset"] not in registered:
        close = difflib.get_close_matches(spec["dataset"], list(registered), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else f" ({len(registered)} are registered)"
        raise ConfigError(f"data.reasoning_gym.dataset: reasoning-gym has no dataset '{spec['dataset']}'{hint}")
    try:
        return reasoning_gym.create_dataset(spec["dataset"], **spec["config"], size=spec["size"], seed=spec["seed"])
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise ConfigError(
            f"data.reasoning_gym.config: reasoning-gym's {spec['dataset']} refuses this config "
            f"({e or type(e).__name__})"
        ) from None


def dataset_of(spec: dict[str, Any]):
    """The reasoning-gym dataset a spec (dataset_spec) generates; built once per process."""
    return _dataset(json.dumps(spec, sort_keys=True))


def prompt_records(cfg: ReasoningGymConfig, prompt_field: str = "prompt") -> list[dict]:
    """One record per entry: the question as `prompt_field`, its `answer`, and where it came from."""
    spec = dataset_spec(cfg)
    dataset = dataset_of(spec)
    system = None
    if cfg.system_prompt is not None:
        system = reasoning_gym_module().utils.SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)
    records = []
    for index in range(cfg.size):
        entry = dataset[index]
        question = entry["question"]
        prompt: Any = question
        if system is not None:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        where = {**spec, "index": index}
        records.append({prompt_field: prompt, "answer": str(entry["answer"]), "reasoning_gym": where})
    return records


def reasoning_gym_score(
    completions: list[str], reasoning_gym: list[dict] | None = None, answer_tag: str = "answer", **kwargs
) -> list[float]:
    """The reward: reasoning-gym's own score of each completion against its row's entry (0 to 1),
    the answer being what the completion holds between <answer_tag> tags."""
    if reasoning_gym is None:
        raise ConfigError("the reasoning_gym reward scores prompts from data.reasoning_gym; this run has none")
    extract_answer = reasoning_gym_module().utils.extract_answer
    scores = []
    for completion, where in zip(completions, reasoning_gym):
        spec = {k: v for k, v in where.items() if k != "index"}
        dataset = dataset_of(spec)
        answer = extract_answer(completion, tag_name=answer_tag)
        scores.append(float(dataset.score_answer(answer, dataset[where["index"]])))
    return scores


def package_version() -> str | None:
    """The installed reasoning-gym's version (None: not installed), without importing it."""
    try:
        return importlib_metadata.version(PACKAGE)
    except importlib_metadata.PackageNotFoundError:
        return None
