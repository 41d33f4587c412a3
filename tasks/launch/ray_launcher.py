"""The `ray` launcher: a stage's N engine processes as one gang on an existing Ray cluster.

    launcher: {kind: ray, processes: 2, address: auto, resources: {GPU: 1}, spread: true}

1. A placement group reserves `resources` for each process, on as few nodes as possible
   (PACK) or one process per node (STRICT_SPREAD, `spread: true`); the stage waits for it.
2. One `RankWorker` actor per bundle. Rank 0's picks a free port on its node: the
   coordinator address (that node's IP and the port), which the others are given before they
   start (TRAINFLOW_COORDINATOR / TRAINFLOW_NUM_PROCESSES / TRAINFLOW_PROCESS_ID, read by
   engine/parallel/distributed.py).
3. Each worker runs the engine command as a child process on its node and keeps its output
   lines; the driver (trainflow) polls every worker for new lines and its exit code, which
   run_child watches like any other gang (tasks/launch/run.py): rank prefixes, one rank failing
   stops the others, the error names it.
4. However the stage ends, the actors are killed and the placement group removed. An engine
   whose worker dies gets SIGTERM (PR_SET_PDEATHSIG, as for local children) and saves.

Every node needs trainflow installed (a worker runs its own `python -m engine...`) and a
local artifact store at the same path (a shared filesystem), as for Slurm. A bucket store
needs none: every rank reads its config, tokenizer, data and checkpoints at the bucket's URL
and writes its shards there; rank 0 writes metrics.jsonl beside trainflow (docs/cluster.md,
"What every layout shares"). The artifact's lock is
held by trainflow only: remote processes cannot inherit it. This module imports Ray, an
optional extra (`trainflow[ray]`): tasks/launch/run.py loads it only for `kind: ray`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tasks.launch.gang import GangOutput, Rank, child_env, guarded, split_lines
from tasks.launch.spec import LauncherSpec, StageFailed

PLACEMENT_TIMEOUT_SECONDS = 300.0
"""How long a stage waits for the cluster to have room for the whole gang (an autoscaler may add nodes)."""
POLL_SECONDS = 0.1
"""How often the driver asks a quiet worker for output."""

_connect_lock = threading.Lock()


@ray.remote(num_cpus=0, max_restarts=0)
class RankWorker:
    """Runs one rank's engine command on the node the placement group gave it, and keeps its
    output until the driver collects it. No method blocks, so one thread serves them all."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque()
        self.drained = threading.Event()

    def free_address(self) -> str:
        """IP:port of this node with a port free now (rank 0's: the coordinator's)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, driver_python: str) -> int:
        if argv and argv[0] == driver_python:  # the driver's interpreter: use this node's
            argv = [sys.executable, *argv[1:]]
        # guarded(): the engine gets SIGTERM (and saves) when this actor's process dies.
        self.proc = subprocess.Popen(
            guarded(argv),
            cwd=cwd,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None
        for line in split_lines(self.proc.stdout):
            self.lines.append(line)
        self.drained.set()

    def read(self) -> tuple[list[str], int | None]:
        """The lines since the last call, and the exit code once every line has been read."""
        assert self.proc is not None
        drained = self.drained.is_set()  # before taking the lines: none can follow them then
        lines = [self.lines.popleft() for _ in range(len(self.lines))]
        return lines, self.proc.poll() if drained else None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


class RayRank(Rank):
    """The driver's view of one worker: a thread collects its lines into the gang's output."""

    remote = True

    def __init__(self, worker, rank: int, output: GangOutput):
        self.worker, self.rank, self.output = worker, rank, output
        self.code: int | None = None
        self.lost: str | None = None
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while True:
            try:
                lines, code = ray.get(self.worker.read.remote(), timeout=60)
            except GetTimeoutError:
                continue  # a busy node: ask again
            except Exception as e:  # RayActorError: its node or its worker process died
                first_line = next(iter(str(e).strip().splitlines()), "")
                self.lost = f"lost its Ray worker ({type(e).__name__}: {first_line})"
                self.code = 1
                return
            for line in lines:
                self.output.emit(self.rank, line)
            if code is not None:
                self.code = code
                return
            if not lines:
                time.sleep(POLL_SECONDS)

    def poll(self) -> int | None:
        return self.code

    def signal(self, sig: int) -> None:
        self.worker.signal.remote(sig)  # not waited for: a dead worker shows in poll()

    def describe(self, code: int) -> str:
        return self.lost or super().describe(code)

    def finish(self) -> None:
        self.thread.join(timeout=10)


def connect(address: str | None) -> None:
    """Join the Ray cluster once per process (later stages reuse the connection)."""
    with _connect_lock:
        if ray.is_initialized():
            return
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        try:
            # The workers' output reaches the log through RankWorker.read, not Ray's log forwarding.
            ray.init(address=address, log_to_driver=False, namespace="trainflow")
        finally:
            if previous is not None:  # ray.init makes SIGTERM exit at once; trainflow's handler stops the stages
                signal.signal(signal.SIGTERM, previous)


def start(
    spec: LauncherSpec,
    plan: list[tuple[list[str], dict[str, str]]],
    output: GangOutput,
    *,
    cwd: Path | None,
    env: dict[str, str],
) -> tuple[list[Rank], Callable[[], None]]:
    """Place the gang and start rank 0's engine, then the others; its ranks and its teardown."""
    connect(spec.address)
    strategy = "STRICT_SPREAD" if spec.spread else "PACK"
    group = placement_group([dict(spec.resources)] * spec.processes, strategy=strategy)
    workers: list = []

    def teardown() -> None:
        for worker in workers:
            ray.kill(worker, no_restart=True)  # a worker already gone is no error
        remove_placement_group(group)

    try:
        _wait_for_placement(group, spec, strategy)
        resources = dict(spec.resources)
        options = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0), "resources": resources}
        actor_class: Any = RankWorker  # @ray.remote made it an actor class, which mypy does not see
        workers += [
            actor_class.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(spec.processes)
        ]
        coordinator = ray.get(workers[0].free_address.remote())
        ranks: list[Rank] = []
        for rank, (worker, (argv, extra_env)) in enumerate(zip(workers, plan)):
            rank_env = {**env, **extra_env, "TRAINFLOW_COORDINATOR": coordinator}
            ray.get(worker.start.remote(argv, rank_env, str(cwd) if cwd else None, sys.executable))
            ranks.append(RayRank(worker, rank, output))
    except BaseException:
        teardown()
        raise
    return ranks, teardown


def _wait_for_placement(group: PlacementGroup, spec: LauncherSpec, strategy: str) -> None:
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
    except GetTimeoutError:
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        raise StageFailed(
            f"launcher kind 'ray': the cluster ({nodes} nodes, {ray.cluster_resources()}) found no room for "
            f"{spec.processes} processes of {spec.resources} ({strategy}) in {PLACEMENT_TIMEOUT_SECONDS:.0f} s"
        ) from None
