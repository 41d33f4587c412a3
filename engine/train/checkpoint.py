"""Orbax checkpoints: params, optimizer state, data-iterator state and run metadata.

Layout (an Orbax CheckpointManager directory):

    <dir>/<step>/params/      parameter pytree (pure nested dict of arrays)
    <dir>/<step>/opt_state/   optax state
    <dir>/<step>/meta/        JSON: step, resolved config, model (architecture), compute, format
    <dir>/<step>/data/        JSON: the Grain iterator state
    <dir>/<step>/digests.json size and sha256 of every file above (DIGESTS_FORMAT)

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves nothing that `latest_step` will pick up. The digests are
written into that temporary directory just before the rename, so they commit with the step:
a committed step without them was not written by this code, or was tampered with. Resume
restores `resume_step()`, the newest step whose files still match them (`verify_step`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from engine.config import ConfigError
from engine.contract import CHECKPOINT_FORMAT
from engine.data.urls import is_url
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.lora import join, merge_into_base, split_adapter
from engine.models.params import abstract_model_params
from engine.parallel.mesh import global_array
from engine.train.bucket_paths import checkpoint_path, temporary_path_class

ITEMS = ("params", "opt_state", "meta", "data")
DIGESTS_FILE = "digests.json"
DIGESTS_FORMAT = "trainflow.digests/1"
# Step-level files the digests do not cover: Orbax stamps _CHECKPOINT_METADATA with the commit
# time and writes commit_success.txt while committing, i.e. after the digests are taken.
_NOT_DIGESTED = frozenset({DIGESTS_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"})
_HASH_BLOCK = 8 << 20  # bytes per read when hashing


class _ReadOnlyNotices(logging.Filter):
    """Orbax warns whenever a CheckpointManager is opened read-only (the options it turns
    off, the directory) and when it is closed, though reading read-only is exactly what
    `load_params` and `stored_configs` mean to do. Drops those messages, nothing else."""

    MESSAGES = frozenset(
        {
            "Given directory is read only=%s",
            "%s is read only, save will be skipped",
            "%s is read only, delete will be skipped",
        }
    )
    PREFIX = "CheckpointManagerOptions.read_only=True, setting "

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg in self.MESSAGES or str(record.msg).startswith(self.PREFIX))


class _DiskFullTracebacks(logging.Filter):
    """A full disk during an asynchronous save: Orbax's threads each log the failure with its
    traceback (four of them, ~320 lines, for one step), then `wait` raises it, and the
    Checkpointer says it in one sentence (CheckpointWriteError). Drops those records only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and _disk_full(record.exc_info[1]))


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
logging.getLogger("absl").addFilter(_ReadOnlyNotices())  # Orbax logs through absl's Python logger
logging.getLogger("absl").addFilter(_DiskFullTracebacks())


class CorruptCheckpoint(ConfigError):
    """A checkpoint directory holds steps, but none whose files match their digests."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint step could not be written (a bucket refusing writes, expired credentials,
    a full disk): that step is not committed, the ones committed before are kept."""


# --------------------------------------------------------------------------- digests


def _step_files(step_dir: epath.Path, prefix: str = "") -> list[str]:
    """Relative paths of the files a step's digests cover, sorted."""
    files: list[str] = []
    for path in sorted(step_dir.iterdir(), key=lambda p: p.name):
        if not prefix and path.name in _NOT_DIGESTED:
            continue
        files += _step_files(path, f"{prefix}{path.name}/") if path.is_dir() else [prefix + path.name]
    return files


