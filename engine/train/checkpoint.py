"""Orbax checkpoints: params, optimizer state, data-iterator state and run metadata.

Layout (an Orbax CheckpointManager directory):

    <dir>/<step>/params/      parameter pytree (pure nested dict of arrays)
    <dir>/<step>/opt_state/   optax state
    <dir>/<step>/meta/        JSON: step, resolved config, model (architecture), compute, format
    <dir>/<step>/data/        JSON: the Grain iterator state

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves nothing that `latest_step` will pick up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from engine.config import ConfigError
from engine.contract import CHECKPOINT_FORMAT
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import abstract_model_params

ITEMS = ("params", "opt_state", "meta", "data")


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict, data_state: dict | None) -> None:
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
            data=ocp.args.JsonSave(data_state or {}),
        )
        self.manager.save(step, args=args, force=True)

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
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_params(directory: str | Path, step: int, params, meta: dict) -> None:
    """A params-only checkpoint (no optimizer or data state), as a Hugging Face conversion writes one:
    load_params and `checkpoint.init_from` read it; a run cannot resume from it.

    `params` are numpy arrays, written as they are: no defensive copy (Orbax's default
    doubles peak memory) and no zstd (it costs more time than the fifth of the disk it saves
    on weights). Do not modify them until this returns.
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)))
    handlers = {"params": ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry),
                "meta": ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(
        Path(directory).absolute(), item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
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
    meta.update(model=model, compute=ComputeConfig.model_validate(compute).model_dump(mode="json"),
                format=CHECKPOINT_FORMAT)
    return meta


def read_meta(directory: str | Path, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest (or given) checkpoint in `directory`, meta normalised."""
    directory = Path(directory).absolute()
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


def load_params(directory: str | Path, abstract_params=None, step: int | None = None) -> tuple[ModelConfig, Any, int]:
    """Params of the latest checkpoint in `directory`: (model config, params, step).

    `abstract_params` (ShapeDtypeStructs with shardings) places them on a mesh, in the dtypes
    asked for; by default they are restored with the shapes and dtypes they were saved with,
    on the default device.
    """
    step, meta = read_meta(directory, step)
    model_cfg = ModelConfig.model_validate(meta["model"])
    if abstract_params is None:
        abstract_params = abstract_model_params(model_cfg, ComputeConfig.model_validate(meta["compute"]), mesh=None)
    manager = ocp.CheckpointManager(
        Path(directory).absolute(), item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    manager.close()
    return model_cfg, restored.params, step
