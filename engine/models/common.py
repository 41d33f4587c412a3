"""What every layer of the model shares: the dtypes by name, the one weight initialiser, and
the gate activations of the gated MLPs (dense and expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def dtype_of(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def param(rngs: nnx.Rngs, shape, std: float, names, dtype) -> nnx.Param:
    """All weight matrices are initialised here: N(0, std^2), the GPT-2/Llama recipe."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=names)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
