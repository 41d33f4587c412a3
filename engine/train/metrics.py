"""Run metrics: metrics.jsonl and the sinks chosen in `metrics.sinks` (TensorBoard, MLflow,
Weights & Biases), and the hardware peak that MFU is measured against.

metrics.jsonl is the record the pipeline reads; the sinks are views for people. A sink that
fails while the run goes on (a tracking server going away) warns once and is dropped: the
run never stops for its dashboards. MLflow and W&B are optional extras, imported only when
chosen; each resumes the same tracked run after a restart (its id is kept in metrics_dir).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# tensorboardX imports torch whenever it is installed (to recognise torch tensors, which the
# engine never hands it), and boto3 and google-cloud-storage (for s3:// and gs:// event
# files; the engine writes its own to local disk): 3-6 s at the start of every engine
# process. They are hidden for that import: None in sys.modules makes `import torch` raise
# the ImportError tensorboardX expects. A later import anywhere in the process works as usual.
_HIDDEN = [name for name in ("torch", "boto3", "google.cloud.storage") if name not in sys.modules]
sys.modules.update(dict.fromkeys(_HIDDEN))  # type: ignore[arg-type]  # None: the import fails, as intended
try:
    from tensorboardX import SummaryWriter
finally:
    for _name in _HIDDEN:
        del sys.modules[_name]

from engine.config import ConfigError  # noqa: E402
from engine.contract import METRICS_FILE, TENSORBOARD_DIR  # noqa: E402
from engine.train.config import MetricsConfig  # noqa: E402

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
        return f"eval/{key[len('eval_') :]}"
    if key in _PERF or key.endswith("_seconds"):
        return f"perf/{key}"
    if key.startswith(("reward", "frac_reward")):
        return f"reward/{key}"
    if key.startswith("completion_"):
        return f"rollout/{key}"
    return f"train/{key}"


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """A config as `a.b.c -> value` strings, the shape trackers take parameters in."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return flat


def _run_id_file(directory: Path, sink: str) -> Path:
    return directory / f"{sink}_run.json"


def _saved_run_id(directory: Path, sink: str) -> str | None:
    path = _run_id_file(directory, sink)
    return json.loads(path.read_text()).get("run_id") if path.is_file() else None


def _save_run_id(directory: Path, sink: str, run_id: str, **extra: Any) -> None:
    _run_id_file(directory, sink).write_text(json.dumps({"run_id": run_id, **extra}) + "\n")


def _missing_extra(sink: str) -> ConfigError:
    return ConfigError(f"metrics.sinks: '{sink}' needs the {sink} package: pip install 'trainflow[{sink}]'")


class TensorBoardSink:
    """Event files in <metrics_dir>/tensorboard/<run name>, so TensorBoard names the run."""

    def __init__(self, directory: Path, cfg: MetricsConfig, params: dict[str, str]):
        self.logdir = directory / TENSORBOARD_DIR / (cfg.run_name or "")
        self._writer = SummaryWriter(str(self.logdir))

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(tensorboard_tag(key), value, step)

    def close(self) -> None:
        self._writer.close()


class MlflowSink:
    """An MLflow run (MlflowClient): the config as params, every metric under its grouped tag."""

    def __init__(self, directory: Path, cfg: MetricsConfig, params: dict[str, str]):
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing_extra("mlflow") from None
        self._metric = Metric
        self.client = MlflowClient(tracking_uri=cfg.mlflow.tracking_uri)
        saved = _saved_run_id(directory, "mlflow")
        if saved is None:
            experiment = self.client.get_experiment_by_name(cfg.mlflow.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.mlflow.experiment)
            )
            run = self.client.create_run(
                experiment_id, run_name=cfg.run_name, tags={"trainflow.metrics_dir": str(directory)}
            )
            self.run_id: str = run.info.run_id
            _save_run_id(directory, "mlflow", self.run_id, tracking_uri=self.client.tracking_uri)
            items = [Param(k, v[:6000]) for k, v in params.items()]
            for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=items[start : start + 100])
        else:
            self.run_id = saved
            self.client.update_run(self.run_id, status="RUNNING")

    def write(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[self._metric(tensorboard_tag(k), v, now, step) for k, v in values.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink:
    """A Weights & Biases run in <metrics_dir>/wandb (offline mode keeps it there for `wandb sync`)."""

    def __init__(self, directory: Path, cfg: MetricsConfig, params: dict[str, str]):
        try:
            import wandb
        except ImportError:
            raise _missing_extra("wandb") from None
        run_id = _saved_run_id(directory, "wandb") or uuid.uuid4().hex[:12]
        _save_run_id(directory, "wandb", run_id)
        self.run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            name=cfg.run_name,
            id=run_id,
            resume="allow",
            dir=str(directory),
            mode=cfg.wandb.mode,  # None: W&B reads WANDB_MODE itself
            config=params,
            settings=wandb.Settings(quiet=True, console="off"),
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({tensorboard_tag(k): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MlflowSink, "wandb": WandbSink}


class MetricsWriter:
    """One JSON object per line in metrics.jsonl; the finite values also to each sink of
    `sinks` (TensorBoard alone by default), under grouped tags."""

    def __init__(
        self,
        directory: str | Path | None,
        enabled: bool = True,
        sinks: MetricsConfig | None = None,
        params: dict[str, str] | None = None,
        warn: Callable[[str], None] | None = None,
    ):
        self.enabled = enabled and directory is not None
        if not self.enabled or directory is None:
            return
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        cfg = sinks or MetricsConfig()
        self.sinks: dict[str, Any] = {
            name: SINKS[name](self.directory, cfg, params or {}) for name in dict.fromkeys(cfg.sinks)
        }
        self._jsonl = open(self.directory / METRICS_FILE, "a")

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record: dict[str, float | None] = {"step": step}
        for key, value in values.items():
            number = None if value is None else float(value)
            record[key] = number if number is not None and math.isfinite(number) else None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        finite = {k: v for k, v in record.items() if k != "step" and v is not None}
        for name in list(self.sinks):
            self._guarded(name, self.sinks[name].write, step, finite)

    def _guarded(self, name: str, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # a dashboard never stops a run
            del self.sinks[name]
            self._warn(
                f"warning: metrics sink '{name}' failed ({type(e).__name__}: {e}); metrics go on to "
                f"{self.directory / METRICS_FILE} and the other sinks"
            )

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            for name in list(self.sinks):
                self._guarded(name, self.sinks[name].close)


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
