"""Function registries for what users extend in RL post-training: advantage estimators,
policy losses and loss aggregations (Tunix's and verl's function registries, one list each).

A config names an entry by its registered name or, for a user's own, as `module:function`
(the module importable from the working directory or PYTHONPATH), as reward functions are
named. The registry is the one place the names are listed: the config's validators ask it,
so a misspelt name is refused before anything compiles, in one sentence listing what is
registered.

Entries are callables or lazy `module:attribute` strings, so that validating a pipeline
(engine/posttrain/config.py) does not import JAX: the policy losses are JAX functions
(engine/posttrain/policy_loss.py) and load only when a run resolves them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """name -> function (or `module:attribute` loaded on first use)."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        """What an entry is ("advantage estimator") and the config key that names one."""
        self._entries: dict[str, Callable | str] = {}

    def register(self, name: str, target: Callable | str | None = None):
        """Register `target` under `name`; without a target, a decorator. Registering a name
        again replaces the entry (a user's definition wins over a built-in)."""

        def add(fn):
            self._entries[name] = fn
            return fn

        return add if target is None else add(target)

    def names(self) -> list[str]:
        return list(self._entries)

    def check(self, value: str) -> str:
        """`value` if registered or of the form module:function (imported at run time), else a
        ValueError naming the registered ones."""
        module, sep, attr = value.partition(":")
        if value in self._entries or (sep and module and attr):
            return value
        raise ValueError(
            f"unknown {self.kind} '{value}': registered are {', '.join(self._entries)}, "
            "or name your own as module:function"
        )

    def resolve(self, value: str) -> Callable:
        """The function a config's value names; a user's `module:function` is imported here and
        a bad one is a ValueError naming it."""
        entry: Any = self._entries.get(value, value)
        if callable(entry):
            return entry
        module_name, _, attr = self.check(entry).partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{self.key}: cannot import module '{module_name}' for '{value}': {e}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{self.key}: module '{module_name}' has no function '{attr}'")
        return fn


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "advantage_estimator")
"""fn(rewards_b, valid_b, lengths_b, group_size, scale) -> (advantages_b, std_g); the built-ins
are in engine/posttrain/advantages.py (NumPy, registered when it is imported)."""

POLICY_LOSSES = Registry("policy loss", "loss_type")
"""A built-in: a PolicyLoss (surrogate + default aggregation). A user's module:function: a
surrogate, `fn(ratio, advantages_b1, logp_bt, *, epsilon_low, epsilon_high) -> (per-token loss,
{metric: boolean mask})`, aggregated by `loss_aggregation` (token_mean unless set)."""

LOSS_AGGREGATIONS = Registry("loss aggregation", "loss_aggregation")
"""fn(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps) -> loss
(verl's loss_agg_mode)."""

# The built-in losses and aggregations: TRL's loss_type names (verl's loss_agg_mode names,
# with underscores, for the aggregations). Defined in policy_loss.py, loaded when used.
for _name in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "gmpo"):
    POLICY_LOSSES.register(_name, f"engine.posttrain.policy_loss:{_name.upper()}")
for _name in ("token_mean", "token_mean_local", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
    LOSS_AGGREGATIONS.register(_name, f"engine.posttrain.policy_loss:{_name}")

ROLLOUT_CORRECTIONS = Registry("rollout correction", "rollout_correction.mode")
"""fn(log_ratio_bt, mask_bt, low, high) -> (ratio, weights, keep): the off-policy correction
between the trainer's and the rollout's log-probs (engine/posttrain/rollout_correction.py, where
the built-ins are defined and what each returns is described)."""

# TRL's vllm_importance_sampling_mode names, then IcePop's token masks and verl's geometric rejection.
for _name in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    ROLLOUT_CORRECTIONS.register(_name, f"engine.posttrain.rollout_correction:{_name}")
for _name in ("icepop", "sequence_geometric_mask"):
    ROLLOUT_CORRECTIONS.register(_name, f"engine.posttrain.rollout_correction:{_name}")

ROLLOUT_CORRECTION_BOUNDS = {"icepop": (0.5, 5.0), "sequence_geometric_mask": (0.999, 1.001)}
"""(clip_min, clip_max) of a mode whose reference sets its own when a config leaves them out:
IcePop's alpha and beta (Ring-1T), verl's geometric rejection preset. Others: (None, 3.0)."""
