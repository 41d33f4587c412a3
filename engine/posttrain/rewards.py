"""Reward functions for GRPO/GSPO: built-ins, user functions, and calling them safely.

A reward function has TRL's signature, called once per rollout batch with keyword
arguments only:

    def my_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  **kwargs) -> list[float | None]

`kwargs` holds every other column of the prompts dataset (one value per completion, e.g.
`answer`), `max_completion_length`, `step`, and the `kwargs` of its entry in the config. A
config names it `module:function` (the module importable from the working directory or
PYTHONPATH). It returns one reward per completion; None or NaN means "cannot score this
one": that completion gets zero advantage and is counted (`reward_invalid`). A function
that raises fails the stage with its name.

Built-ins (`function: <name>`):
    exact_match     1 if the answer extracted from the completion equals the `answer` column
    numeric_match   1 if the number extracted from the completion is within `tolerance` of it
    regex           1 if the completion matches `pattern` (a format reward)
    length_penalty  DAPO's soft overlong penalty: 0 up to max_length - buffer, then a linear
                    ramp to -1 at max_length, -1 beyond
    reasoning_gym   reasoning-gym's own scorer of the row's entry (prompts from data.reasoning_gym;
                    engine/posttrain/procedural_tasks.py), on the answer between <answer> tags
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_serializer, model_validator

from engine.config import ConfigError, Strict
from engine.posttrain.procedural_tasks import reasoning_gym_score

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


class RewardSpec(Strict):
    """One reward term: a function (or a reward model), its weight in the total, its fixed
    keyword arguments."""

    function: str | None = None
    """A built-in (exact_match, numeric_match, regex, length_penalty) or `module:function`."""
    model: str | None = None
    """Instead of a function, a reward model scores each prompt + completion
    (engine/posttrain/reward_model.py: RewardScorer): its checkpoint directory, which a grpo
    stage fills in from the input this names (a reward_model artifact)."""
    weight: float = 1.0
    name: str | None = None
    """Name in metrics (reward/<name>/mean); default: the function's name (reward_model for a model)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Fixed keyword arguments, e.g. {pattern: '#### (.*)'} or {tolerance: 0.01}."""

    @model_validator(mode="after")
    def _one_scorer(self) -> RewardSpec:
        if (self.function is None) == (self.model is None):
            raise ValueError("a reward term has either a `function` or a `model` (a reward model), not both")
        if self.model is not None and self.kwargs:
            raise ValueError("kwargs apply to a reward function, not to a reward model")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """`model` came after artifacts were made: a function term dumps as it did before, so
        the ids of GRPO and evaluate stages that hold one stay as they were."""
        data = handler(self)
        if self.model is None:
            data.pop("model", None)
        return data


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; names the function."""


# --------------------------------------------------------------------------- built-ins


def _extract(text: str, pattern: str | None) -> str | None:
    """The first capture group of `pattern` (or its whole match); the stripped text if no pattern."""
    if pattern is None:
        return text.strip()
    match = re.search(pattern, text, flags=re.DOTALL)
    if match is None:
        return None
    return (match.group(1) if match.groups() else match.group(0)).strip()


def _column(kwargs: dict, field: str, fn: str) -> list:
    if field not in kwargs:
        raise KeyError(f"{fn} needs the '{field}' column in the prompts dataset (set answer_field)")
    return kwargs[field]


def exact_match(completions, pattern: str | None = None, answer_field: str = "answer", **kwargs) -> list[float]:
    """1.0 if the extracted answer equals str(answer) (both stripped), else 0.0."""
    answers = _column(kwargs, answer_field, "exact_match")
    return [float(_extract(c, pattern) == str(a).strip()) for c, a in zip(completions, answers)]


def _to_number(text: str | None) -> float | None:
    if text is None:
        return None
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_match(
    completions,
    pattern: str | None = None,
    answer_field: str = "answer",
    tolerance: float = 1e-6,
    relative: bool = False,
    **kwargs,
) -> list[float]:
    """1.0 if the last number in the extracted answer is within tolerance of the answer.

    `relative`: the tolerance is a fraction of |answer|. No number in the completion: 0.0.
    """
    answers = _column(kwargs, answer_field, "numeric_match")
    rewards = []
    for completion, answer in zip(completions, answers):
        value, target = _to_number(_extract(completion, pattern)), _to_number(str(answer))
        if target is None:
            raise ValueError(f"the answer {answer!r} is not a number")
        limit = tolerance * abs(target) if relative else tolerance
        rewards.append(float(value is not None and abs(value - target) <= limit))
    return rewards


def regex(
    completions, pattern: str, mode: Literal["search", "match", "fullmatch"] = "fullmatch", **kwargs
) -> list[float]:
    """1.0 if the completion matches `pattern` (re.DOTALL), else 0.0."""
    compiled = re.compile(pattern, flags=re.DOTALL)
    match = getattr(compiled, mode)
    return [float(match(c) is not None) for c in completions]


def length_penalty(
    completion_ids, max_completion_length: int, max_length: int | None = None, buffer: int | None = None, **kwargs
) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), in tokens.

    max_length defaults to max_completion_length, buffer to a quarter of it.
    """
    max_length = max_length or max_completion_length
    buffer = buffer or max(max_length // 4, 1)
    rewards = []
    for ids in completion_ids:
        n = len(ids)
        if n <= max_length - buffer:
            rewards.append(0.0)
        elif n <= max_length:
            rewards.append((max_length - buffer - n) / buffer)
        else:
            rewards.append(-1.0)
    return rewards


BUILTIN: dict[str, Callable] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "regex": regex,
    "length_penalty": length_penalty,
    "reasoning_gym": reasoning_gym_score,
}


