"""Rollout routing replay (R3) for a mixture of experts: the experts the sampler routed each
token to are recorded, and the trainer's forward over the same tokens uses them instead of
its own router's top-k.

The rollout engine and the trainer compute a router's logits with different numerics (a bf16
rollout copy, a KV-cache decode against a full forward), and a close call between two experts
flips: the token then goes through other experts in training than it was sampled with, a gap
in log-probs that has nothing to do with the update (NeMo-RL, verl, SkyRL: "R3"; Ma et al.,
arXiv:2510.11370). Replay fixes only the discrete choice: the routing weights are still the
trainer's router scores at the replayed experts (renormalised as the model's router does), so
the router keeps its gradient, as Megatron-LM's moe_enable_routing_replay and NeMo Automodel's
RouterReplay define it.

    with recording() as routes:       # the sampler's prefill / one decode step
        model(tokens, cache=cache)    # routes: one (b, t, k) int32 per MoE layer, in call order
    with replaying(experts_bltk):     # the trainer's forward: (b, layers, t, k), every layer's
        model.forward(tokens)         # slot; dense layers' slots are never read

A MoE layer finds its slot by the model's layer index the blocks run under (lora.in_layer; a
traced int inside the layer scan). Neither context traces anything when it is not active, so a
model without them compiles exactly as before.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from engine.models.lora import current_layer

ROUTER_EXPERTS = "router_experts"
"""The batch key of the replayed experts: (rows, layers, tokens, k) int32."""

_RECORDING: contextvars.ContextVar = contextvars.ContextVar("router_recording", default=None)
_REPLAYING: contextvars.ContextVar = contextvars.ContextVar("router_replaying", default=None)


@contextlib.contextmanager
def recording(active: bool = True):
    """Collect every MoE layer's chosen experts, (b, t, k) each, in the order the layers run
    (the decode path runs them unrolled, so the order is the model's). Not `active`: nothing."""
    routes: list[jax.Array] = []
    token = _RECORDING.set(routes if active else None)
    try:
        yield routes
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def replaying(experts_bltk):
    """Route every MoE layer's tokens to `experts_bltk[:, layer]` (None: the router chooses)."""
    token = _REPLAYING.set(experts_bltk)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def record(experts_nk, b: int, t: int) -> None:
    """Called by a MoE layer with its choice (n = b * t, k); kept only inside `recording()`."""
    routes = _RECORDING.get()
    if routes is not None:
        routes.append(experts_nk.reshape(b, t, -1))


def replayed(b: int, t: int):
    """The experts (b * t, k) this MoE layer must use, or None outside `replaying()` (or outside
    the decoder's blocks: a multi-token-prediction head routes itself, as NeMo-RL's default)."""
    experts_bltk = _REPLAYING.get()
    layer = current_layer()
    if experts_bltk is None or layer is None:
        return None
    assert experts_bltk.shape[0] == b and experts_bltk.shape[2] == t, (experts_bltk.shape, b, t)
    experts_btk = jnp.take(experts_bltk, jnp.asarray(layer, jnp.int32), axis=1)
    return experts_btk.reshape(b * t, -1).astype(jnp.int32)


def model_layer_routes(routes: list, moe_layers: list[int], num_layers: int):
    """The recorded routes ((b, t, k) per MoE layer, in order) as one (b, num_layers, t, k)
    array, each MoE layer at its index in the model, zeros at the dense layers."""
    assert len(routes) == len(moe_layers), (len(routes), moe_layers)
    b, t, k = routes[0].shape
    out = jnp.zeros((b, num_layers, t, k), jnp.int32)
    for layer, experts_btk in zip(moe_layers, routes):
        out = out.at[:, layer].set(experts_btk.astype(jnp.int32))
    return out


def moe_layers(model_cfg) -> list[int]:
    """The model's layers with experts (ModelConfig.layer_pattern's ffn 'moe')."""
    return [i for i, layer in enumerate(model_cfg.layer_pattern()) if layer.ffn == "moe"]
