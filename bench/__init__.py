"""Benchmarks: each script measures one target and writes bench/results/<name>.json;
docs/benchmarks.md reports the figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine(**extra) -> dict:
    """What a result was measured on: platform, CPU model and count, Python, and the load
    average (the machines are shared: say how busy this one was); `extra` adds versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "load_average_at_start": list(os.getloadavg()), **extra}
