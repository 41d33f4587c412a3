"""What an environment of multi-turn GRPO is (engine/posttrain/environments.py): the prompt it
opens an episode with, the Step it answers each model turn with, and the protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Prompt = str | list[dict[str, Any]]


@dataclass
class Step:
    """What the environment says after one model turn."""

    observation: str | None = None
    """Text the model sees next (rendered as an `observation_role` message in chat mode,
    appended as is to a text prompt); ignored when done."""
    reward: float = 0.0
    """This turn's reward; the episode's is the sum over its turns."""
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that failed: an unknown tool, bad arguments, or an error the tool reported."""
    tool_failures: dict[str, int] = field(default_factory=dict)
    """Sandboxed calls that failed, by kind (sandbox.FAILURE_KINDS: wall_time, memory, crash ...)."""
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> Prompt: ...

    def step(self, turn: str) -> Step: ...
