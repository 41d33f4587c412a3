"""The mixture-of-experts MLP: a router picks k of E gated MLPs per token; their outputs,
weighted by the router's scores, replace the dense MLP's (Mixtral, Qwen3-MoE, DeepSeek).

Shapes in names as in transformer.py, plus n tokens (b * t), e experts, k experts per token,
f the expert MLP width, c an expert's capacity (per sequence).

Two ways to get the tokens to their experts (ComputeConfig.moe_dispatch):

- dropless (default): the n * k (token, expert) assignments sorted by expert, so each
  expert's rows are contiguous, and one grouped matmul per projection over all experts
  (`jax.lax.ragged_dot`, tiled on CPU: engine/ops/grouped.py; MegaBlocks' idea). Nothing is
  dropped and no FLOP is wasted on padding. With an `expert` mesh axis the assignments travel to their experts' devices
  and back by all-to-all (engine/models/moe_ep.py), each device computing its own experts;
  on a mesh that splits the tokens without one, each device sorts its own tokens' assignments
  (the same shard_map without the exchange).
- capacity: GShard's dispatch. Each sequence fills a fixed (e, c) buffer per expert, first
  choices before second ones, and assignments past an expert's capacity are dropped (their
  token keeps its other experts and the residual). The buffers are static shapes, so the
  move from batch-sharded to expert-sharded is a sharding constraint XLA lowers to an
  all-to-all.

Both give the same numbers when nothing is dropped (tests/test_moe.py). The router's
statistics for the auxiliary losses come back as `MoEStats`, one per layer.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import moe_ep, router_replay
from engine.models.common import ACTIVATIONS, Build, param
from engine.models.hash_routing import hashed_experts
from engine.models.specs import MoESpec
from engine.ops.dense import DotGeneral, dense, gated_mlp, matmuls_in
from engine.ops.grouped import grouped_mlp
from engine.ops.partitioning import constrain, current_mesh


class MoEStats(NamedTuple):
    """One layer's router statistics over the non-padding tokens (float32)."""

    assigned_e: jax.Array
    """Assignments per expert / tokens (sums to k): f_e of the balancing loss."""
    probability_e: jax.Array
    """Mean softmax router probability per expert: P_e of the balancing loss."""
    z_loss: jax.Array
    """Mean squared log-normaliser of the router logits (ST-MoE's router z-loss)."""


def combine_stats(stats: MoEStats, num_experts: int, experts_per_token: int) -> dict[str, jax.Array]:
    """The auxiliary losses and loads of a stack of layers' stats (leading axis: layers).

    balance_loss is Switch Transformer's E * sum_e f_e * P_e with f and P averaged over the
    layers first, exactly transformers' `load_balancing_loss_func` (it concatenates every
    layer's router logits before averaging); z_loss is the mean over layers; expert_load_e
    the share of assignments each expert got (1/E each when balanced).
    """
    assigned_e = jnp.mean(stats.assigned_e, axis=0)
    probability_e = jnp.mean(stats.probability_e, axis=0)
    return {
        "balance_loss": num_experts * jnp.sum(assigned_e * probability_e),
        "router_z_loss": jnp.mean(stats.z_loss),
        "expert_load_e": assigned_e / experts_per_token,
    }


def route(
    logits_ne,
    bias_e,
    k: int,
    score: str,
    renormalize: bool,
    *,
    groups: int = 1,
    group_top: int = 1,
    scale: float = 1.0,
    group_score: str = "top2_sum",
    experts_nk=None,
):
    """(weights (n, k) float32, experts (n, k) int32) of router logits (n, e) in float32.

    The bias (DeepSeek-V3) only chooses: the weights are the unbiased scores. With `groups`
    (group-limited routing) the k experts come from the `group_top` groups whose two best
    biased scores sum highest (DeepSeek-V3), or whose best score is highest (group_score max,
    DeepSeek-V2). The weights end multiplied by `scale`. `experts_nk` given (router replay,
    router_replay.py): those experts, weighted by these logits' scores, nothing chosen."""
    scores_ne = router_scores(logits_ne, score)
    if experts_nk is None:
        experts_nk = _choose(scores_ne, bias_e, k, groups, group_top, group_score)
    weights_nk = jnp.take_along_axis(scores_ne, experts_nk, axis=-1)
    if renormalize:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    return weights_nk * scale if scale != 1.0 else weights_nk, experts_nk


