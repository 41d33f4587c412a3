"""LoRA adapters on the model's projections, and the split of a param tree into the adapter
(what trains) and the frozen base.

A targeted projection w (its first `n_in` axes the input, the rest the output) gets two
parameters beside it in the same module: `<w>_lora_a` (in..., r) and `<w>_lora_b` (r, out...)
(the parts of one fused HF module, GPT-NeoX's query_key_value, share the first part's A and
each has its own B: engine/models/lora_targets.py), and computes
x.w + scale * ((x.A).B), never the merged w + scale * A.B: the base's weight
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

from engine.models.lora_targets import ATTENTION_WEIGHTS as ATTENTION_WEIGHTS  # each module's table, re-exported
from engine.models.lora_targets import MAMBA_WEIGHTS as MAMBA_WEIGHTS
from engine.models.lora_targets import MLA_WEIGHTS as MLA_WEIGHTS
from engine.models.lora_targets import MLP_WEIGHTS as MLP_WEIGHTS
from engine.models.lora_targets import MODEL_WEIGHTS as MODEL_WEIGHTS
from engine.models.lora_targets import PER_LAYER_INPUT_WEIGHTS as PER_LAYER_INPUT_WEIGHTS
from engine.models.lora_targets import SHORT_CONV_WEIGHTS as SHORT_CONV_WEIGHTS
from engine.models.lora_targets import WEIGHTS
from engine.ops.dense import dense

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def add_adapters(module: Any, weights: dict[str, int], build, rngs: nnx.Rngs) -> None:
    """Give each of `module`'s weights (name -> its input axes) that the run's adapter targets
    its A (unless it shares another's: a fused HF module's later parts) and B, created after
    the base weights, so the base initialises as without an adapter only when none is
    targeted. `build`: the block's common.Build (its lora and lora_weights), or None for no
    adapter here."""
    lora = None if build is None else build.lora
    module.lora_scale = None if lora is None else lora.scale
    module.lora_dropout = 0.0 if lora is None else lora.dropout
    module.lora_shared = ()  # (weight, the weight whose A it uses) pairs
    if lora is None:
        return
    wanted = build.lora_weights
    shared = []
    for attr, n_in in weights.items():
        if attr not in wanted or not hasattr(module, attr):  # (Gemma 4's global layers have no v_proj)
            continue
        base: nnx.Param = getattr(module, attr)
        names = base.get_metadata().get("out_sharding") or (None,) * base.ndim
        in_shape, out_shape = base.shape[:n_in], base.shape[n_in:]
        if wanted[attr] == attr:
            bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
            a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
            setattr(module, attr + "_lora_a", nnx.Param(a.astype(base.dtype), out_sharding=(*names[:n_in], None)))
        else:
            shared.append((attr, wanted[attr]))
        setattr(
            module,
            attr + "_lora_b",
            nnx.Param(jnp.zeros((lora.rank, *out_shape), base.dtype), out_sharding=(None, *names[n_in:])),
        )
    assert all(has_adapter(module, owner) for _, owner in shared), f"{shared}: a shared A outside its module"
    module.lora_shared = tuple(shared)


def has_adapter(module: nnx.Module, attr: str) -> bool:
    return hasattr(module, attr + "_lora_b")


def a_owner(module: nnx.Module, attr: str) -> str:
    """The weight whose A `attr`'s adapter uses: its own, or its fused HF module's first part's."""
    return dict(getattr(module, "lora_shared", ())).get(attr, attr)


def _input_times_a(module: Any, owner: str, x, n_in: int, dtype, **dense_kw):
    """dropout(x) . A of the adapter whose A is `owner`'s (one mask per A: PEFT drops a fused
    module's input once)."""
    if module.lora_dropout:
        x = _dropout(x, owner, module.lora_dropout)
    return dense(x, getattr(module, owner + "_lora_a")[...].astype(dtype), n_in, **dense_kw)


def lora_delta(module: Any, attr: str, x, n_in: int, dtype, **dense_kw):
    """scale * ((dropout(x) . A) . B) of `module`'s adapter on `attr`, in `dtype` (dropout
    only in a training step, `dropout_rows`)."""
    xa = _input_times_a(module, a_owner(module, attr), x, n_in, dtype, **dense_kw)
    b = getattr(module, attr + "_lora_b")[...].astype(dtype)
    return dense(xa, b, 1, **dense_kw) * jnp.asarray(module.lora_scale, dtype)


def adapted_weight(module: Any, attr: str, n_in: int, dtype):
    """w + scale * A.B in `dtype`: for a weight the layer reads as a matrix rather than as one
    product of its input (latent attention's kv_b_proj, absorbed into its scores;
    lora_targets.FOLDED), so no dropout applies. The base is not differentiated."""
    w = weight_value(getattr(module, attr), dtype)
    if not has_adapter(module, attr):
        return w
    a = getattr(module, a_owner(module, attr) + "_lora_a")[...].astype(dtype)
    b = getattr(module, attr + "_lora_b")[...].astype(dtype)
    delta = jnp.tensordot(a, b, axes=1) * jnp.asarray(module.lora_scale, dtype)
    assert delta.shape == w.shape and n_in >= 1
    return w + delta


def weight_value(variable: nnx.Variable, dtype):
    """A weight's value in `dtype`, dequantized where a QLoRA base holds it quantized
    (engine/models/quantize.py): read one layer at a time, inside the layer scan."""
    value = variable.get_value()
    return (qwix.dequantize(value) if isinstance(value, qwix.QArray) else value).astype(dtype)


def project_shared(module: Any, attrs: tuple[str, ...], x, dtype, **dense_kw) -> list:
    """[x . w (+ its update)] for projections of the same input x (one input axis): each A's
    x . A computed once (the parts of a fused HF module share one), and without dropout the
    distinct A's side by side in one product (q, k, v; gate, up), which on CPU is markedly
    cheaper than one thin rank-r product each."""
    adapted = [attr for attr in attrs if has_adapter(module, attr)]
    if not adapted:
        return [project(module, attr, x, 1, dtype, **dense_kw) for attr in attrs]
    owners = list(dict.fromkeys(a_owner(module, attr) for attr in adapted))
    if len(owners) < 2 or module.lora_dropout:
        xa = {owner: _input_times_a(module, owner, x, 1, dtype, **dense_kw) for owner in owners}
    else:
        a = jnp.concatenate([getattr(module, owner + "_lora_a")[...].astype(dtype) for owner in owners], axis=-1)
        xa = dict(zip(owners, jnp.split(dense(x, a, 1, **dense_kw), len(owners), axis=-1)))
    scale = jnp.asarray(module.lora_scale, dtype)
    deltas = {
        attr: dense(xa[a_owner(module, attr)], getattr(module, attr + "_lora_b")[...].astype(dtype), 1, **dense_kw)
        * scale
        for attr in adapted
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
_ATTR_IDS = {attr: i for i, attr in enumerate(WEIGHTS)}


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


def merge_into_base(params: dict, scale: float, owners: dict[str, str] | None = None) -> dict:
    """A plain param tree (numpy) whose adapted weights are w + scale * A.B: the adapter folded
    in (`merge`, `export --merged`). `params` holds base and adapter joined; `owners`: which
    weights use another's A (LoraConfig.weights; None: each its own). Each layer's sum is
    computed in float64 and stored in w's dtype."""
    out: dict[Any, Any] = {}
    owners = owners or {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = merge_into_base(value, scale, owners)
        elif is_adapter_key(str(key)):
            continue
        elif (str(key) + "_lora_b") in params:
            a = np.asarray(params[owners.get(str(key), str(key)) + "_lora_a"])
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
