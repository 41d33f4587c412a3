"""An OpenEnv environment server as GRPO's multi-turn environment (`environment.factory: openenv`).

    environment:
      factory: openenv
      max_turns: 2
      kwargs:
        serve: {init: echo_env}        # or url: http://host:port (a server already running)
        action_field: message          # the model's turn goes in the action as this field
        observation_field: echoed_message

Each episode is one session on the server, through OpenEnv's own client (openenv-core's
GenericEnvClient): `reset` opens it with the row's prompt, each model turn is a `step` whose
action is {action_field: turn}, and the server's observation[observation_field], reward and
done come back as the runner's Step (engine/posttrain/multiturn.py). The session is OpenEnv's
WebSocket one (/ws): in openenv-core 0.3 the HTTP /reset and /step routes make a fresh
environment per request (openenv/core/env_server/http_server.py, reset_handler/step_handler),
so an episode of several turns lives on the session.

`serve` starts the server here, on 127.0.0.1 at a free port, once per process (each rollout
worker its own), stopped when the process ends: `init: NAME` is the environment OpenEnv's
`openenv init NAME` writes from its template (an echo environment: the observation echoes the
action, reward 0.1 per character), or `environment`/`action`/`observation` name an OpenEnv
Environment subclass and its Action and Observation models (`module:Class`, importable from
`path`). `url` is a server already running.

Failures never hang or end the stage: every call has a timeout (`timeout_seconds`), and a
server that does not answer, closes the session or answers with something that is not an
observation (no `observation_field`, a reward that is not a number) fails that episode, which
the runner counts in `env/failed` (its reward unscored). A served server that died is started
again for the next episode. Only a rollout batch whose every episode failed stops the stage
(EnvironmentFailure: an environment that cannot run at all).

openenv-core is the `envs` extra; it is imported where it is used.
"""

from __future__ import annotations

import atexit
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from engine.config import ConfigError, Strict
from engine.posttrain.env_protocol import Step

PACKAGE = "openenv-core"
INSTALL = "pip install 'trainflow[envs]'"
SERVER_START_SECONDS = 60.0


class ServeConfig(Strict):
    """An OpenEnv server this process starts on 127.0.0.1."""

    init: str | None = None
    """The environment OpenEnv's `openenv init NAME` writes from its template (echo), served as is."""
    environment: str | None = None
    """Else an openenv Environment subclass, `module:Class`."""
    action: str | None = None
    """Its Action model, `module:Class`."""
    observation: str | None = None
    """Its Observation model, `module:Class`."""
    path: str | None = None
    """A directory put first on the server's import path (where those modules are)."""
    max_sessions: int = Field(16, gt=0)
    """Concurrent sessions the server holds (at least the environment's step_workers)."""

    @model_validator(mode="after")
    def _one_source(self) -> ServeConfig:
        named = (self.environment, self.action, self.observation)
        if (self.init is None) == (None in named) or (self.init is None and not all(named)):
            raise ValueError("serve: give init (an openenv template's name) or environment, action and observation")
        return self


class OpenEnvConfig(Strict):
    """The `openenv` environment's kwargs."""

    url: str | None = None
    """A running OpenEnv server's base URL (http://host:port)."""
    serve: ServeConfig | None = None
    """Or the server to start here (on 127.0.0.1)."""
    action_field: str = "message"
    """The action field the model's turn (decoded text) is sent as."""
    observation_field: str = "echoed_message"
    """The observation field the model sees next."""
    prompt: str = "{prompt}"
    """The episode's prompt: a template over the row's columns and the first observation
    ({observation}), e.g. "{prompt}\\n{observation}"."""
    timeout_seconds: float = Field(30.0, gt=0)
    """How long one reset or step may take before the episode fails."""
    connect_seconds: float = Field(10.0, gt=0)
    """How long opening an episode's session may take."""

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.serve is None):
            raise ValueError("give url (a running OpenEnv server) or serve (one to start here), one of the two")
        return self


def openenv_modules():
    """(GenericEnvClient, the openenv package), or a ConfigError saying how to install it."""
    try:
        import openenv  # the envs extra
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise ConfigError(f"environment.factory openenv needs the {PACKAGE} package: {INSTALL}") from None
    return GenericEnvClient, openenv


def package_version() -> str | None:
    """The installed openenv-core's version (None: not installed), without importing it."""
    try:
        return importlib_metadata.version(PACKAGE)
    except importlib_metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- the served server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as answer:
            return answer.status == 200
    except OSError:
        return False


