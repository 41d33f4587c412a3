"""The gated short convolution mixer kind (`short_conv`): LFM2's convolution layers, as
transformers 5.25 defines them (Lfm2ShortConv).

Per layer: x -> in_proj -> B, C, x~ (each the model width); y = C * conv(B * x~), conv a
depthwise causal convolution of `conv_kernel` taps (no activation); out_proj(y). Its work is
linear in the sequence and needs no chunking: training is the convolution over all positions
at once, decoding one token through it with the last conv_kernel - 1 gated inputs as the
state (registered in kv_cache.DECODE_STATES), which the KV cache carries in place of this
layer's keys and values.

Padding tokens (segment id 0) are zeroed on input, as transformers does; in packed rows the
convolution restarts at each document (segment ids), as attention's mask does. Shapes: b
batch, t time, d model width, c the convolution's channels (d).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, dtype_of, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.lora import SHORT_CONV_WEIGHTS, add_adapters, project
from engine.models.specs import ShortConvSpec
from engine.ops.linear_mixing import causal_conv1d


def initial_state(spec: ShortConvSpec, compute: ComputeConfig, batch: int) -> jax.Array:
    """A sequence's decoding state before its first token: the convolution's window, its last
    conv_kernel - 1 inputs (b, conv_kernel - 1, c), zeros in the compute dtype."""
    return jnp.zeros((batch, spec.conv_kernel - 1, spec.width), dtype_of(compute.dtype))


DECODE_STATES["short_conv"] = initial_state


class ShortConv(nnx.Module):
    """The mixer of a `short_conv` layer; called as transformer.Attention is (positions and
    RoPE ignored), and with a cache reads and writes its layer's window. No LoRA on its
    projections (PEFT's Llama names do not name them)."""

    def __init__(self, spec: ShortConvSpec, build: Build, *, rngs: nnx.Rngs):
        d, c, pdt = build.d_model, spec.width, build.param_dtype
        # in_proj's rows are B, then C, then x (transformers' chunk(3)): (d, 3, c) keeps a channel's three together
        self.w_in_d3c = param(rngs, (d, 3, c), build.init_std, ("embed", None, "mlp"), pdt)
        # torch's Conv1d default (kaiming uniform over the kernel's fan-in), in HF's (c, 1, K) layout
        bound = 1.0 / math.sqrt(spec.conv_kernel)
        conv = jax.random.uniform(rngs.params(), (c, 1, spec.conv_kernel), jnp.float32, -bound, bound)
        self.conv_c1k = nnx.Param(conv.astype(pdt), out_sharding=("mlp", None, None))
        self.w_out_cd = param(rngs, (c, d), build.out_std, ("mlp", "embed"), pdt)
        if spec.bias:
            self.b_in_3c = nnx.Param(jnp.zeros((3, c), pdt), out_sharding=(None, "mlp"))
            self.conv_bias_c = nnx.Param(jnp.zeros((c,), pdt), out_sharding=("mlp",))
            self.b_out_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.bias, self.dtype = spec.bias, build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general
        add_adapters(self, SHORT_CONV_WEIGHTS, build, rngs)  # in_proj, out_proj

    def _dense(self, x, attr: str):
        return project(self, attr, x, 1, self.dtype, backward=self.matmul_backward, dot_general=self.dot_general)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: ShortConvSpec, cache: KVCache | None = None):
        """(b, t, d); with a cache (decoding) (out, the cache with this layer's window advanced)."""
        if segment_ids_bt is not None:  # padding tokens contribute nothing (transformers zeroes them)
            x_btd = x_btd * (segment_ids_bt != 0)[..., None].astype(x_btd.dtype)
        bcx_bt3c = self._dense(x_btd, "w_in_d3c")
        if self.bias:
            bcx_bt3c = bcx_bt3c + self.b_in_3c[...].astype(self.dtype)
        b_btc, c_btc, x_btc = bcx_bt3c[:, :, 0], bcx_bt3c[:, :, 1], bcx_bt3c[:, :, 2]
        window = None if cache is None else cache.states[cache.layer]
        conv_kc = self.conv_c1k[...][:, 0, :].T.astype(self.dtype)
        conv_bias = self.conv_bias_c[...].astype(self.dtype) if self.bias else None
        conv_btc, window = causal_conv1d(
            b_btc * x_btc,
            conv_kc,
            conv_bias,
            window_bkc=window,
            activation=False,
            segment_ids_bt=segment_ids_bt,
        )
        out_btd = self._dense(c_btc * conv_btc, "w_out_cd")
        if self.bias:
            out_btd = out_btd + self.b_out_d[...].astype(self.dtype)
        if cache is None:
            return out_btd
        states = list(cache.states)
        states[cache.layer] = window.astype(cache.states[cache.layer].dtype)
        return out_btd, dataclasses.replace(cache, states=tuple(states))