def router_scores(logits_ne, score: str):
    """The router's scores (n, e): softmax, sigmoid or sqrt(softplus) (DeepSeek-V4) of its logits."""
    if score == "softmax":
        return jax.nn.softmax(logits_ne, axis=-1)
    return jax.nn.sigmoid(logits_ne) if score == "sigmoid" else jnp.sqrt(jax.nn.softplus(logits_ne))


def sparsemixer(logits_ne, k: int, eps: float, experts_nk=None):
    """(weights (n, k), experts (n, k)) of SparseMixer's routing at inference (PhiMoE, arXiv
    2409.12136; transformers' `sparsemixer` out of training): the i-th expert is the best of
    the logits not chosen yet (or experts_nk's, replayed), weighted by the softmax over those
    logits still in play whose gap below its logit, relative to max(|logit|, its logit), is at
    most 2 * eps."""
    weights, chosen = [], []
    remaining_ne = logits_ne
    for i in range(k):
        expert_n = jnp.argmax(remaining_ne, axis=-1) if experts_nk is None else experts_nk[:, i]
        best_n1 = jnp.max(remaining_ne, axis=-1, keepdims=True)
        factor_ne = jnp.maximum(jnp.abs(logits_ne), best_n1)
        gates_ne = jnp.where((best_n1 - logits_ne) / factor_ne > 2 * eps, -jnp.inf, remaining_ne)
        weights.append(jnp.take_along_axis(jax.nn.softmax(gates_ne, axis=-1), expert_n[:, None], axis=-1))
        chosen.append(expert_n[:, None].astype(jnp.int32))
        remaining_ne = jnp.where(jax.nn.one_hot(expert_n, logits_ne.shape[-1], dtype=jnp.bool_), -jnp.inf, remaining_ne)
    return jnp.concatenate(weights, axis=-1), jnp.concatenate(chosen, axis=-1)