@dataclass
class ServedServer:
    """One server process this process started; started again if it died."""

    spec: ServeConfig
    process: subprocess.Popen | None = None
    url: str = ""
    directory: tempfile.TemporaryDirectory | None = None
    starts: int = 0

    def ensure(self) -> str:
        """The URL of a live server, started (again) if there is none."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        port = free_port()
        argv = [sys.executable, "-m", "engine.posttrain.openenv_env", json.dumps(self.spec.model_dump()), str(port)]
        if self.spec.init is not None and self.directory is None:
            self.directory = tempfile.TemporaryDirectory(prefix="trainflow-openenv-")
        if self.directory is not None:
            argv.append(self.directory.name)
        # Its log to a file, not a pipe: a pipe nobody reads would fill and stop the server.
        log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, text=True)
        self.url, self.starts = f"http://127.0.0.1:{port}", self.starts + 1
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not healthy(self.url):
            if self.process.poll() is not None:
                log.seek(0)
                error = log.read()[-600:]
                raise ConfigError(f"environment.kwargs.serve: the OpenEnv server did not start: {error.strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(
                    f"environment.kwargs.serve: no OpenEnv server answered at {self.url} in {SERVER_START_SECONDS} s"
                )
            time.sleep(0.1)
        return self.url

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None


_SERVERS: dict[str, ServedServer] = {}
_SERVERS_LOCK = threading.Lock()


def served_url(spec: ServeConfig) -> str:
    """The URL of this process's server for `spec`, started (or restarted) as needed."""
    key = json.dumps(spec.model_dump(), sort_keys=True)
    with _SERVERS_LOCK:
        server = _SERVERS.setdefault(key, ServedServer(spec))
        return server.ensure()


@atexit.register
def _stop_servers() -> None:
    for server in _SERVERS.values():
        server.stop()


# --------------------------------------------------------------------------- an episode


class OpenEnvEnvironment:
    """One episode: a session on the server (engine/posttrain/environments.py's protocol)."""

    observation_role = "user"

    def __init__(self, **kwargs: Any):
        try:
            self.cfg = OpenEnvConfig.model_validate(kwargs)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in ("environment.kwargs", *first["loc"]))
            raise ConfigError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
        self.client_cls, _ = openenv_modules()
        self.client = None

    def _open(self):
        url = self.cfg.url or served_url(self.cfg.serve)
        client = self.client_cls(
            base_url=url, connect_timeout_s=self.cfg.connect_seconds, message_timeout_s=self.cfg.timeout_seconds
        ).sync()
        return client.connect()

    def observation_text(self, result, what: str) -> str:
        observation = getattr(result, "observation", None)
        if not isinstance(observation, dict) or not isinstance(observation.get(self.cfg.observation_field), str):
            self.close()
            raise ValueError(
                f"the OpenEnv server's {what} observation has no text '{self.cfg.observation_field}' "
                f"(got {str(observation)[:200]})"
            )
        return observation[self.cfg.observation_field]

    def reset(self, row: dict[str, Any]) -> str:
        self.close()
        self.client = client = self._open()
        try:
            result = client.reset()
        except BaseException:
            self.close()
            raise
        observation = self.observation_text(result, "reset")
        return self.cfg.prompt.format(**{**row, "observation": observation})

    def step(self, turn: str) -> Step:
        assert self.client is not None, "step before reset"
        try:
            result = self.client.step({self.cfg.action_field: turn})
        except BaseException:
            self.close()
            raise
        observation = self.observation_text(result, "step")
        reward = 0.0 if result.reward is None else result.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            self.close()
            raise ValueError(f"the OpenEnv server's reward is not a finite number: {reward!r}")
        done = bool(result.done)
        if done:
            self.close()
        return Step(observation=observation, reward=float(reward), done=done)

    def close(self) -> None:
        """End the session without waiting on it: a dead or stuck server cannot hold the episode
        (the client's close waits on the server's close handshake, up to its own timeout)."""
        if self.client is not None:
            client, self.client = self.client, None
            threading.Thread(target=close_quietly, args=(client,), daemon=True).start()


def close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a session already gone: nothing to close
        pass


# --------------------------------------------------------------------------- the server process


def resolve(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(spec: ServeConfig, port: int, directory: str | None) -> None:
    """Run the OpenEnv server of `spec` on 127.0.0.1:`port` (this process, until killed)."""
    import uvicorn  # openenv-core's server runs on it
    from openenv.cli.commands.init import _copy_template_directory, _create_template_replacements
    from openenv.core.env_server.http_server import create_app

    if spec.init is not None:  # what `openenv init NAME` writes, without its uv lock step
        assert directory is not None
        root = Path(directory) / spec.init
        if not root.exists():
            root.mkdir(parents=True)
            replacements = _create_template_replacements(spec.init)
            _copy_template_directory("openenv.cli.templates.openenv_env", "", root, replacements, spec.init)
        sys.path.insert(0, str(root))
        prefix = _create_template_replacements(spec.init)["__ENV_CLASS_NAME__"]  # EchoEnv for echo_env
        environment = resolve(f"server.{spec.init}_environment:{prefix}Environment")
        action, observation = resolve(f"models:{prefix}Action"), resolve(f"models:{prefix}Observation")
    else:
        if spec.path:
            sys.path.insert(0, spec.path)
        environment, action, observation = (resolve(str(s)) for s in (spec.environment, spec.action, spec.observation))
    app = create_app(environment, action, observation, max_concurrent_envs=spec.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def exit_with_parent() -> None:
    """A served server ends with the process that started it, even one SIGKILLed (no atexit)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    os.environ.setdefault("ENABLE_WEB_INTERFACE", "false")
    exit_with_parent()
    serve(ServeConfig.model_validate_json(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
