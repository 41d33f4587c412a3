"""LoRA adapters on the model's projections, and the split of a param tree into the adapter
(what trains) and the frozen base.

A targeted projection w (its first `n_in` axes the input, the rest the output) gets two
parameters beside it in the same module: `<w>_lora_a` (in..., r) and `<w>_lora_b` (r, out...),
and computes x.w + scale * ((x.A).B), never the merged w + scale * A.B: the base's weight
gradient is never formed (the base is not differentiated at all) and a rollout samples from
base + adapter with no merged copy. A and B carry the base's logical axis names on their
input and output axes (the rank axis is replicated), so they shard as their base does on
any mesh; stacked layers give them the `layers` axis too.

Initialisation is PEFT's: A Kaiming-uniform (bound 1 / sqrt(fan_in), torch's default for
nn.Linear), B zero, so a fresh adapter leaves the model unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from engine.models.config import LORA_ATTENTION_TARGETS, LORA_MLP_TARGETS, LORA_WEIGHTS
from engine.ops.dense import dense

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")

WEIGHTS = LORA_WEIGHTS
ATTENTION_WEIGHTS = {m: WEIGHTS[m] for m in LORA_ATTENTION_TARGETS}
MLP_WEIGHTS = {m: WEIGHTS[m] for m in LORA_MLP_TARGETS}
PER_LAYER_INPUT_WEIGHTS = {m: WEIGHTS[m] for m in ("per_layer_input_gate", "per_layer_projection")}
"""Gemma 4's per-layer inputs: each layer's gate and projection (the Block's)."""
MODEL_WEIGHTS = {m: WEIGHTS[m] for m in ("per_layer_model_projection",)}
"""The model's own adaptable projections, outside the layers (Gemma 4's per-layer-input projection)."""


def add_adapters(module: nnx.Module, targets: dict[str, tuple[str, int]], build, rngs: nnx.Rngs) -> None:
    """Give each of `module`'s weights that the run's adapter targets its A and B (created
    after the base weights, so the base initialises as without an adapter only when none is
    targeted). `build`: the block's common.Build (its lora and lora_targets), or None for no
    adapter here."""
    lora = None if build is None else build.lora
    module.lora_scale = None if lora is None else lora.scale
    module.lora_dropout = 0.0 if lora is None else lora.dropout
    if lora is None:
        return
    wanted = build.lora_targets
    for peft_name, (attr, n_in) in targets.items():
        if peft_name not in wanted or not hasattr(module, attr):  # (Gemma 4's global layers have no v_proj)
            continue
        base: nnx.Param = getattr(module, attr)
        names = base.get_metadata().get("out_sharding") or (None,) * base.ndim
        in_shape, out_shape = base.shape[:n_in], base.shape[n_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
        setattr(module, attr + "_lora_a", nnx.Param(a.astype(base.dtype), out_sharding=(*names[:n_in], None)))
        setattr(
            module,
            attr + "_lora_b",
            nnx.Param(jnp.zeros((lora.rank, *out_shape), base.dtype), out_sharding=(None, *names[n_in:])),
        )


def has_adapter(module: nnx.Module, attr: str) -> bool:
    return hasattr(module, attr + "_lora_a")


def lora_delta(module: nnx.Module, attr: str, x, n_in: int, dtype, **dense_kw):
    """scale * ((dropout(x) . A) . B) of `module`'s adapter on `attr`, in `dtype` (dropout
    only in a training step, `dropout_rows`)."""
    if module.lora_dropout:
        x = _dropout(x, attr, module.lora_dropout)
    a = getattr(module, attr + "_lora_a")[...].astype(dtype)
    b = getattr(module, attr + "_lora_b")[...].astype(dtype)
    return dense(dense(x, a, n_in, **dense_kw), b, 1, **dense_kw) * jnp.asarray(module.lora_scale, dtype)


def weight_value(variable: nnx.Variable, dtype):
    """A weight's value in `dtype`, dequantized where a QLoRA base holds it quantized
    (engine/models/quantize.py): read one layer at a time, inside the layer scan."""
    value = variable.get_value()
    return (qwix.dequantize(value) if isinstance(value, qwix.QArray) else value).astype(dtype)


def project_shared(module: nnx.Module, attrs: tuple[str, ...], x, dtype, **dense_kw) -> list:
    """[x . w (+ its update)] for projections of the same input x (one input axis): the adapted
    ones' x . A run as one product over their A's side by side (q, k, v; gate, up), which on
    CPU is markedly cheaper than one thin rank-r product each."""
    adapted = [attr for attr in attrs if has_adapter(module, attr)]
    if len(adapted) < 2 or any(getattr(module, "lora_dropout", 0.0) for _ in adapted):
        return [project(module, attr, x, 1, dtype, **dense_kw) for attr in attrs]
    a = jnp.concatenate([getattr(module, attr + "_lora_a")[...].astype(dtype) for attr in adapted], axis=-1)
    xa = jnp.split(dense(x, a, 1, **dense_kw), len(adapted), axis=-1)
    scale = jnp.asarray(module.lora_scale, dtype)
    deltas = {
        attr: dense(part, getattr(module, attr + "_lora_b")[...].astype(dtype), 1, **dense_kw) * scale
        for attr, part in zip(adapted, xa)
    }
    out = []
    for attr in attrs:
        y = dense(x, weight_value(getattr(module, attr), dtype), 1, **dense_kw)
        out.append(y + deltas[attr] if attr in deltas else y)
    return out


def project(module: nnx.Module, attr: str, x, n_in: int, dtype, **dense_kw):
    """x . w (+ the adapter's update where `attr` has one): every adaptable projection's product."""
    y = dense(x, weight_value(getattr(module, attr), dtype), n_in, **dense_kw)
    return y + lora_delta(module, attr, x, n_in, dtype, **dense_kw) if has_adapter(module, attr) else y


# --------------------------------------------------------------------------- dropout
#
# PEFT drops the adapter's input (inverted dropout: kept values scaled by 1 / (1 - p)) in
# training only. Here each row of a training batch carries a seed (`lora_seed`, drawn from the
# run's seed and the step by the trainer), and a row's mask at a projection is drawn from
# (its seed, the layer's index, the projection): the same whatever the mesh or process count,
# and the same again when a resumed run redoes the step. Where no seeds are set (evaluation,
# sampling, the log-probs of a rollout) nothing is dropped.

LORA_SEED = "lora_seed"
"""The batch key of the rows' dropout seeds (int32, (rows, 1): sharded as the rows are)."""
_ROW_SEEDS: contextvars.ContextVar = contextvars.ContextVar("lora_row_seeds", default=None)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("lora_layer", default=None)
_ATTR_IDS = {attr: i for i, (attr, _) in enumerate(WEIGHTS.values())}


@contextlib.contextmanager
def dropout_rows(seeds_b):
    """Turn LoRA dropout on, inside a traced training loss, with one seed per batch row (or
    None: off)."""
    token = _ROW_SEEDS.set(seeds_b)
    try:
        yield
    finally:
        _ROW_SEEDS.reset(token)


@contextlib.contextmanager
def in_layer(index):
    """The model's layer index (a traced int inside the layer scan) while a block runs."""
    token = _LAYER.set(index)
    try:
        yield
    finally:
        _LAYER.reset(token)


def current_layer():
    """The model's layer index set by `in_layer` (None outside the decoder's blocks)."""
    return _LAYER.get()


def _dropout(x, attr: str, rate: float):
    seeds_b = _ROW_SEEDS.get()
    if seeds_b is None:
        return x
    layer = _LAYER.get()
    layer = 0 if layer is None else layer

    def row_mask(seed):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), layer), _ATTR_IDS[attr])
        return jax.random.bernoulli(key, 1.0 - rate, x.shape[1:])

    keep = jax.vmap(row_mask)(seeds_b.reshape(-1).astype(jnp.uint32))
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