def _sha256(path: epath.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def write_digests(step_dir: str | Path, step: int | None = None) -> None:
    """Record size and sha256 of every file of a step in `<step_dir>/digests.json` (atomically)."""
    path = epath.Path(step_dir)
    files = {rel: {"size": (path / rel).stat().length, "sha256": _sha256(path / rel)} for rel in _step_files(path)}
    tmp = path / (DIGESTS_FILE + ".tmp")
    tmp.write_text(
        json.dumps({"format": DIGESTS_FORMAT, "step": step, "algorithm": "sha256", "files": files}, indent=1)
    )
    tmp.rename(path / DIGESTS_FILE)


def verify_step(directory: str | Path, step: int) -> list[str]:
    """Files of checkpoint `step` in `directory` that do not match the digests recorded when it
    was committed (changed, missing, or not recorded); [DIGESTS_FILE] when there are none.
    Empty: the step is intact. Reads every file of the step; one that cannot be read (in a
    bucket: replaced while it was being read) does not match."""
    step_dir = epath.Path(checkpoint_path(directory)) / str(step)
    try:
        recorded = json.loads((step_dir / DIGESTS_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [DIGESTS_FILE]
    present = set(_step_files(step_dir))
    bad = sorted(present - set(recorded))  # files nobody recorded
    for rel, want in recorded.items():
        path = step_dir / rel
        try:
            if rel not in present or path.stat().length != want["size"] or _sha256(path) != want["sha256"]:
                bad.append(rel)
        except OSError:
            bad.append(rel)
    return sorted(bad)


def _recording_digests(root: Path) -> type:
    """Orbax's temporary-path class for `root`, extended to write a step's digests into its
    temporary directory just before Orbax commits it (a rename; a commit file on object
    stores). Orbax finalizes on the primary process once every process has written."""
    base = temporary_path_class(root)
    root_name = str(root)

    class RecordingDigests(base):
        async def finalize(self):
            final = self.get_final()
            if str(final.parent) == root_name:  # the step itself, not one of its items
                write_digests(self.get(), int(final.name) if final.name.isdigit() else None)
            await super().finalize()

    return RecordingDigests


def _disk_full(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when that is what `error` comes from, else None: an OSError, or the
    ValueError TensorStore raises for Orbax's array writes (its text says the strerror), also
    where Orbax re-raises it wrapped or in a group."""
    todo: list[BaseException] = [error]
    visited: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in visited:
            continue
        visited.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return e.errno
        for code in _DISK_FULL_ERRNOS:
            if os.strerror(code) in str(e):
                return code
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += list(getattr(e, "exceptions", ()))
    return None


def _describe(problems: list[str]) -> str:
    if problems == [DIGESTS_FILE]:
        return f"its {DIGESTS_FILE} is missing or unreadable (none was recorded when it was committed)"
    shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
    return f"{len(problems)} file(s) differ from the digests recorded when it was committed: {shown}"


# --------------------------------------------------------------------------- the run's checkpoints


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = checkpoint_path(directory)  # a local path, or a bucket URL every process writes to
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
            temporary_path_class=_recording_digests(self.directory),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._problems: dict[int, list[str]] = {}  # verification results; files do not change under a run
        self._saving: int | None = None  # the step saved last, perhaps still being written

    def latest_step(self) -> int | None:
        """The newest committed step, intact or not (see `latest_verified_step`)."""
        return self.manager.latest_step()

    def latest_verified_step(self, log: Callable[[str], None] | None = None) -> int | None:
        """The newest step whose files match their digests; `log` hears about each newer one
        that does not. Process 0 verifies and every process gets its answer."""
        found = -1
        if jax.process_index() == 0:
            for step in sorted(self.manager.all_steps(), reverse=True):
                if step not in self._problems:
                    self._problems[step] = verify_step(self.directory, step)
                    if self._problems[step] and log:
                        log(  # "warning:": the stage's log shows it as a WARNING (flows/summary.py)
                            f"warning: checkpoint step {step} in {self.directory} failed verification: "
                            f"{_describe(self._problems[step])}"
                        )
                if not self._problems[step]:
                    found = step
                    break
        if jax.process_count() > 1:
            found = int(multihost_utils.broadcast_one_to_all(np.int32(found)))
        return None if found < 0 else found

    def resume_step(self, log: Callable[[str], None]) -> int | None:
        """The step to resume from: the newest intact one (None: start afresh). Newer steps that
        failed verification are deleted (saving those steps again needs their place); a
        directory whose steps all fail raises CorruptCheckpoint rather than start over."""
        step = self.latest_verified_step(log)
        newer = [s for s in self.manager.all_steps() if step is None or s > step]
        if newer and step is None:
            raise CorruptCheckpoint(
                f"checkpoint.directory: no step in {self.directory} matches its digests (steps "
                f"{', '.join(map(str, sorted(newer)))}); move the directory away to train from scratch"
            )
        if newer:
            log(
                f"warning: falling back to checkpoint step {step}, the newest intact one; removing step(s) "
                f"{', '.join(map(str, sorted(newer)))}"
            )
            for bad in newer:
                self.manager.delete(bad)
                self._problems.pop(bad, None)
        return step

    def save(self, step: int, params, opt_state, meta: dict, data_state: dict | None) -> None:
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
            data=ocp.args.JsonSave(data_state or {}),
        )
        with self._writing(step):
            self.manager.save(step, args=args, force=True)
        self._saving = step  # an asynchronous save's failure shows in a later call: it names this step

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """A failed write (here, or of an async save finishing) as one sentence naming the
        directory; Orbax commits a step only once all of it is written, so nothing half-written
        counts: resume takes the newest committed step."""
        try:
            yield
        except Exception as e:
            step = step if step is not None else self._saving
            what = f"checkpoint step {step}" if step is not None else "a checkpoint step"
            committed = self.manager.latest_step()
            kept = (
                f"step {committed}, the newest committed, is kept" if committed is not None else "no step is committed"
            )
            disk = _disk_full(e)
            if disk is not None:  # the strerror stays in the line: the launcher classifies it (DiskFull)
                raise CheckpointWriteError(
                    f"{what}: {os.strerror(disk)} writing {self.directory}; it is not committed, {kept}"
                ) from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointWriteError(
                f"{what}: could not write to {self.directory} ({type(e).__name__}: {first[:300]}); "
                f"it is not committed, {kept}"
            ) from e

    def restore(self, step: int, abstract_params, abstract_opt_state) -> tuple[Any, Any, dict, dict]:
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params),
                opt_state=ocp.args.StandardRestore(abstract_opt_state),
                meta=ocp.args.JsonRestore(),
                data=ocp.args.JsonRestore(),
            ),
        )
        return restored.params, restored.opt_state, restored.meta, restored.data

    def wait(self) -> None:
        with self._writing(None):
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def save_params(directory: str | Path, step: int, params, meta: dict) -> None:
    """A params-only checkpoint (no optimizer or data state), as a Hugging Face conversion writes one:
    load_params and `checkpoint.init_from` read it; a run cannot resume from it.

    `params` are numpy arrays, written as they are: no defensive copy (Orbax's default
    doubles peak memory) and no zstd (it costs more time than the fifth of the disk it saves
    on weights). Do not modify them until this returns.
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        # Unused here, but Orbax looks its array-metadata store up on the jax.Array handler
        # and logs an absl WARNING into the stage's output where there is none.
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )
    handlers = {
        "params": ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry),
        "meta": ocp.JsonCheckpointHandler(),
    }
    directory = checkpoint_path(directory)
    manager = ocp.CheckpointManager(
        directory,
        item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, create=True, temporary_path_class=_recording_digests(directory)
        ),
    )
    manager.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params), meta=ocp.args.JsonSave(meta)))
    manager.close()


def normalise_meta(meta: dict) -> dict:
    """Meta in the current format: `model` the architecture, `compute` the settings the params
    were saved with. Format 1 kept compute fields inside `model`; meta without a format (a
    hand-made checkpoint) gets default compute settings."""
    meta = dict(meta)
    model = dict(meta.get("model") or {})
    compute = dict(meta.get("compute") or {})
    for key in ComputeConfig.model_fields:
        if key in model:
            compute.setdefault(key, model.pop(key))
    meta.update(
        model=model, compute=ComputeConfig.model_validate(compute).model_dump(mode="json"), format=CHECKPOINT_FORMAT
    )
    return meta


def read_meta(directory: str | Path, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest (or given) checkpoint in `directory`, meta normalised."""
    directory = checkpoint_path(directory)
    if not directory.is_dir():
        raise ConfigError(f"checkpoint directory not found: {directory}")
    manager = ocp.CheckpointManager(directory, item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise ConfigError(f"no complete checkpoint in {directory}")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    manager.close()
    return step, normalise_meta(meta)


def stored_configs(directory: str | Path, step: int | None = None) -> tuple[ModelConfig, ComputeConfig]:
    """The architecture and compute settings a checkpoint was saved with."""
    _, meta = read_meta(directory, step)
    return ModelConfig.model_validate(meta["model"]), ComputeConfig.model_validate(meta["compute"])


def adapter_base(directory: str | Path, meta: dict) -> Path:
    """The base checkpoint directory of an adapter checkpoint: where it was when the adapter
    trained, or (a store moved or copied) the same place relative to the adapter. A
    ConfigError when neither holds it."""
    lora = meta["lora"]
    if is_url(directory) or is_url(lora["base_checkpoint"]):  # an adapter in a bucket names its base by URL
        return checkpoint_path(lora["base_checkpoint"])
    candidates = [Path(directory).absolute() / lora["base_relative"]] if lora.get("base_relative") else []
    candidates.append(Path(lora["base_checkpoint"]))
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"{directory}: holds a LoRA adapter whose base checkpoint {lora['base_checkpoint']} is gone; "
        "restore the base artifact (trainflow lineage names it)"
    )


def load_params(
    directory: str | Path, abstract_params=None, step: int | None = None, *, as_numpy: bool = False
) -> tuple[ModelConfig, Any, int]:
    """Params of the latest checkpoint in `directory`: (model config, params, step).

    `abstract_params` (ShapeDtypeStructs with shardings) places them on a mesh, in the dtypes
    asked for; by default they are restored with the shapes and dtypes they were saved with,
    on this process's first device, whatever devices or processes saved them. `as_numpy`
    restores host numpy arrays instead (export: no device copy, no topology).

    An adapter checkpoint (a LoRA stage's, meta `lora`) gives its base's params with the
    adapter folded in (engine/models/lora.py: merge_into_base): the model it trained, for
    whatever consumes a checkpoint (evaluate, generate, export, a further stage). Its base
    may be an adapter checkpoint too.
    """
    step, meta = read_meta(directory, step)
    if meta.get("lora"):
        return _load_merged(directory, meta, step, abstract_params, as_numpy)
    model_cfg = ModelConfig.model_validate(meta["model"])
    manager = ocp.CheckpointManager(
        checkpoint_path(directory), item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    saved = abstract_model_params(model_cfg, ComputeConfig.model_validate(meta["compute"]), mesh=None)
    if as_numpy:
        restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), saved)
        args = ocp.args.PyTreeRestore(item=saved, restore_args=restore_args)
    else:
        if abstract_params is None:
            here = SingleDeviceSharding(jax.local_devices()[0])
            abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), saved)
        args = ocp.args.StandardRestore(abstract_params)
    restored = manager.restore(step, args=ocp.args.Composite(params=args))
    manager.close()
    return model_cfg, restored.params, step


def load_adapter(directory: str | Path, step: int | None = None) -> tuple[ModelConfig, LoraConfig, dict, int, Path]:
    """(model config, LoRA config, adapter params as numpy, step, base directory) of an
    adapter checkpoint; a ConfigError if `directory` holds a full checkpoint."""
    step, meta = read_meta(directory, step)
    if not meta.get("lora"):
        raise ConfigError(f"{directory}: is a full checkpoint, not a LoRA adapter")
    model_cfg = ModelConfig.model_validate(meta["model"])
    compute = ComputeConfig.model_validate(meta["compute"])
    lora = LoraConfig.model_validate({k: v for k, v in meta["lora"].items() if k in LoraConfig.model_fields})
    base = adapter_base(directory, meta)
    shapes = split_adapter(abstract_model_params(model_cfg, compute, None, lora))[0]
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), shapes)
    manager = ocp.CheckpointManager(
        checkpoint_path(directory), item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    restored = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item=shapes, restore_args=restore_args))
    )
    manager.close()
    return model_cfg, lora, restored.params, step, base


def _load_merged(directory, meta, step, abstract_params, as_numpy):
    model_cfg, lora, adapter, step, base_dir = load_adapter(directory, step)
    base_cfg, base, _ = load_params(base_dir, as_numpy=True)
    if base_cfg != model_cfg:
        raise ConfigError(
            f"{directory}: the adapter was trained on a {model_cfg.family} model that differs from "
            f"its base checkpoint {base_dir} ({base_cfg.family})"
        )
    merged = merge_into_base(join(adapter, base), lora.scale, lora.weights(model_cfg))
    if as_numpy:
        return model_cfg, merged, step
    if abstract_params is None:
        here = SingleDeviceSharding(jax.local_devices()[0])
        return model_cfg, jax.tree.map(lambda a: jax.device_put(a, here), merged), step
    placed = jax.tree.map(
        lambda a, want: global_array(np.asarray(a, want.dtype), want.sharding), merged, abstract_params
    )
    return model_cfg, placed, step