def _choose(scores_ne, bias_e, k: int, groups: int, group_top: int, group_score: str):
    """The router's top-k experts (n, k) of its scores (see `route`)."""
    choice_ne = scores_ne if bias_e is None else scores_ne + bias_e
    if groups > 1:
        n, e = choice_ne.shape
        grouped_ngx = choice_ne.reshape(n, groups, e // groups)
        if group_score == "max":
            group_scores_ng = jnp.max(grouped_ngx, axis=-1)
        else:
            group_scores_ng = jnp.sum(jax.lax.top_k(grouped_ngx, 2)[0], axis=-1)
        _, top_groups = jax.lax.top_k(group_scores_ng, group_top)
        kept_ng = jnp.any(jax.nn.one_hot(top_groups, groups, dtype=jnp.bool_), axis=1)
        choice_ne = jnp.where(jnp.repeat(kept_ng, e // groups, axis=1), choice_ne, -jnp.inf)
    return jax.lax.top_k(choice_ne, k)[1]


def router_stats(logits_ne, experts_nk, valid_n, num_experts: int, score: str = "softmax") -> MoEStats:
    """The balancing and z-loss statistics of one layer, padding excluded. P_e is the mean
    routing probability: the softmax, or for a sigmoid router its scores normalised to sum
    to 1 per token (DeepSeek-V3's balance loss, computed here over the batch)."""
    valid = valid_n.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(valid), 1.0)
    assigned_ne = jnp.sum(jax.nn.one_hot(experts_nk, num_experts, dtype=jnp.float32), axis=1)
    if score == "softmax":
        probs_ne = jax.nn.softmax(logits_ne, axis=-1)
    else:
        scores_ne = router_scores(logits_ne, score)
        probs_ne = scores_ne / jnp.sum(scores_ne, axis=-1, keepdims=True)
    log_z_n = jax.nn.logsumexp(logits_ne, axis=-1)
    return MoEStats(
        assigned_e=valid @ assigned_ne / count,
        probability_e=valid @ probs_ne / count,
        z_loss=jnp.sum(valid * jnp.square(log_z_n)) / count,
    )


@jax.custom_vjp
def load_feedback(bias_e, assigned_e):
    """0.0, to add to the layer's output; its gradient with respect to a router's choosing
    bias is the layer's load imbalance, assigned_e - mean(assigned_e), whatever the loss (the
    bias only chooses, so it has no loss gradient). The optimizer moves the bias against its
    sign (engine/train/optimizer.py: router_bias_update)."""
    return jnp.zeros((), jnp.float32)


def _load_feedback_fwd(bias_e, assigned_e):
    return jnp.zeros((), jnp.float32), (assigned_e, jnp.zeros_like(bias_e))


def _load_feedback_bwd(residuals, _):
    assigned_e, zero_e = residuals
    return (assigned_e - jnp.mean(assigned_e)).astype(zero_e.dtype) + zero_e, jnp.zeros_like(assigned_e)


load_feedback.defvjp(_load_feedback_fwd, _load_feedback_bwd)


def gated(activation):
    """glu(gate, up) of the usual gated MLP: activation(gate) * up (SwiGLU, GeGLU)."""
    return lambda gate, up: activation(gate) * up


def clamped_swiglu(gate, up, *, limit: float, alpha: float, shift: float = 1.0):
    """GPT-OSS's experts (transformers' GptOssExperts._apply_gate): the gate clamped above at
    `limit`, up to [-limit, limit], then (up + shift) * gate * sigmoid(alpha * gate) (shift 1;
    DeepSeek-V4's: shift 0, alpha 1, silu(gate) * up)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + shift) * (gate * jax.nn.sigmoid(gate * alpha))


def dropless_experts(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, glu, biases=None):
    """sum_k weight * expert_k(x), every assignment computed: sort by expert, grouped matmuls.
    glu(gate, up) -> hidden; biases: None or the experts' (gate (e, f), up (e, f), down (e, d))."""
    n, k = experts_nk.shape
    num_experts = w_gate_edf.shape[0]
    with jax.named_scope("dispatch"):  # named scopes: bench/moe.py's profile attributes time by them
        flat_experts = experts_nk.reshape(-1)  # assignment i is token i // k
        order = jnp.argsort(flat_experts, stable=True)
        group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
        x_sorted = x_nd[order // k]  # (n * k, d), grouped by expert
    with jax.named_scope("experts"):
        y_sorted = grouped_mlp(x_sorted, group_sizes, w_gate_edf, w_up_edf, w_down_efd, glu, biases)
    with jax.named_scope("combine"):
        y_nkd = y_sorted[jnp.argsort(order)].reshape(n, k, -1)  # back to token order (a gather)
        return jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(y_nkd.dtype))


def capacity_experts(
    x_btd,
    experts_btk,
    weights_btk,
    valid_bt,
    w_gate_edf,
    w_up_edf,
    w_down_efd,
    glu,
    capacity: int,
    dot_general: DotGeneral = jax.lax.dot_general,
    biases=None,
):
    """GShard dispatch with a per-sequence capacity: each row fills (e, c) buffers, which move
    to the experts' devices (a sharding constraint: an all-to-all), go through the experts as
    batched matmuls and come back. Padding tokens take no capacity and get zeros. glu and
    biases as in dropless_experts."""
    b, t, k = experts_btk.shape
    num_experts = w_gate_edf.shape[0]
    with jax.named_scope("dispatch"):
        # Priority: every token's first choice before any second choice, then token order.
        experts_bm = jnp.swapaxes(experts_btk, 1, 2).reshape(b, k * t)
        valid_bm = jnp.tile(valid_bt, (1, k))
        onehot_bme = jax.nn.one_hot(experts_bm, num_experts, dtype=jnp.int32) * valid_bm[..., None]
        position_bm = jnp.sum((jnp.cumsum(onehot_bme, axis=1) - 1) * onehot_bme, axis=-1)
        kept_bm = valid_bm & (position_bm < capacity)
        slot_bm = jnp.where(
            kept_bm, experts_bm * capacity + position_bm, num_experts * capacity
        )  # past the end: dropped
        x_bmd = jnp.tile(x_btd, (1, k, 1))
        rows = jnp.arange(b)[:, None]
        buffer_bxd = jnp.zeros((b, num_experts * capacity, x_btd.shape[-1]), x_btd.dtype)
        buffer_bxd = buffer_bxd.at[rows, slot_bm].set(x_bmd, mode="drop")
        buffer_becd = constrain(
            buffer_bxd.reshape(b, num_experts, capacity, -1), ("act_batch_moe", "act_expert", None, "act_embed")
        )

    def expert_matmul(x_becd, w_exy, i):  # (b, e, c, x) . (e, x, y) -> (b, e, c, y), e the batch axis
        y_ebcy = dot_general(x_becd, w_exy, (((3,), (1,)), ((1,), (0,))))
        y_becy = jnp.swapaxes(y_ebcy, 0, 1)
        return y_becy if biases is None else y_becy + biases[i][None, :, None, :]

    with jax.named_scope("experts"):
        hidden = glu(expert_matmul(buffer_becd, w_gate_edf, 0), expert_matmul(buffer_becd, w_up_edf, 1))
        hidden = constrain(hidden, ("act_batch_moe", "act_expert", None, "act_mlp"))
        out_becd = constrain(expert_matmul(hidden, w_down_efd, 2), ("act_batch_moe", "act_expert", None, "act_embed"))
    with jax.named_scope("combine"):
        out_bxd = constrain(out_becd.reshape(b, num_experts * capacity, -1), ("act_batch", None, "act_embed"))
        y_bmd = out_bxd.at[rows, slot_bm].get(mode="fill", fill_value=0)
        y_bktd = jnp.swapaxes(y_bmd.reshape(b, k, t, -1), 1, 2)  # (b, t, k, d)
        return jnp.einsum("btkd,btk->btd", y_bktd, weights_btk.astype(y_bktd.dtype))


class MoE(nnx.Module):
    """Router + `num_experts` gated MLPs as stacked (e, ...) weights, + optional shared experts
    (of a MoESpec; without its gate, experts and shared experts down(act(up(x))): no w_gate, Nemotron-H).

    __call__(x_btd, valid_bt) -> (out_btd, MoEStats); valid_bt False marks padding (it is
    routed like any token but left out of the router statistics and the capacity)."""

    def __init__(self, spec: MoESpec, build: Build, *, rngs: nnx.Rngs):
        d, f, e = build.d_model, spec.expert_dim, spec.num_experts
        pdt, std, out_std = build.param_dtype, build.init_std, build.out_std
        self.zero_experts, self.router_width = spec.zero_experts, e + spec.zero_experts  # LongCat-Flash
        self.w_router_de = param(rngs, (d, self.router_width), std, ("embed", None), pdt)
        if spec.router_input_norm:  # Gemma 4: the router reads rms-normed x times this / sqrt(d)
            self.router_scale_d = nnx.Param(jnp.ones((d,), pdt), out_sharding=("norm",))
        if spec.router_expert_scale:  # Gemma 4: a factor per expert on its routing weight
            self.expert_scale_e = nnx.Param(jnp.ones((e,), pdt), out_sharding=(None,))
        if spec.router_bias and not spec.hash_vocab:  # a hash-routed layer's table chooses instead
            self.b_router_e = nnx.Param(jnp.zeros((self.router_width,), jnp.float32), out_sharding=(None,))
        if spec.router_logits_bias:  # GPT-OSS: the router Linear's bias
            self.b_logits_e = nnx.Param(jnp.zeros((self.router_width,), pdt), out_sharding=(None,))
        self.gated = spec.gated  # false: experts down(act(up(x))), no gate (Nemotron-H)
        if self.gated:
            self.w_gate_edf = param(rngs, (e, d, f), std, ("expert", "embed", "mlp"), pdt)
        self.w_up_edf = param(rngs, (e, d, f), std, ("expert", "embed", "mlp"), pdt)
        self.w_down_efd = param(rngs, (e, f, d), out_std, ("expert", "mlp", "embed"), pdt)
        if spec.expert_bias:  # GPT-OSS
            self.b_gate_ef = nnx.Param(jnp.zeros((e, f), pdt), out_sharding=("expert", "mlp"))
            self.b_up_ef = nnx.Param(jnp.zeros((e, f), pdt), out_sharding=("expert", "mlp"))
            self.b_down_ed = nnx.Param(jnp.zeros((e, d), pdt), out_sharding=("expert", "embed"))
        if spec.num_shared_experts:
            g = spec.shared_dim
            if self.gated:
                self.w_shared_gate_dg = param(rngs, (d, g), std, ("embed", "mlp"), pdt)
            self.w_shared_up_dg = param(rngs, (d, g), std, ("embed", "mlp"), pdt)
            self.w_shared_down_gd = param(rngs, (g, d), out_std, ("mlp", "embed"), pdt)
        if spec.shared_expert_gate:  # Qwen3-Next: the shared experts' output times sigmoid(x . w)
            self.w_shared_scale_d1 = param(rngs, (d, 1), std, ("embed", None), pdt)
        self.shared_gate = spec.shared_expert_gate
        self.shared_scale = spec.shared_scale
        if spec.output_bias:  # JetMoE: a bias on the mixture's output
            self.b_out_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.output_bias = spec.output_bias
        self.num_experts, self.k = e, spec.experts_per_token
        self.score, self.renormalize = spec.router_score, spec.router_renormalize
        self.router_bias, self.shared = spec.router_bias and not spec.hash_vocab, spec.num_shared_experts > 0
        self.groups, self.group_top, self.router_scale = spec.router_groups, spec.router_group_top, spec.router_scale
        self.group_score = spec.router_group_score
        self.scales_input = spec.router_scales_input
        self.activation = ACTIVATIONS[spec.activation]
        self.glu = (
            gated(self.activation)
            if spec.swiglu_limit is None
            else functools.partial(
                clamped_swiglu, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha, shift=spec.swiglu_shift
            )
        )
        self.clamped = spec.swiglu_limit is not None
        self.clamp_shared = spec.clamp_shared  # HY-V4: the routed experts' SwiGLU only
        if spec.hash_vocab:  # the token -> experts table (frozen; floats, as every parameter)
            self.hash_experts_vk = nnx.Param(
                jnp.zeros((spec.hash_vocab, spec.experts_per_token), jnp.float32), out_sharding=(None, None)
            )
        self.hash_routing = spec.hash_vocab > 0
        if not self.gated:  # the up projection passed as the gate too (one product after XLA's CSE)
            self.glu = lambda _, up: self.activation(up.astype(jnp.float32)).astype(up.dtype)
        self.logits_bias, self.expert_bias = spec.router_logits_bias, spec.expert_bias
        self.input_norm, self.expert_scale = spec.router_input_norm, spec.router_expert_scale
        self.norm_eps = spec.router_norm_eps
        self.sparsemixer_eps = spec.sparsemixer_eps
        self.softcap = spec.router_softcap
        self.dtype = build.dtype
        self.dispatch, self.capacity_factor = build.compute.moe_dispatch, build.compute.moe_capacity_factor
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def capacity(self, seq_len: int) -> int:
        """Assignments each expert takes per sequence in the capacity dispatch."""
        return max(1, math.ceil(self.capacity_factor * seq_len * self.k / self.num_experts))

    def _routed(self, x_btd, experts_nk, weights_nk, valid_bt, experts: list, biases: list | None, seq_len: int):
        """sum_k weight * expert_k(x) of the tokens x (b, t, d), by the configured dispatch;
        `seq_len`: the sequence length the capacity is for."""
        b, t, d = x_btd.shape
        k = experts_nk.shape[1]
        w_gate, w_up, w_down = experts
        mesh = current_mesh()
        if self.dispatch == "dropless" and mesh is not None and moe_ep.applies(mesh, b * t):  # moe_ep.py
            return moe_ep.expert_parallel_dropless(
                x_btd.reshape(b * t, d), experts_nk, weights_nk, w_gate, w_up, w_down, self.glu, mesh, biases
            ).reshape(b, t, d)
        if self.dispatch == "dropless":
            return dropless_experts(
                x_btd.reshape(b * t, d), experts_nk, weights_nk, w_gate, w_up, w_down, self.glu, biases
            ).reshape(b, t, d)
        return capacity_experts(
            x_btd,
            experts_nk.reshape(b, t, k),
            weights_nk.reshape(b, t, k),
            valid_bt,
            w_gate,
            w_up,
            w_down,
            self.glu,
            self.capacity(seq_len),
            self.dot_general,
            biases,
        )

    def __call__(self, x_btd, valid_bt=None, router_x_btd=None):
        """`router_x_btd`: what the router reads, where it is not the experts' input (Gemma 4)."""
        b, t, d = x_btd.shape
        dt = self.dtype
        if valid_bt is None:
            valid_bt = jnp.ones((b, t), bool)
        with jax.named_scope("router"), matmuls_in("default"):  # never quantized (fp8/int8 recipes)
            # In float32 whatever the compute dtype (Switch Transformer's selective precision;
            # transformers' DeepSeek-V3 router too): a bf16 rounding of close logits flips choices.
            router_in = (x_btd if router_x_btd is None else router_x_btd).astype(jnp.float32)
            if self.input_norm:
                router_in = router_in * jax.lax.rsqrt(jnp.mean(router_in**2, axis=-1, keepdims=True) + self.norm_eps)
                router_in = router_in * self.router_scale_d[...].astype(jnp.float32) * d**-0.5
            logits_bte = dense(
                router_in,
                self.w_router_de[...].astype(jnp.float32),
                backward=self.matmul_backward,
                dot_general=self.dot_general,
            )
            logits_ne = logits_bte.reshape(b * t, self.router_width)
            if self.logits_bias:
                logits_ne = logits_ne + self.b_logits_e[...].astype(jnp.float32)
            if self.softcap is not None:  # Laguna: cap * tanh(logits / cap)
                logits_ne = self.softcap * jnp.tanh(logits_ne / self.softcap)
            bias = self.b_router_e[...] if self.router_bias else None
            if self.sparsemixer_eps is not None:  # PhiMoE
                weights_nk, experts_nk = sparsemixer(
                    logits_ne, self.k, self.sparsemixer_eps, experts_nk=router_replay.replayed(b, t)
                )
            else:
                replayed = router_replay.replayed(b, t)
                if self.hash_routing and replayed is None:  # DeepSeek-V4's first layers
                    replayed = hashed_experts(self.hash_experts_vk[...], b, t)
                weights_nk, experts_nk = route(
                    logits_ne,
                    bias,
                    self.k,
                    self.score,
                    self.renormalize,
                    groups=self.groups,
                    group_top=self.group_top,
                    scale=self.router_scale,
                    group_score=self.group_score,
                    experts_nk=replayed,
                )
            router_replay.record(experts_nk, b, t)
            if self.expert_scale:
                weights_nk = weights_nk * self.expert_scale_e[...].astype(jnp.float32)[experts_nk]
            stats = router_stats(logits_ne, experts_nk, valid_bt.reshape(-1), self.router_width, self.score)
            feedback = load_feedback(bias, stats.assigned_e) if self.router_bias else 0.0
            identity_n1 = None
            if self.zero_experts:  # LongCat-Flash: a chosen zero expert adds its weight times the token
                zero_nk = experts_nk >= self.num_experts
                identity_n1 = jnp.sum(jnp.where(zero_nk, weights_nk, 0.0), axis=-1, keepdims=True)
                weights_nk = jnp.where(zero_nk, 0.0, weights_nk)
                experts_nk = jnp.where(zero_nk, 0, experts_nk)
        gate = self.w_gate_edf if self.gated else self.w_up_edf
        experts = [w[...].astype(dt) for w in (gate, self.w_up_edf, self.w_down_efd)]
        biases = (
            None
            if not self.expert_bias
            else [w[...].astype(dt) for w in (self.b_gate_ef, self.b_up_ef, self.b_down_ed)]
        )
        if self.scales_input:  # Llama 4: expert(w * x), each assignment a row of its own, summed unweighted
            k = self.k
            rows_w = weights_nk.reshape(b, t, k, 1)
            x_rows = (x_btd[:, :, None, :].astype(jnp.float32) * rows_w).astype(x_btd.dtype).reshape(b, t * k, d)
            ones = jnp.ones((b * t * k, 1), weights_nk.dtype)
            valid_rows = jnp.repeat(valid_bt, k, axis=1)
            out_rows = self._routed(x_rows, experts_nk.reshape(-1, 1), ones, valid_rows, experts, biases, t)
            out_btd = jnp.sum(out_rows.reshape(b, t, k, d), axis=2)
        else:
            out_btd = self._routed(x_btd, experts_nk, weights_nk, valid_bt, experts, biases, t)
        if self.shared and not self.gated:  # Nemotron-H's shared expert: down(act(up(x)))
            kw = {"backward": self.matmul_backward, "dot_general": self.dot_general}
            hidden = self.activation(dense(x_btd, self.w_shared_up_dg[...].astype(dt), **kw).astype(jnp.float32))
            hidden = constrain(hidden.astype(dt), ("act_batch", "act_seq", "act_mlp"))
            out_btd = out_btd + dense(hidden, self.w_shared_down_gd[...].astype(dt), **kw)
        elif self.shared and self.clamped and self.clamp_shared:  # MiniMax-M3's: the experts' clamped SwiGLU too
            kw = {"backward": self.matmul_backward, "dot_general": self.dot_general}
            gate = dense(x_btd, self.w_shared_gate_dg[...].astype(dt), **kw).astype(jnp.float32)
            up = dense(x_btd, self.w_shared_up_dg[...].astype(dt), **kw).astype(jnp.float32)
            hidden = constrain(self.glu(gate, up).astype(dt), ("act_batch", "act_seq", "act_mlp"))
            out_btd = out_btd + dense(hidden, self.w_shared_down_gd[...].astype(dt), **kw)
        elif self.shared:
            shared_btd = gated_mlp(
                x_btd,
                self.w_shared_gate_dg[...].astype(dt),
                self.w_shared_up_dg[...].astype(dt),
                self.w_shared_down_gd[...].astype(dt),
                self.activation,
                ("act_batch", "act_seq", "act_mlp"),
                backward=self.matmul_backward,
                dot_general=self.dot_general,
            )
            if self.shared_gate:
                kw = {"backward": self.matmul_backward, "dot_general": self.dot_general}
                scale_bt1 = dense(x_btd, self.w_shared_scale_d1[...].astype(dt), **kw)
                shared_btd = shared_btd * jax.nn.sigmoid(scale_bt1)
            if self.shared_scale != 1.0:  # Cohere 2 MoE: the routed and shared outputs averaged
                shared_btd = shared_btd * self.shared_scale
            out_btd = out_btd + shared_btd
        if identity_n1 is not None:
            identity_bt1 = identity_n1.reshape(b, t, 1)
            out_btd = out_btd + (x_btd.astype(jnp.float32) * identity_bt1).astype(out_btd.dtype)
        if self.output_bias:
            out_btd = out_btd + self.b_out_d[...].astype(out_btd.dtype)
        out_btd = out_btd + jnp.asarray(feedback, out_btd.dtype)
        return constrain(out_btd.astype(x_btd.dtype), ("act_batch", "act_seq", "act_embed")), stats
