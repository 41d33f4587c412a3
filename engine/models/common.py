"""What every layer of the model shares: what a block is built with beside its spec (Build),
the dtypes by name, the one weight initialiser, the gate activations of the gated MLPs (dense
and expert), and the norms (RMSNorm, LayerNorm) a NormSpec names."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.specs import NormSpec


@dataclasses.dataclass(frozen=True)
class Build:
    """What every block module is built with beside its own spec: the model width, how the run
    computes (dtypes, implementations), the initialisation and the adapters."""

    d_model: int
    compute: ComputeConfig
    init_std: float = 0.02
    depth: int = 1
    """The model's layers: residual-branch outputs start at init_std / sqrt(2 depth) (GPT-2),
    so the stream stays O(1)."""
    dot_general: Any = jax.lax.dot_general
    """Every matmul's product (jax.lax.dot_general, or a quantized one)."""
    lora: LoraConfig | None = None
    model: ModelConfig | None = None
    """The model `lora` adapts (for its targets)."""

    @classmethod
    def of(
        cls, cfg: ModelConfig, compute: ComputeConfig, dot_general=jax.lax.dot_general, lora: LoraConfig | None = None
    ) -> Build:
        return cls(cfg.d_model, compute, cfg.init_std, cfg.num_layers, dot_general, lora, cfg)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The PEFT module names the adapter puts weights on (LoraConfig.targets of the model),
        asked for by a block that has adaptable weights: a model with none of them (every
        projection latent attention or experts) builds without asking."""
        if self.lora is None or self.model is None:
            return ()
        return self.lora.targets(self.model)

    @property
    def lora_weights(self) -> dict[str, str]:
        """{engine weight the adapter adapts: the weight whose A it uses} (LoraConfig.weights)."""
        if self.lora is None or self.model is None:
            return {}
        return self.lora.weights(self.model)

    @property
    def out_std(self) -> float:
        return self.init_std / math.sqrt(2 * self.depth)

    @property
    def param_dtype(self):
        return dtype_of(self.compute.param_dtype)

    @property
    def dtype(self):
        return dtype_of(self.compute.dtype)


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
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf's, torch's nn.GELU()
    "relu": jax.nn.relu,
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


class LayerNorm(nnx.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * scale + bias over the last axis, in float32; the
    scale and the bias each optional (OLMo 1 has neither), the scale zero-centred (Nemotron's
    LayerNorm1P: * (1 + scale))."""

    def __init__(self, dim: int, spec: NormSpec, param_dtype, *, rngs: nnx.Rngs, heads: tuple[int, str] | None = None):
        """`heads` (count, logical name): a scale per (head, dim), each head normalised over its
        own dims (StableLM 2's and Cohere's QK norms); no bias then."""
        shape, names = ((heads[0], dim), (heads[1], "head_dim")) if heads else ((dim,), ("norm",))
        assert not (heads and spec.bias), "a per-head LayerNorm has no bias"
        if spec.scale:
            init = jnp.zeros if spec.zero_centered else jnp.ones
            self.scale = nnx.Param(init(shape, param_dtype), out_sharding=names)
        if spec.bias:
            self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=("norm",))
        self.eps, self.zero_centered, self.has_scale, self.has_bias = (
            spec.eps,
            spec.zero_centered,
            spec.scale,
            spec.bias,
        )

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centred = x32 - mean
        x32 = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        if self.has_scale:
            scale = self.scale[...].astype(jnp.float32)
            x32 = x32 * (1.0 + scale if self.zero_centered else scale)
        if self.has_bias:
            x32 = x32 + self.bias[...].astype(jnp.float32)
        return x32.astype(x.dtype)


def make_norm(spec: NormSpec, dim: int, param_dtype, *, rngs: nnx.Rngs, heads: tuple[int, str] | None = None):
    """The norm a NormSpec describes over `dim`; with `heads`, a scale per (head, dim): an
    RMSNorm over (heads, dim) at once (OLMo 2), a LayerNorm over each head's dim (StableLM 2)."""
    if spec.kind == "layer":
        return LayerNorm(dim, spec, param_dtype, rngs=rngs, heads=heads)
    return RMSNorm(dim, spec.eps, param_dtype, zero_centered=spec.zero_centered, heads=heads, rngs=rngs)