# --------------------------------------------------------------------------- param trees


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


def split_adapter(tree: dict) -> tuple[dict, dict]:
    """(adapter, base) of a nested param dict: the A/B leaves, and everything else."""
    adapter, base = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub_adapter, sub_base = split_adapter(value)
            if sub_adapter:
                adapter[key] = sub_adapter
            if sub_base:
                base[key] = sub_base
        elif is_adapter_key(str(key)):
            adapter[key] = value
        else:
            base[key] = value
    return adapter, base


def join(adapter: dict, base: dict) -> dict:
    """The union of two nested dicts with disjoint leaves (split_adapter's inverse). No array
    is copied: the model reads base and adapter side by side."""
    out = dict(base)
    for key, value in adapter.items():
        out[key] = join(value, base[key]) if isinstance(value, dict) and key in base else value
    return out


def merge_into_base(params: dict, scale: float) -> dict:
    """A plain param tree (numpy) whose adapted weights are w + scale * A.B: the adapter folded
    in (`merge`, `export --merged`). `params` holds base and adapter joined; each layer's sum is
    computed in float64 and stored in w's dtype."""
    out: dict[Any, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = merge_into_base(value, scale)
        elif is_adapter_key(str(key)):
            continue
        elif (str(key) + "_lora_a") in params:
            a = np.asarray(params[str(key) + "_lora_a"])
            b = np.asarray(params[str(key) + "_lora_b"])
            w = np.asarray(value)
            lead = a.ndim + b.ndim - w.ndim - 2  # the stacked layers' axis, if any
            r = a.shape[-1]
            a2, b2 = a.reshape(-1, *a.shape[lead:]), b.reshape(-1, *b.shape[lead:])
            merged = np.empty_like(w)
            # One layer at a time: float64 copies of the whole stacked weight would take eight
            # times its float32 bytes on the host (15 GB for one of llama3.1-8b's MLP stacks).
            for i, (w_i, a_i, b_i) in enumerate(zip(w.reshape(-1, *w.shape[lead:]), a2, b2)):
                delta = a_i.reshape(-1, r).astype(np.float64) @ b_i.reshape(r, -1).astype(np.float64)
                merged.reshape(-1, *w.shape[lead:])[i] = w_i.astype(np.float64) + scale * delta.reshape(w_i.shape)
            out[key] = merged
        else:
            out[key] = value
    return out
