"""The Mamba2 sequence mixer (Dao & Gu 2024) as an NNX module: in_proj, the depthwise causal
convolution, dt's bias and softplus, A = -exp(A_log), the skip D, the gated RMSNorm and
out_proj, on engine/ops/ssd.py's SSD chunked scan for training and its one-token step for
decoding. Nemotron-H's, Granite 4's and Falcon-H1's Mamba2 layers are this module; their
tensors are transformers' `mixer.*` / `mamba.*` ones, one engine array each (in_proj fused
as transformers stores it: gate z, then x B C, then dt).

Decoding carries a `Mamba2State` per sequence (the convolution's last K-1 inputs and the
(heads, head_dim, state_size) state) instead of a KV cache. Shapes: b batch, t time, d model
width, p in_proj's width, c convolution channels, k kernel taps, h heads, f heads * head_dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import dtype_of, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.lora import MAMBA_WEIGHTS, add_adapters, has_adapter, lora_delta, project
from engine.models.specs import Mamba2Spec, ParallelHybridSpec
from engine.ops.dense import DotGeneral, dense
from engine.ops.linear_mixing import causal_conv1d
from engine.ops.partitioning import constrain, current_mesh
from engine.ops.ssd import Mamba2Dims, Mamba2State, initial_state, mamba2_inner, mamba2_scan

nnx.use_eager_sharding(False)  # placed by engine/models/params.py, as transformer.py's layers

# transformers' initialisation of the SSM's own parameters (Mamba2PreTrainedModel._init_weights):
# dt drawn log-uniformly in [DT_MIN, DT_MAX] (floored), stored through softplus's inverse.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


def dims_of(m: Mamba2Spec) -> Mamba2Dims:
    """The sizes of a Mamba2 mixer of spec `m` (its gated norm's epsilon the model's)."""
    low, high = m.dt_limit or (0.0, float("inf"))
    dims = Mamba2Dims(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, m.norm_eps, low, high)
    return dims._replace(norm_before_gate=m.norm_before_gate)


def decode_state(spec: Mamba2Spec | ParallelHybridSpec, compute: ComputeConfig, batch: int) -> Mamba2State:
    """A sequence's decoding state before its first token (zeros): the convolution window in
    the compute dtype, the SSM state in float32 (Falcon-H1's parallel layers: their Mamba2's)."""
    m = spec.mamba2 if isinstance(spec, ParallelHybridSpec) else spec
    return initial_state(batch, dims_of(m), dtype_of(compute.dtype))


DECODE_STATES["mamba2"] = DECODE_STATES["attention_mamba2"] = decode_state


class Mamba2(nnx.Module):
    """One Mamba2 mixer: x (b, t, d) -> (b, t, d), and the state after x.

    `bias`: biases on in_proj and out_proj (transformers' use_bias / mamba_proj_bias);
    `conv_bias`: on the convolution. `num_layers` scales out_proj's initial weights down with
    depth, as the attention output's are (engine/models/transformer.py). `gated_norm` False:
    no norm_f, the output y * silu(z). `section_scales`: in_proj's output sections z, x, B, C,
    dt multiplied by these (Falcon-H1's ssm_multipliers); None: not scaled."""

    def __init__(
        self,
        dims: Mamba2Dims,
        d_model: int,
        compute: ComputeConfig,
        *,
        rngs: nnx.Rngs,
        init_std: float = 0.02,
        num_layers: int = 1,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        dot_general: DotGeneral = jax.lax.dot_general,
        gated_norm: bool = True,
        section_scales: tuple[float, ...] | None = None,
    ):
        pdt = dtype_of(compute.param_dtype)
        heads, projected = dims.num_heads, dims.inner + dims.conv_channels + dims.num_heads
        # Tensor parallelism splits heads (see _mix_by_heads). in_proj's columns are z, x, B, C, dt
        # side by side (transformers' layout, kept so checkpoints convert as they are), so no even
        # split of its output axis holds whole heads: it is stored split over `embed` only, and each
        # shard computes its heads' columns of it. out_proj's and the norm's inner axis is heads x
        # head_dim, head-major, so they are stored split by heads.
        self.w_in_dp = param(rngs, (d_model, projected), init_std, ("embed", None), pdt)
        if bias:
            self.b_in_p = nnx.Param(jnp.zeros((projected,), pdt), out_sharding=(None,))
        bound = 1 / math.sqrt(dims.conv_kernel)  # torch's Conv1d default: fan-in = the taps
        conv = jax.random.uniform(rngs.params(), (dims.conv_channels, 1, dims.conv_kernel), jnp.float32, -bound, bound)
        self.conv_c1k = nnx.Param(conv.astype(pdt), out_sharding=(None, None, None))  # torch's Conv1d layout
        if conv_bias:
            self.conv_bias_c = nnx.Param(jnp.zeros((dims.conv_channels,), pdt), out_sharding=(None,))
        log_dt = jax.random.uniform(rngs.params(), (heads,), jnp.float32, math.log(DT_MIN), math.log(DT_MAX))
        dt = jnp.maximum(jnp.exp(log_dt), DT_FLOOR)
        self.dt_bias_h = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(pdt), out_sharding=(None,))
        self.a_log_h = nnx.Param(jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)).astype(pdt), out_sharding=(None,))
        self.d_h = nnx.Param(jnp.ones((heads,), pdt), out_sharding=(None,))
        if gated_norm:
            self.norm_f = nnx.Param(jnp.ones((dims.inner,), pdt), out_sharding=("mlp",))
        out_std = init_std / math.sqrt(2 * num_layers)
        self.w_out_fd = param(rngs, (dims.inner, d_model), out_std, ("mlp", "embed"), pdt)
        if bias:
            self.b_out_d = nnx.Param(jnp.zeros((d_model,), pdt), out_sharding=("embed",))
        self.dims, self.bias, self.conv_bias, self.chunk_size = dims, bias, conv_bias, chunk_size
        self.gated_norm, self.section_scales = gated_norm, section_scales
        self.dtype = dtype_of(compute.dtype)
        self.matmul_backward, self.dot_general = compute.matmul_backward, dot_general

    @classmethod
    def of_spec(cls, m: Mamba2Spec, build, *, rngs: nnx.Rngs) -> Mamba2:
        """The mixer of a `mamba2` layer (transformer.MIXERS; `build` a common.Build)."""
        scales = None if m.projection_multipliers == (1.0,) * 5 else m.projection_multipliers
        mixer = cls(
            dims_of(m),
            build.d_model,
            build.compute,
            rngs=rngs,
            init_std=build.init_std,
            num_layers=build.depth,
            bias=m.proj_bias,
            conv_bias=m.conv_bias,
            chunk_size=m.chunk_size,
            dot_general=build.dot_general,
            gated_norm=m.gated_norm,
            section_scales=scales,
        )
        add_adapters(mixer, MAMBA_WEIGHTS, build, rngs)  # in_proj, out_proj
        return mixer

    def __call__(
        self, x_btd, positions_bt, segment_ids_bt, spec: Mamba2Spec | None = None, cache: KVCache | None = None
    ):
        """Called as transformer.Attention is (positions, window and RoPE flags ignored): (b, t, d),
        or with a cache (decoding) (out, the cache with this layer's state advanced)."""
        state = None if cache is None else cache.states[cache.layer]
        out_btd, state = self.mix(x_btd, segment_ids_bt, state)
        if cache is None:
            return out_btd
        states = list(cache.states)
        states[cache.layer] = state
        return out_btd, dataclasses.replace(cache, states=tuple(states))

    def mix(
        self,
        x_btd: jax.Array,
        segment_ids_bt: jax.Array | None = None,
        state: Mamba2State | None = None,
    ) -> tuple[jax.Array, Mamba2State]:
        """(out (b, t, d) in the compute dtype, state after x). segment_ids_bt: 0 marks padding,
        whose inputs are zeroed before in_proj and after the convolution (transformers'
        attention-mask handling), and a packed row's documents each start from a zero state
        and convolution window; None: one unpadded sequence per row. `state`: carried from earlier tokens
        (decoding; a token at a time takes the recurrent step), None: a sequence's start."""
        dt = self.dtype
        mask_bt = None if segment_ids_bt is None else segment_ids_bt != 0
        if mask_bt is not None:
            x_btd = x_btd * mask_bt[..., None].astype(x_btd.dtype)
        backward, dot_general = self.matmul_backward, self.dot_general
        params = {
            "conv_kc": self.conv_c1k[...][:, 0, :].T.astype(dt),
            "dt_bias": self.dt_bias_h[...].astype(jnp.float32),
            "a_log": self.a_log_h[...],
            "d": self.d_h[...],
        }
        if self.gated_norm:
            params["norm"] = self.norm_f[...].astype(dt)
        if self.conv_bias:
            params["conv_bias"] = self.conv_bias_c[...].astype(dt)
        segments = None if state is not None and x_btd.shape[1] == 1 else segment_ids_bt
        mesh = current_mesh()
        tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
        if tensor > 1:
            y_btf, state = self._mix_by_heads(x_btd.astype(dt), params, mask_bt, segments, state, tensor)
        else:
            projected = project(self, "w_in_dp", x_btd.astype(dt), 1, dt, backward=backward, dot_general=dot_general)
            if self.bias:
                projected = projected + self.b_in_p[...].astype(dt)
            if self.section_scales is not None:  # Falcon-H1's mup_vector, one factor per section
                projected = projected * self._section_vector().astype(dt)
            y_btf, state = mamba2_inner(
                params,
                projected,
                self.dims,
                state=state,
                mask_bt=mask_bt,
                chunk_size=self.chunk_size,
                segment_ids_bt=segments,
            )
        out_btd = project(self, "w_out_fd", y_btf.astype(dt), 1, dt, backward=backward, dot_general=dot_general)
        if self.bias:
            out_btd = out_btd + self.b_out_d[...].astype(dt)
        return out_btd, state

    def _mix_by_heads(self, x_btd, params, mask_bt, segment_ids_bt, state, tensor: int):
        """mix's in_proj, convolution and scan with heads split over the `tensor` mesh axis (the
        same values as the fused path): in_proj's five sections z, x, B, C, dt each its own
        matmul, z, x and dt split by heads, B and C split by groups when `tensor` divides
        n_groups (a group's heads then share its shard) and whole on every shard otherwise; the
        convolution (depthwise: one filter per channel) runs on x, B and C apart. Returns
        (y (b, t, inner) split by heads, state)."""
        d, dt = self.dims, self.dtype
        width = d.n_groups * d.state_size
        sizes = (d.inner, d.inner, width, width, d.num_heads)
        by_group = "act_mlp" if d.n_groups % tensor == 0 else None
        names = ("act_mlp", "act_mlp", by_group, by_group, "act_heads")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        w_dp = self.w_in_dp[...].astype(dt)
        kw: dict[str, Any] = {"backward": self.matmul_backward, "dot_general": self.dot_general}
        delta = lora_delta(self, "w_in_dp", x_btd, 1, dt, **kw) if has_adapter(self, "w_in_dp") else None
        sections = []
        for i, (start, size, name) in enumerate(zip(starts, sizes, names)):
            w_section = w_dp[:, start : start + size]
            out = dense(x_btd, w_section, **kw)
            if delta is not None:  # the LoRA update's columns of this section
                out = out + delta[..., start : start + size]
            if self.bias:
                out = out + self.b_in_p[...][start : start + size].astype(dt)
            if self.section_scales is not None:  # Falcon-H1's mup_vector
                out = out * jnp.asarray(self.section_scales[i], jnp.float32).astype(dt)
            sections.append(constrain(out, ("act_batch", "act_seq", name)))
        gate, x_in, b_in, c_in, dt_raw = sections
        conv_bias = params.get("conv_bias")
        convolved, windows = [], []
        for part, start, size, name in zip((x_in, b_in, c_in), (0, d.inner, d.inner + width), sizes[1:4], names[1:4]):
            out, window = causal_conv1d(
                part,
                params["conv_kc"][:, start : start + size],
                None if conv_bias is None else conv_bias[start : start + size],
                window_bkc=None if state is None else state.conv_bkc[..., start : start + size],
                segment_ids_bt=segment_ids_bt,
            )
            if mask_bt is not None:
                out = out * mask_bt[..., None].astype(out.dtype)
            convolved.append(constrain(out, ("act_batch", "act_seq", name)))
            windows.append(window)
        x_conv, b_conv, c_conv = convolved
        y_btf, ssm = mamba2_scan(
            params,
            gate,
            x_conv,
            b_conv,
            c_conv,
            dt_raw,
            d,
            ssm_bhpn=None if state is None else state.ssm_bhpn,
            chunk_size=self.chunk_size,
            segment_ids_bt=segment_ids_bt,
        )
        return constrain(y_btf, ("act_batch", "act_seq", "act_mlp")), Mamba2State(jnp.concatenate(windows, -1), ssm)

    def _section_vector(self) -> jax.Array:
        """(p,) float32: each of in_proj's output sections z, x, B, C, dt times its scale."""
        d = self.dims
        state = d.n_groups * d.state_size
        sizes = (d.inner, d.inner, state, state, d.num_heads)
        assert self.section_scales is not None and len(self.section_scales) == len(sizes)
        return jnp.concatenate([jnp.full((n,), v, jnp.float32) for n, v in zip(sizes, self.section_scales)])
