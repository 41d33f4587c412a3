"""An OpenEnv environment for the tests (tests/test_openenv.py), served by OpenEnv's own server
(create_app, through engine/posttrain/openenv_env.py): OpenEnv's template echo environment
(the observation is the action's message, reward 0.1 per character) that can also hold a step,
so a test can kill a GRPO run in the middle of an episode.

OPENENV_PAUSE_DIR: if it holds a file `arm`, the next step removes it, writes `paused` and
sleeps OPENENV_PAUSE_SECONDS (default 30) before it answers. A message "sleep:N" sleeps N s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    echoed_message: str = Field(default="", description="The echoed message")


class PausingEcho(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self) -> EchoObservation:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="ready", done=False, reward=0.0)

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        pause = Path(os.environ.get("OPENENV_PAUSE_DIR", "/nonexistent"))
        if (pause / "arm").exists():
            (pause / "arm").unlink(missing_ok=True)
            (pause / "paused").touch()
            time.sleep(float(os.environ.get("OPENENV_PAUSE_SECONDS", "30")))
        if action.message.startswith("sleep:"):
            time.sleep(float(action.message.removeprefix("sleep:")))
        return EchoObservation(echoed_message=action.message, done=False, reward=0.1 * len(action.message))

    @property
    def state(self) -> State:
        return self._state
