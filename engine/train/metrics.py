"""Run metrics: JSONL + TensorBoard, and the hardware peak that MFU is measured against."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tensorboardX import SummaryWriter

from engine.contract import METRICS_FILE, TENSORBOARD_DIR

# Dense bf16 peak FLOP/s per device, from the vendors' data sheets.
PEAK_FLOPS_PER_DEVICE = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}


def measure_matmul_flops(n: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of a jitted n x n matmul on the default backend (the CPU's practical peak)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(devices=None) -> tuple[float, str]:
    """(FLOP/s of all devices together, where the figure came from)."""
    return _peak_flops(tuple(devices or jax.devices()))


@functools.cache  # measuring takes a second; a run asks at every log step
def _peak_flops(devices: tuple) -> tuple[float, str]:
    kind = devices[0].device_kind
    for name, flops in PEAK_FLOPS_PER_DEVICE.items():
        if name.lower() in kind.lower():
            return flops * len(devices), f"{kind} data sheet"
    # CPU (simulated devices share the same cores): measure instead of trusting a table.
    return measure_matmul_flops(), f"measured {kind} matmul"


_PERF = ("tokens_per_second", "tflops_per_device", "mfu")


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metric: grouped as train/, eval/, perf/, rollout/, reward/ (a
    key that already names its group, like reward/correct/mean, keeps its name)."""
    if key.startswith(("train/", "eval/", "perf/", "rollout/", "reward/")):
        return key
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    if key in _PERF or key.endswith("_seconds"):
        return f"perf/{key}"
    if key.startswith(("reward", "frac_reward")):
        return f"reward/{key}"
    if key.startswith("completion_"):
        return f"rollout/{key}"
    return f"train/{key}"


class MetricsWriter:
    """One JSON object per line in metrics.jsonl, the same scalars in TensorBoard (grouped tags)."""

    def __init__(self, directory: str | Path | None, enabled: bool = True):
        self.enabled = enabled and directory is not None
        if not self.enabled:
            return
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.directory / METRICS_FILE, "a")
        self._tb = SummaryWriter(str(self.directory / TENSORBOARD_DIR))

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step}
        for key, value in values.items():
            value = None if value is None else float(value)
            record[key] = value if value is not None and math.isfinite(value) else None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self._tb.add_scalar(tensorboard_tag(key), float(value), step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
