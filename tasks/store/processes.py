"""Process identity: what a lock or a lease records of the process holding it, and how
another process tells whether that one still runs (a pid can be reused; a pid seen from
another machine or pid namespace says nothing)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), None for a process
    that has ended (or is a zombie); raises OSError where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


_PROCESSES: dict[int, dict] = {}


def _machine_identity() -> dict:
    """The boot, the pid namespace and this process's start time; empty without /proc. Read
    once per process id: a forked child is a process of its own."""
    pid = os.getpid()
    if pid not in _PROCESSES:
        try:
            _PROCESSES[pid] = {
                "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                "pid_namespace": os.readlink("/proc/self/ns/pid"),
                "started": start_time(pid),
            }
        except OSError:
            _PROCESSES[pid] = {}
    return _PROCESSES[pid]


def this_process() -> dict:
    """What a lock or lease records of its holder: host, pid, and what lets another process on
    the same machine tell whether it still runs (boot, pid namespace, start time)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), **_machine_identity()}


def holder_is_gone(info: dict) -> bool:
    """Whether a holder recorded by `this_process` ran on this machine -- same host name, boot
    and pid namespace -- and no longer runs. A holder elsewhere, or on a machine without
    /proc, is never judged gone: its lease runs out instead."""
    here = _machine_identity()
    if (
        not here
        or not info.get("started")
        or info.get("host") != socket.gethostname()
        or any(info.get(key) != here[key] for key in ("boot_id", "pid_namespace"))
    ):
        return False
    try:
        return start_time(int(info["pid"])) != info.get("started")
    except (KeyError, TypeError, ValueError, OSError):
        return False
