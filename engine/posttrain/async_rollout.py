"""Asynchronous rollouts: worker processes that generate GRPO's rollouts while the trainer
updates, with weights at most `max_staleness` updates old.

    trainer (grpo.RolloutSource)                      worker i (its own process and devices)
    push(v, params)        --- weights v ------------> place them on its mesh
    submit(j, records)     --- batch j --------------> generate_batch with the newest weights
    result(j)              <-- Rollout j, version ---  (FIFO per worker; batch j on worker j % N)

The trainer hands over batch j after update j - max_staleness and its weights, and each
worker reads its pipe in order, so batch j is generated with exactly the weights of update
j - max_staleness (fewer after a start or a restart): the run is as reproducible as a
synchronous one, and max_staleness 0 is the synchronous run, bitwise, with the sampling moved
to another process. A worker runs the very code the trainer's process runs without workers
(`generate_batch`): single-turn completions, or an environment's multi-turn episodes, whose
token masks, per-turn rewards and metrics come back in the Rollout. The trainer waits only
when a batch is not ready. Weights travel through the pipe as host arrays (never the artifact
store); with LoRA only the adapter travels: each worker loads the frozen base from
checkpoint.init_from once, as the trainer does, and samples from base + adapter unmerged.

A worker that dies (a crash, SIGKILL, the OOM killer) is started again with the newest
weights and its unfinished batches (up to `rollout_worker_restarts` times), otherwise the
stage fails with one sentence; its checkpoints are intact and a re-run resumes. Workers
ignore SIGTERM and SIGINT (a preemption or Ctrl-C reaching the whole process group): the
trainer saves its checkpoint and then stops them, so none outlives the stage.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from engine.config import ConfigError
from engine.data.tokenizer import TokenizerBundle
from engine.inference.sample import Sampler
from engine.parallel.config import MeshConfig
from engine.posttrain.config import GRPOConfig, train_config
from engine.posttrain.environments import EnvironmentFailure
from engine.posttrain.finetune import finetune_start
from engine.posttrain.multiturn import EpisodeRunner, multiturn_rollout
from engine.posttrain.rollout import Rollout, rollout_of_config
from engine.train.trainer import Trainer

READY_TIMEOUT_S = 600.0  # a worker's start: importing JAX, loading a LoRA base, compiling its sampler
POLL_S = 0.2


class RolloutWorkerError(RuntimeError):
    """A rollout worker died more often than the config allows, or raised."""


def episode_runner(cfg: GRPOConfig, bundle: TokenizerBundle, pad_id: int, log: Callable[[str], None]):
    """The environment's episode runner of a run (None: single-turn completions)."""
    if cfg.environment is None:
        return None
    return EpisodeRunner(
        cfg.environment,
        bundle,
        max_prompt_length=cfg.max_prompt_length,
        max_completion_length=cfg.max_completion_length,
        pad_id=pad_id,
        log=log,
    )


def replays_routes(cfg: GRPOConfig, model_cfg) -> bool:
    """Whether the rollout records each token's experts for the trainer to replay
    (GRPOConfig.router_replay; engine/models/router_replay.py); true where it cannot is refused.
    A vLLM server (`rollout:`) returns them when started with --enable-return-routed-experts:
    engine/interop/vllm_server.py refuses, naming router_replay, a server that does not."""
    if cfg.router_replay is False:
        return False
    why = None
    if not model_cfg.is_moe:
        why = "needs a mixture of experts, and this model has none (num_experts 0)"
    elif cfg.environment is not None:
        why = (
            "is not supported with an environment: a multi-turn episode's sampler calls do not record "
            "the routes of the environment's tokens between them; set router_replay false"
        )
    if why and cfg.router_replay:
        raise ConfigError(f"router_replay: true {why}")
    return why is None


def rollout_sampler(cfg: GRPOConfig, model_cfg, trainer: Trainer) -> Sampler:
    """The engine's sampler over `trainer`'s weights as they are laid out (with LoRA: the
    adapter beside the frozen base, never merged), in the run's rollout dtype; recording each
    token's experts where the trainer replays them (router replay)."""
    return Sampler(
        model_cfg,
        trainer.cfg.compute,
        trainer.mesh,
        trainer.model_param_shardings(),
        dtype=cfg.rollout_dtype,
        lora=cfg.lora,
        record_experts=replays_routes(cfg, model_cfg),
    )


def generate_batch(
    cfg: GRPOConfig,
    sampler: Sampler,
    bundle: TokenizerBundle,
    params,
    records: list[dict],
    *,
    step: int,
    pad_id: int,
    episodes: EpisodeRunner | None,
) -> Rollout:
    """Batch `step`'s rollout from `params`: G completions of each record's prompt, or with an
    environment G episodes of each record. The one rollout path of the trainer's process and
    of a worker alike."""
    if episodes is not None:
        return multiturn_rollout(episodes, sampler, bundle, params, records, cfg=cfg, step=step)
    prompt_inputs = [r[cfg.data.prompt_field] for r in records]
    return rollout_of_config(cfg, sampler, bundle, params, prompt_inputs, step=step, pad_id=pad_id)


