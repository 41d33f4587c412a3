"""The processes of one sandboxed run, seen from outside: the tree under the process the
sandbox started, its memory, and how to end all of it at once.

A tool call's code may fork, double-fork into a daemon or setsid() into a session of its
own; none of that leaves the tree, because orphans are re-parented inside it (to the PID
namespace's init, or to the namespaces bootstrap, a child subreaper where the kernel gives
no PID namespace). So "every process of the call" is "the tree under the sandbox's first
process", read from /proc/<pid>/task/<tid>/children where the kernel has it, else from every
process's /proc/<pid>/stat (these machines' kernels lack the first).

These machines' cgroups are v1 with the memory controller held by the host (cgroup v2's
unified tree has no memory or pids controller to delegate), so no kernel limit covers a
whole tool call: the tree's memory is sampled (`tree_memory_bytes`) and the run killed past
its limit, with RLIMIT_AS still capping each process. A sample can miss what grows and
shrinks between two samples; the per-process limit bounds that.

`kill_tree` and what it calls use only os, select, signal and time: the namespaces bootstrap
runs the same functions (`bootstrap_source()` is part of it) to end what the code left behind.
"""

from __future__ import annotations

import inspect
import os
import select
import signal
import time


def process_tree(root: int) -> list[int]:
    """`root` and every process under it (root first; empty when root is gone): from the
    kernel's lists of children where it keeps them (CONFIG_PROC_CHILDREN), which reads the tree
    only, else from every process's parent (`scan_tree`)."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return scan_tree(root)
    found = [root]
    for pid in found:  # grows while it is walked: breadth first
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # exited while we looked
            continue
        for tid in threads:  # a child hangs under the thread that forked it
            try:
                fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY)
                try:
                    found += [int(child) for child in os.read(fd, 1 << 16).split()]
                finally:
                    os.close(fd)
            except OSError:
                pass
    return found


def scan_tree(root: int) -> list[int]:
    """`process_tree` from /proc/<pid>/stat of every process on the host (a few ms for a few
    hundred processes)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:  # os.open, not open(): this runs ten times a second while a call runs
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
        except OSError:  # exited while we looked
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    if not os.path.exists(f"/proc/{root}"):
        return []
    found = [root]
    for pid in found:
        found += children.get(pid, [])
    return found


def kill_tree(root: int, keep_root: bool = False) -> int:
    """SIGKILL every process under `root` (and root itself unless `keep_root`) and wait, a few
    seconds at most, until each has exited; the number killed. Each is stopped first, until a
    pass finds no new one: a stopped process cannot fork, so none is born after the last pass
    (a fork bomb cannot outrun it). Signals go through pidfds, which cannot name a reused pid
    (through the pid where the kernel has no pidfd_open, before Linux 5.3)."""
    handles: dict[int, int | None] = {}  # pid: its pidfd; None: signal the pid; -1: gone before it was found
    try:
        while True:
            new = [pid for pid in process_tree(root) if pid not in handles and not (keep_root and pid == root)]
            if not new:
                break
            for pid in new:
                try:
                    handles[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    handles[pid] = -1
                    continue
                except OSError:  # no pidfds here
                    handles[pid] = None
                _send(pid, handles[pid], signal.SIGSTOP)
        waiting = select.poll()
        plain: list[int] = []
        left = 0
        for pid, fd in handles.items():
            if fd != -1 and _send(pid, fd, signal.SIGKILL):  # ESRCH: it died with its namespace's init
                if fd is None:
                    plain.append(pid)
                else:
                    waiting.register(fd, select.POLLIN)  # readable once the process has exited
                    left += 1
        deadline = time.monotonic() + 5
        while (left or plain) and time.monotonic() < deadline:
            for fd, _ in waiting.poll(10):
                waiting.unregister(fd)
                left -= 1
            plain = [pid for pid in plain if _running(pid)]
    finally:
        for fd in handles.values():
            if fd is not None and fd >= 0:
                os.close(fd)
    return len([fd for fd in handles.values() if fd != -1])


def _send(pid: int, pidfd: int | None, sig: int) -> bool:
    """Signal a process through its pidfd, or its pid; False if it is gone (or not ours)."""
    try:
        if pidfd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Whether `pid` has yet to exit (a zombie has: it waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def tree_memory_bytes(root: int) -> int:
    """The memory the tree under `root` holds: the sum of its processes' proportional set
    sizes (pages shared between them, as after a fork, counted once), their RSS where the
    kernel gives no smaps_rollup."""
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) << 10
                        break
        except FileNotFoundError:  # exited, or no smaps_rollup: its resident pages
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        except OSError:
            pass
    return total


def bootstrap_source() -> str:
    """The source of `kill_tree` and what it calls, for the namespaces bootstrap to run."""
    return "".join(inspect.getsource(f) for f in (process_tree, scan_tree, kill_tree, _send, _running))
