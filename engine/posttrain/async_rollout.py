"""Asynchronous rollouts: worker processes that generate GRPO's completions while the trainer
updates, with weights at most `max_staleness` updates old.

    trainer (grpo.RolloutSource)                      worker i (its own process and devices)
    push(v, params)        --- weights v ------------> place them on its mesh
    submit(j, prompts)     --- batch j --------------> generate_rollout with the newest weights
    result(j)              <-- Rollout j, version ---  (FIFO per worker; batch j on worker j % N)

The trainer hands over batch j after update j - max_staleness and its weights, and each
worker reads its pipe in order, so batch j is generated with exactly the weights of update
j - max_staleness (fewer after a start or a restart): the run is as reproducible as a
synchronous one, and max_staleness 0 is the synchronous run, bitwise, with the sampling moved
to another process. The trainer waits only when a batch is not ready. Weights travel through
the pipe as host arrays (never the artifact store).

A worker that dies (a crash, SIGKILL, the OOM killer) is started again with the newest
weights and its unfinished batches (up to `rollout_worker_restarts` times), otherwise the
stage fails with one sentence; its checkpoints are intact and a re-run resumes.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from engine.config import ConfigError
from engine.inference.sample import Sampler
from engine.models.params import abstract_model_params
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import make_mesh
from engine.posttrain.config import GRPOConfig
from engine.posttrain.finetune import finetune_start
from engine.posttrain.rollout import Rollout, rollout_of_config

READY_TIMEOUT_S = 600.0  # a worker's start: importing JAX and compiling its sampler
POLL_S = 0.2


class RolloutWorkerError(RuntimeError):
    """A rollout worker died more often than the config allows, or raised."""


def worker_main(conn, cfg_tree: dict) -> None:
    """A rollout worker's process: build the sampler on this process's devices, then serve
    `weights` and `rollout` messages in order until `stop`."""
    os.environ.update(cfg_tree.get("rollout_worker_env") or {})  # before the runtime reads its devices
    try:
        cfg = GRPOConfig.model_validate(cfg_tree)
        model_cfg, compute, bundle = finetune_start(cfg)
        mesh = make_mesh(cfg.mesh if not cfg.rollout_worker_env else MeshConfig())
        shardings = jax.tree.map(lambda a: a.sharding, abstract_model_params(model_cfg, compute, mesh))
        sampler = Sampler(model_cfg, compute, mesh, shardings, dtype=cfg.rollout_dtype)
        pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which names it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid(), jax.device_count()))
    params, version = None, -1
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] == "weights":
            version, params = message[1], jax.device_put(message[2], shardings)
            continue
        _, step, prompt_inputs = message
        start = time.perf_counter()
        try:
            rollout = rollout_of_config(cfg, sampler, bundle, params, prompt_inputs, step=step, pad_id=pad_id)
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"batch {step}: {type(e).__name__}: {e}"))
            return
        rollout.weights_version, rollout.seconds = version, time.perf_counter() - start
        conn.send(("rollout", step, rollout))


class _Worker:
    """One worker process, its pipe, and what it was sent that it has not answered."""

    def __init__(self, index: int, cfg_tree: dict):
        context = multiprocessing.get_context("spawn")  # JAX's runtime does not survive a fork
        self.index = index
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child, cfg_tree), name=f"rollout-worker-{index}", daemon=True
        )
        self.process.start()
        child.close()
        self.pending: deque[tuple[int, list[dict], list]] = deque()  # batches sent, not answered

    def send(self, message) -> bool:
        try:
            self.conn.send(message)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def receive(self, timeout: float | None = None):
        """The next message, or None if the process died (or `timeout` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(POLL_S):
                    return self.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                return None
            if not self.process.is_alive() and not self.conn.poll(0):
                return None
            if deadline is not None and time.monotonic() > deadline:
                return None

    def how_it_ended(self) -> str:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def stop(self) -> None:
        self.send(("stop",))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class RolloutWorkers:
    """The trainer's side: `cfg.rollout_workers` processes, batch j on worker j % N."""

    def __init__(self, cfg: GRPOConfig, log: Callable[[str], None]):
        self.cfg, self.log = cfg, log
        self.cfg_tree = cfg.model_dump(mode="json")
        self.restarts_left = cfg.rollout_worker_restarts
        self.latest: tuple[int, Any] | None = None  # (version, host params): what a restarted worker gets
        start = time.perf_counter()
        self.workers = [_Worker(i, self.cfg_tree) for i in range(cfg.rollout_workers)]
        for worker in self.workers:
            self._wait_ready(worker)
        log(f"{len(self.workers)} rollout worker(s) ready in {time.perf_counter() - start:.1f} s")

    def _wait_ready(self, worker: _Worker) -> None:
        message = worker.receive(timeout=READY_TIMEOUT_S)
        if message is None or message[0] != "ready":
            why = message[1] if message else f"it {worker.how_it_ended()}"
            self.close()
            raise ConfigError(f"rollout worker {worker.index} could not start: {why}")
        worker.pid = message[1]
        self.log(f"rollout worker {worker.index} started (pid {worker.pid}, {message[2]} devices)")

    def push(self, version: int, params) -> None:
        """The weights of update `version` to every worker (host arrays, through the pipes)."""
        host = jax.tree.map(np.asarray, jax.device_get(params))
        self.latest = (version, host)
        for worker in self.workers:
            worker.send(("weights", version, host))  # a dead worker is found (and restarted) by result()

    def submit(self, step: int, records: list[dict], prompt_inputs: list) -> None:
        worker = self.workers[step % len(self.workers)]
        worker.pending.append((step, records, prompt_inputs))
        worker.send(("rollout", step, prompt_inputs))

    def result(self, step: int) -> tuple[list[dict], list, Rollout]:
        """Batch `step`'s (records, prompts, rollout), waiting for it only if it is not ready."""
        worker = self.workers[step % len(self.workers)]
        assert worker.pending and worker.pending[0][0] == step, (step, [p[0] for p in worker.pending])
        while True:
            message = worker.receive()
            if message is not None and message[0] == "rollout":
                answered, records, prompt_inputs = worker.pending.popleft()
                assert answered == message[1] == step, (answered, message[1], step)
                return records, prompt_inputs, message[2]
            worker = self._restart(worker, step, None if message is None else message[1])

    def _restart(self, worker: _Worker, step: int, error: str | None) -> _Worker:
        what = f"raised {error}" if error else worker.how_it_ended()
        if error or self.restarts_left == 0:
            self.close()
            raise RolloutWorkerError(
                f"rollout worker {worker.index} {what} while generating batch {step + 1}; the stage stopped "
                f"(rollout_worker_restarts: {self.cfg.rollout_worker_restarts}), its checkpoints are kept "
                "and a re-run resumes from the last one"
            )
        self.restarts_left -= 1
        self.log(f"rollout worker {worker.index} {what} at batch {step + 1}: restarting it")
        replacement = _Worker(worker.index, self.cfg_tree)
        replacement.pending = worker.pending
        worker.conn.close()
        self._wait_ready(replacement)
        self.workers[worker.index] = replacement
        if self.latest is not None:  # the newest weights: the resent batches are at most as stale as before
            replacement.send(("weights", *self.latest))
        for pending_step, _, prompt_inputs in replacement.pending:
            replacement.send(("rollout", pending_step, prompt_inputs))
        return replacement

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []
