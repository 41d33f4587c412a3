"""Progress for people: durations as `1m05s` and the ETA of a run from its pace so far.

The pace is measured from the first unit of work reported, not from the start, so the
compilation before it does not inflate the estimate. Training steps (flows/progress.py,
from each metrics record) and the evaluate stage's batches (engine/evaluate) share this.
Nothing here imports more than the standard library.
"""

from __future__ import annotations

import time


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Eta:
    """Seconds left for `total` units, from the pace since the first `update` (None until a
    second update has shown one)."""

    def __init__(self, total: float | None):
        self.total = total
        self._first: tuple[float, float] | None = None

    def update(self, done: float, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (now, done)
            return None
        first_time, first_done = self._first
        if not self.total or done <= first_done or now <= first_time:
            return None
        return (now - first_time) / (done - first_done) * max(self.total - done, 0)
