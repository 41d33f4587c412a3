"""What every layer of the model shares: the dtypes by name, the one weight initialiser, the
gate activations of the gated MLPs (dense and expert), and RMSNorm."""

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


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Nemotron-H's MLP
}


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, in float32. Zero-centred (Gemma): * (1 + scale), scale starting at 0."""

    def __init__(
        self,
        dim: int,
        eps: float,
        param_dtype,
        *,
        zero_centered: bool = False,
        heads: tuple[int, str] | None = None,
        rngs: nnx.Rngs,
    ):
        """`heads` (count, logical name): normalise the last two axes (heads, dim) as one
        vector, with a scale per (head, dim) (OLMo 2's QK norm over all heads)."""
        init = jnp.zeros if zero_centered else jnp.ones
        shape, names = ((heads[0], dim), (heads[1], "head_dim")) if heads else ((dim,), ("norm",))
        self.scale = nnx.Param(init(shape, param_dtype), out_sharding=names)
        self.eps, self.zero_centered, self.axes = eps, zero_centered, len(shape)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        axes = tuple(range(-self.axes, 0))
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x32 * (1.0 + scale if self.zero_centered else scale)).astype(x.dtype)