def worker_main(conn, cfg_tree: dict) -> None:
    """A rollout worker's process: hold the weights as the trainer does (a Trainer's mesh,
    shardings and, with LoRA, its frozen base), build the sampler, then serve `weights` and
    `rollout` messages in order until `stop` (or the trainer's end of the pipe closes)."""
    os.environ.update(cfg_tree.get("rollout_worker_env") or {})  # before the runtime reads its devices
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer saves, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lines: list[str] = []  # the episodes' log lines, sent back with the rollout they belong to
    try:
        cfg = GRPOConfig.model_validate(cfg_tree)
        model_cfg, compute, bundle = finetune_start(cfg)
        if cfg.rollout_worker_env:  # devices of its own: laid out on `data` alone
            cfg = cfg.model_copy(update={"mesh": MeshConfig()})
        holder = Trainer(train_config(cfg, model_cfg, compute))  # never steps: it holds the weights
        holder.model_params({})  # a LoRA run's frozen base, loaded once (nothing without LoRA)
        sampler = rollout_sampler(cfg, model_cfg, holder)
        pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
        episodes = episode_runner(cfg, bundle, pad_id, lines.append)
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which names it
        conn.send(("error", f"{type(e).__name__}: {e}", None))
        return
    conn.send(("ready", os.getpid(), jax.device_count()))
    params, version = None, -1
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if message[0] == "stop":
            return
        if message[0] == "weights":  # the whole params, or a LoRA run's adapter (joined to the base)
            version = message[1]
            params = holder.model_params(jax.device_put(message[2], holder.param_shardings))
            continue
        _, step, records = message
        start = time.perf_counter()
        try:
            rollout = generate_batch(cfg, sampler, bundle, params, records, step=step, pad_id=pad_id, episodes=episodes)
        except Exception as e:  # noqa: BLE001
            failure = e if isinstance(e, EnvironmentFailure) else None  # raised again by the trainer
            conn.send(("error", f"batch {step}: {type(e).__name__}: {e}", failure))
            return
        rollout.weights_version, rollout.seconds = version, time.perf_counter() - start
        conn.send(("rollout", step, rollout, lines[:]))
        lines.clear()


class _Worker:
    """One worker process, its pipe, and what it was sent that it has not answered."""

    def __init__(self, index: int, cfg_tree: dict):
        context = multiprocessing.get_context("spawn")  # JAX's runtime does not survive a fork
        self.index = index
        self.pid: int | None = None  # the worker's own, once it is ready
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child, cfg_tree), name=f"rollout-worker-{index}", daemon=True
        )
        self.process.start()
        child.close()
        self.pending: deque[tuple[int, list[dict]]] = deque()  # batches sent, not answered

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
        """An idle worker ends at `stop`; a busy one is killed (a stopping trainer, on SIGTERM
        or a failure, does not wait for batches it will not train on)."""
        if not self.pending and self.send(("stop",)):
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
        if self.latest is None:
            leaves = jax.tree.leaves(host)
            megabytes = sum(leaf.nbytes for leaf in leaves) / 1e6
            self.log(f"weights to the rollout workers: {len(leaves)} arrays, {megabytes:.3f} MB per update")
        self.latest = (version, host)
        for worker in self.workers:
            worker.send(("weights", version, host))  # a dead worker is found (and restarted) by result()

    def submit(self, step: int, records: list[dict]) -> None:
        worker = self.workers[step % len(self.workers)]
        worker.pending.append((step, records))
        worker.send(("rollout", step, records))

    def result(self, step: int) -> tuple[list[dict], Rollout]:
        """Batch `step`'s (records, rollout), waiting for it only if it is not ready."""
        worker = self.workers[step % len(self.workers)]
        assert worker.pending and worker.pending[0][0] == step, (step, [p[0] for p in worker.pending])
        while True:
            message = worker.receive()
            if message is not None and message[0] == "rollout":
                answered, records = worker.pending.popleft()
                assert answered == message[1] == step, (answered, message[1], step)
                for line in message[3]:  # the episodes' own lines (a failed episode), in the trainer's log
                    self.log(line)
                return records, message[2]
            if message is not None and message[2] is not None:  # an environment that cannot run, as without workers
                self.close()
                raise message[2]
            worker = self._restart(worker, step, None if message is None else message[1])

    def _restart(self, worker: _Worker, step: int, error: str | None) -> _Worker:
        what = f"raised {error}" if error else worker.how_it_ended()
        if error or self.restarts_left == 0:
            worker.pending.clear()  # it raised and returned, or it is dead: nothing to wait for
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
        for pending_step, records in replacement.pending:
            replacement.send(("rollout", pending_step, records))
        return replacement

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []
