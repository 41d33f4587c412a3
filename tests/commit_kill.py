"""`python -m tests.commit_kill CONFIG.yaml`: the pretraining entry point (engine.train), whose
committing process SIGKILLs itself once every process has written its shards of checkpoint
step KILL_STEP, just before that step is committed (where Orbax finalizes a step: its digests
are written, then its commit). A fault test's stage kind runs this entry point instead of
engine.train (tests/test_bucket_multihost.py)."""

from __future__ import annotations

import os
import signal
import sys

from engine.train import checkpoint
from engine.train.pretrain import main

KILL_STEP = 4
_write_digests = checkpoint.write_digests


def _killed_before_commit(step_dir, step: int | None = None) -> None:
    if step == KILL_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    _write_digests(step_dir, step)


if __name__ == "__main__":
    # Patched only in the stage's own process: a test process that imports this module (a
    # stage kind's entry point is imported to check it) must not die at its own step 4.
    checkpoint.write_digests = _killed_before_commit
    sys.exit(main())
