"""A reward model's checkpoint read back: the decoder with its score head, as host arrays.

The heads' names and the meta's format are here, below the stages that train reward models
(engine/posttrain/reward_model.py, process_reward.py) and the Hugging Face converter that
writes and reads their *ForSequenceClassification form (engine/interop/hf/sequence_classification.py).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from engine.config import ConfigError
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.lora import join, merge_into_base, split_adapter
from engine.models.params import abstract_model_params
from engine.train.bucket_paths import checkpoint_path
from engine.train.checkpoint import ITEMS, adapter_base, load_params, read_meta

HEAD = "score_d"
"""The score head's leaf in the params tree: (d_model,), logical axis `embed`."""
PROCESS_HEAD = "score_dl"
"""A process reward model's token classifier: (d_model, 2), logical axes (embed, None)."""
LABELS = 2
REWARD_MODEL_FORMAT = "trainflow.reward_model/1"


def decoder_of(params: dict) -> dict:
    """The decoder's (or adapter's) tree without the head."""
    return {k: v for k, v in params.items() if k not in (HEAD, PROCESS_HEAD)}


def is_reward_model(directory: str | Path, step: int | None = None) -> bool:
    return bool(read_meta(directory, step)[1].get("reward_model"))


def load_reward_params(
    directory: str | Path, step: int | None = None, *, allow_process: bool = False
) -> tuple[ModelConfig, ComputeConfig, dict, int, dict]:
    """(architecture, compute settings, params as host numpy arrays with the head, step, meta)
    of a reward-model checkpoint; a LoRA one comes with its adapter folded into its base. A
    process reward model (head `score_dl`) only where `allow_process` (GRPO's scorer)."""
    step, meta = read_meta(directory, step)
    if not meta.get("reward_model"):
        raise ConfigError(
            f"{directory}: is not a reward model (its checkpoint meta has no 'reward_model'); "
            "train one with a reward_model stage or convert a *ForSequenceClassification"
        )
    head = meta["reward_model"].get("head", HEAD)
    if head == PROCESS_HEAD and not allow_process:
        raise ConfigError(
            f"{directory}: is a process reward model (a token-classification head per step), which has no "
            "*ForSequenceClassification form; it is read by GRPO's reward terms only"
        )
    model_cfg, compute = ModelConfig.model_validate(meta["model"]), ComputeConfig.model_validate(meta["compute"])
    lora = None
    if meta.get("lora"):
        lora = LoraConfig.model_validate({k: v for k, v in meta["lora"].items() if k in LoraConfig.model_fields})
    shapes = abstract_model_params(model_cfg, compute, None, lora)
    if lora is not None:
        shapes = split_adapter(shapes)[0]
    head_shape = (model_cfg.d_model, LABELS) if head == PROCESS_HEAD else (model_cfg.d_model,)
    shapes[head] = jax.ShapeDtypeStruct(head_shape, jax.tree.leaves(shapes)[0].dtype)
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), shapes)
    manager = ocp.CheckpointManager(
        checkpoint_path(directory), item_names=ITEMS, options=ocp.CheckpointManagerOptions(read_only=True)
    )
    params = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(item=shapes, restore_args=restore_args))
    ).params
    manager.close()
    if lora is not None:
        _, base, _ = load_params(adapter_base(directory, meta), as_numpy=True)
        merged = merge_into_base(join(decoder_of(params), base), lora.scale, lora.weights(model_cfg))
        params = {**merged, head: params[head]}
    return model_cfg, compute, params, step, meta
