"""Kill points of the GRPO resume tests (tests/test_grpo_resume.py), run inside the stage's own
process: a reward function and a policy loss that SIGKILL it once, where an environment
variable says, and otherwise change nothing (the uninterrupted run uses them too, so both run
the same programs).

    KILL_AT_ROLLOUT="STEP:MARKER"  scoring batch STEP (0-based), after its rollout was sampled
                                   and before its update: mid-rollout
    KILL_AT_UPDATE="N:MARKER"      inside the N-th update this process executes (the loss's host
                                   callback runs while the compiled step runs): mid-update

MARKER is a file created just before the kill, so a resumed process does not kill again.
CONSUMED, if set, is a file each scoring appends its batch to ({"step", "prompts"}): what the
trainer's process took from the prompt stream, per step.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.posttrain.policy_loss import clipped_surrogate

KILL_AT_ROLLOUT, KILL_AT_UPDATE, CONSUMED = "KILL_AT_ROLLOUT", "KILL_AT_UPDATE", "CONSUMED"
_updates = 0


def _kill_once(marker: str) -> None:
    if not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _scoring(prompts: list, step: int) -> None:
    """Batch `step` is scored: log its prompts, and die here if asked to."""
    if os.environ.get(CONSUMED):
        with open(os.environ[CONSUMED], "a") as f:
            f.write(json.dumps({"step": step, "prompts": prompts}) + "\n")
    at, _, marker = os.environ.get(KILL_AT_ROLLOUT, "").partition(":")
    if at and step == int(at):
        _kill_once(marker)


def copy_reward(prompts, completions, answer, step, **kwargs):
    """1 when the completion starts with the prompt's digit (the copy task's exact_match)."""
    _scoring(prompts, step)
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]


def no_reward(prompts, completions, step, **kwargs):
    """0 for every completion: the kill point of a run an environment scores."""
    _scoring(prompts, step)
    return [0.0] * len(completions)


def _count_update(_) -> None:
    global _updates
    _updates += 1
    at, _, marker = os.environ.get(KILL_AT_UPDATE, "").partition(":")
    if at and _updates == int(at):
        _kill_once(marker)


def clipped_with_kill_point(ratio, advantages_b1, logp_bt, *, epsilon_low, epsilon_high):
    """PPO's clipped surrogate, plus a host callback each time the update runs."""
    jax.debug.callback(_count_update, jnp.sum(ratio))
    return clipped_surrogate(ratio, advantages_b1, logp_bt, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
