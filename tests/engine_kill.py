"""A helper of the resume tests: run an engine entry point, SIGKILL it once a checkpoint step
is committed, and run it again to the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def kill_then_resume(module: str, config: Path, checkpoints: Path, after_step: int, timeout: float = 300) -> str:
    """`python -m MODULE CONFIG`, SIGKILLed once `checkpoints` holds a step >= after_step (with
    asynchronous checkpoints possibly mid-save), then rerun; returns the rerun's stderr."""
    argv = [sys.executable, "-m", module, str(config)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while (
        not any(p.name.isdigit() and int(p.name) >= after_step for p in checkpoints.glob("*")) and proc.poll() is None
    ):
        assert time.monotonic() < deadline, f"no checkpoint at step {after_step} in {timeout} s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from checkpoint step" in resumed.stderr
    return resumed.stderr
