"""fp8 and int8 training of the model's matmuls (ComputeConfig.matmul_precision), through qwix.

Each recipe is one qwix `DotGeneralQtConfig`: a dot_general whose operands are quantized
where it is traced and whose custom VJP quantizes the backward's products too.

    fp8   forward operands float8_e4m3fn, incoming gradients float8_e5m2 (MaxText's
          `quantization: fp8_full`, torchtitan's and Transformer Engine's formats)
    int8  every operand int8, forward and backward (MaxText's `quantization: int8`: AQT-style
          quantization-aware training), accumulated in int32

Scaling is current (dynamic) absmax scaling: each scale is the absolute maximum of the
tensor it quantizes, taken in the same step, per channel as qwix lays channels out for a
product: per token for an activation, per output channel for a weight, per row of the
gradient's product. Delayed scaling (a history of past maxima carried in the train state,
Transformer Engine's older default) is not offered: it needs state beside the parameters,
and the current-scaling recipes (torchtitan's tensorwise/rowwise, MaxText's fp8_full) are
what the anchors train with today.

The hardware sees the narrow types: an fp8 x fp8 or int8 x int8 dot_general, which TPU
v5p/v6e and H100/H200 run natively and XLA:CPU emulates (slower than bf16 there: on CPU the
recipes are for checking numerics, not speed). The products quantized are the trainable
projections (attention, MLA, the dense MLP and shared experts, LoRA's adapters and base);
the LM head, the MoE router and the experts' grouped matmuls, and attention's own QK^T / PV
stay in the compute dtype, as in torchtitan and MaxText.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt

MatmulPrecision = Literal["default", "fp8", "int8"]
RECIPES: dict[str, DotGeneralQtConfig] = {
    "fp8": DotGeneralQtConfig(
        lhs_qtype=jnp.float8_e4m3fn,
        rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2,
        drhs_grad_qtype=jnp.float8_e5m2,
    ),
    "int8": DotGeneralQtConfig(
        lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8
    ),
}
"""Recipe name -> qwix's configuration of its quantized dot_general (absmax, channelwise)."""


def _quantized(config: DotGeneralQtConfig, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general's signature over qwix's quantized product: the result comes out in
    the operands' dtype (the narrow accumulator rescaled once), widened if asked."""
    out = dot_general_qt(lhs, rhs, dimension_numbers, config)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


@functools.cache
def dot_general(precision: str):
    """The dot_general of a recipe ("fp8", "int8"); None for "default" (the plain product).
    Cached, so one recipe is one function (and one trace) everywhere."""
    if precision == "default":
        return None
    return functools.partial(_quantized, RECIPES[precision])


def fake_quantize(x: jax.Array, qtype, axes: tuple[int, ...]) -> jax.Array:
    """x rounded to `qtype` with an absmax scale over `axes` (kept as 1s), back in float32: the
    quantization written out by hand, the reference the tests check qwix's products against.
    An integer type's bound is its max + 0.5 (its top bucket used whole), as in qwix."""
    x = x.astype(jnp.float32)
    integer = jnp.issubdtype(qtype, jnp.integer)
    bound = jnp.iinfo(qtype).max + 0.5 if integer else float(jnp.finfo(qtype).max)
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / bound
    scale = jnp.where(scale < jnp.sqrt(jnp.finfo(jnp.float32).tiny), 1.0, scale)
    scaled = x / scale
    if integer:
        q = jnp.clip(jnp.round(scaled), jnp.iinfo(qtype).min, jnp.iinfo(qtype).max)
    else:
        q = jnp.clip(scaled, -bound, bound).astype(qtype).astype(jnp.float32)
    return q * scale