# --------------------------------------------------------------------------- loading and calling


def load_reward(spec: RewardSpec) -> tuple[str, Callable]:
    """(metric name, function) of a function term; a bad reference is a ConfigError naming it."""
    if spec.function is None:  # GRPO scores reward models itself (reward_model.RewardScorer)
        raise ConfigError(f"rewards: a reward model term (model: {spec.model}) is scored only by GRPO; give a function")
    if spec.function in BUILTIN:
        return spec.name or spec.function, BUILTIN[spec.function]
    module_name, sep, attr = spec.function.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"rewards: '{spec.function}' is neither a built-in ({', '.join(BUILTIN)}) nor of the form module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"rewards: cannot import module '{module_name}' for '{spec.function}': {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"rewards: module '{module_name}' has no function '{attr}'")
    return spec.name or attr, fn


def compute_rewards(
    rewards: list[tuple[str, Callable, RewardSpec]],
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    max_completion_length: int,
    step: int,
) -> np.ndarray:
    """(completions, functions) float64 rewards, NaN where a function gave None or NaN."""
    out = np.full((len(completions), len(rewards)), np.nan)
    for j, (name, fn, spec) in enumerate(rewards):
        try:
            values = fn(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                **columns,
                max_completion_length=max_completion_length,
                step=step,
                **spec.kwargs,
            )
        except Exception as e:  # noqa: BLE001 - any failure of user code fails the stage, named
            raise RewardError(f"reward function '{name}' raised {type(e).__name__}: {e}") from e
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} values"
            raise RewardError(f"reward function '{name}' returned {got} for {len(completions)} completions")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                out[i, j] = float(value)
            except (TypeError, ValueError):
                raise RewardError(f"reward function '{name}' returned {value!r}, not a number") from None
    return out


def total_reward(per_function: np.ndarray, weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(weighted sum per completion, valid mask), TRL's rule: the sum is over the functions that
    scored the completion (None/NaN terms are left out); a completion no function scored is
    invalid (reward 0, and left out of its group's statistics)."""
    valid = ~np.isnan(per_function).all(axis=1)
    total = np.where(valid, np.nan_to_num(per_function) @ np.asarray(weights, float), 0.0)
    return total, valid


def nan_stats(values: np.ndarray) -> tuple[float, float]:
    """(mean, std) over the non-NaN entries; NaN if none."""
    finite = values[~np.isnan(values)]
    if finite.size == 0:
        return math.nan, math.nan
    return float(finite.mean()), float(finite.std(ddof=1)) if finite.size > 1 else 0.0
