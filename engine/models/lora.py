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

import math

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from engine.models.config import LORA_ATTENTION_TARGETS, LORA_MLP_TARGETS, LORA_WEIGHTS, LoraConfig, ModelConfig
from engine.ops.dense import dense

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")

WEIGHTS = LORA_WEIGHTS
ATTENTION_WEIGHTS = {m: WEIGHTS[m] for m in LORA_ATTENTION_TARGETS}
MLP_WEIGHTS = {m: WEIGHTS[m] for m in LORA_MLP_TARGETS}


def add_adapters(module: nnx.Module, targets: dict[str, tuple[str, int]], lora: LoraConfig | None,
                 model: ModelConfig, rngs: nnx.Rngs) -> None:
    """Give each of `module`'s weights that `lora` targets its A and B (created after the base
    weights, so the base initialises as without an adapter only when none is targeted)."""
    module.lora_scale = None if lora is None else lora.scale
    if lora is None:
        return
    wanted = lora.targets(model)
    for peft_name, (attr, n_in) in targets.items():
        if peft_name not in wanted:
            continue
        base: nnx.Param = getattr(module, attr)
        names = base.get_metadata().get("out_sharding") or (None,) * base.ndim
        in_shape, out_shape = base.shape[:n_in], base.shape[n_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
        setattr(module, attr + "_lora_a", nnx.Param(a.astype(base.dtype), out_sharding=(*names[:n_in], None)))
        setattr(module, attr + "_lora_b", nnx.Param(jnp.zeros((lora.rank, *out_shape), base.dtype),
                                                    out_sharding=(None, *names[n_in:])))


def has_adapter(module: nnx.Module, attr: str) -> bool:
    return hasattr(module, attr + "_lora_a")


def lora_delta(module: nnx.Module, attr: str, x, n_in: int, dtype, **dense_kw):
    """scale * ((x . A) . B) of `module`'s adapter on `attr`, in `dtype`."""
    a = getattr(module, attr + "_lora_a")[...].astype(dtype)
    b = getattr(module, attr + "_lora_b")[...].astype(dtype)
    return dense(dense(x, a, n_in, **dense_kw), b, 1, **dense_kw) * jnp.asarray(module.lora_scale, dtype)


def weight_value(variable: nnx.Variable, dtype):
    """A weight's value in `dtype`, dequantized where a QLoRA base holds it quantized
    (engine/models/quantize.py): read one layer at a time, inside the layer scan."""
    value = variable.get_value()
    return (qwix.dequantize(value) if isinstance(value, qwix.QArray) else value).astype(dtype)


def project(module: nnx.Module, attr: str, x, n_in: int, dtype, **dense_kw):
    """x . w (+ the adapter's update where `attr` has one): every adaptable projection's product."""
    y = dense(x, weight_value(getattr(module, attr), dtype), n_in, **dense_kw)
    return y + lora_delta(module, attr, x, n_in, dtype, **dense_kw) if has_adapter(module, attr) else y


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
    in (`merge`, `export --merged`). `params` holds base and adapter joined; computed in float64
    and cast to w's dtype."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = merge_into_base(value, scale)
        elif is_adapter_key(str(key)):
            continue
        elif (str(key) + "_lora_a") in params:
            a = np.asarray(params[str(key) + "_lora_a"], np.float64)
            b = np.asarray(params[str(key) + "_lora_b"], np.float64)
            w = np.asarray(value)
            lead = a.ndim + b.ndim - w.ndim - 2  # the stacked layers' axis, if any
            r = a.shape[-1]
            a2 = a.reshape(*a.shape[:lead], -1, r)
            b2 = b.reshape(*b.shape[:lead], r, -1)
            delta = (a2 @ b2).reshape(w.shape)
            out[key] = (w.astype(np.float64) + scale * delta).astype(w.dtype)
        else:
            out[key] = value
    return out
