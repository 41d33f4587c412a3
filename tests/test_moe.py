"""Mixture of experts (engine/models/moe.py, families mixtral and qwen3_moe).

The block against a per-token reference (every routing option), dropless against capacity
dispatch, the balancing loss against transformers' own function; each family converted
from a tiny random transformers model with logits, greedy tokens (the engine's sampler),
export and round trip checked as for the dense families; expert parallelism on 8 simulated
devices equal to one device.

Tiny models: odd sizes, 5 experts with top-2, weights N(0, 0.3^2) so routing is decided by
margins a perturbation of the router changes (checked), padding in the batch.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.interop.hf.convert import convert_hf
from engine.interop.hf.export import export_hf
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.moe import MoE, combine_stats, router_stats
from engine.models.params import apply_model, apply_model_with_aux, graphdef_of, init_params
from engine.models.transformer import Transformer
from engine.inference.sample import Sampler
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import batch_sharding, global_array, make_mesh
from engine.train.checkpoint import load_params, stored_configs
from engine.train.step import lm_loss_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 37
SHAPE = dict(vocab_size=VOCAB, d_model=12, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=6, mlp_dim=7,
             init_std=0.3)


def tiny(**fields) -> ModelConfig:
    return ModelConfig(**{"family": "mixtral", **SHAPE, "num_experts": 5, "experts_per_token": 2, **fields})


# --------------------------------------------------------------------------- the block


def reference_moe(block: MoE, x_nd: np.ndarray) -> np.ndarray:
    """Every expert on every token, then each token's top-k mixed: the definition, in numpy."""
    w_router = np.asarray(block.w_router_de[...], np.float64)
    logits = x_nd @ w_router
    scores = (np.exp(logits - logits.max(-1, keepdims=True)) if block.score == "softmax"
              else 1 / (1 + np.exp(-logits)))
    if block.score == "softmax":
        scores = scores / scores.sum(-1, keepdims=True)
    choice = scores + (np.asarray(block.b_router_e[...]) if block.router_bias else 0.0)
    top = np.argsort(-choice, axis=-1, kind="stable")[:, : block.k]
    weights = np.take_along_axis(scores, top, -1)
    if block.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    gate, up, down = (np.asarray(w[...], np.float64) for w in (block.w_gate_edf, block.w_up_edf, block.w_down_efd))
    every = np.stack([(silu(x_nd @ gate[e]) * (x_nd @ up[e])) @ down[e] for e in range(block.num_experts)], 1)
    out = np.einsum("nkd,nk->nd", np.take_along_axis(every, top[..., None], 1), weights)
    if block.shared:
        g, u, d = (np.asarray(w[...], np.float64) for w in (block.w_shared_gate_dg, block.w_shared_up_dg,
                                                            block.w_shared_down_gd))
        out = out + (silu(x_nd @ g) * (x_nd @ u)) @ d
    return out


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("routing", [
    dict(),  # Mixtral: softmax, renormalised top-k
    dict(router_score="sigmoid", router_bias=True, num_shared_experts=2),  # DeepSeek-style
    dict(router_renormalize=False, expert_mlp_dim=3),  # Qwen3-MoE without norm_topk_prob
], ids=["softmax", "sigmoid-bias-shared", "unnormalised"])
def test_moe_block_matches_the_per_token_definition(routing, dispatch):
    cfg = tiny(**routing)
    compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=5 / 2)  # capacity >= every token
    block = MoE(cfg, compute, rngs=nnx.Rngs(3))
    if cfg.router_bias:  # a bias big enough to change choices, which must not change the weights
        block.b_router_e[...] = jnp.asarray([0.0, 0.4, -0.4, 0.2, 0.0])
    x = np.random.default_rng(0).normal(size=(2, 11, cfg.d_model)).astype(np.float32)
    out, stats = block(jnp.asarray(x))
    ref = reference_moe(block, x.reshape(-1, cfg.d_model).astype(np.float64)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)
    assert np.abs(ref).max() > 0.3
    np.testing.assert_allclose(float(np.sum(stats.assigned_e)), cfg.experts_per_token, rtol=1e-6)


def test_capacity_dispatch_drops_the_assignments_past_capacity():
    """Capacity 1: per sequence each expert takes one assignment, first choices first; the
    others contribute nothing, exactly as if their routing weight were 0."""
    cfg = tiny()
    block = MoE(cfg, ComputeConfig(moe_dispatch="capacity", moe_capacity_factor=0.01), rngs=nnx.Rngs(1))
    assert block.capacity(11) == 1
    x = np.random.default_rng(0).normal(size=(1, 11, cfg.d_model)).astype(np.float32)
    out, _ = block(jnp.asarray(x))
    # which assignments survive: the first (token order) first-choice of each expert, then
    # second choices for the experts no first choice took
    logits = x[0] @ np.asarray(block.w_router_de[...])
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
    kept, taken = np.zeros_like(top, bool), set()
    for slot in range(2):
        for n in range(11):
            if top[n, slot] not in taken:
                kept[n, slot] = True
                taken.add(top[n, slot])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    weights = np.take_along_axis(probs, top, -1)
    weights = weights / weights.sum(-1, keepdims=True) * kept
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    gate, up, down = (np.asarray(w[...]) for w in (block.w_gate_edf, block.w_up_edf, block.w_down_efd))
    expected = np.stack([sum(weights[n, s] * ((silu(x[0, n] @ gate[e]) * (x[0, n] @ up[e])) @ down[e])
                             for s, e in enumerate(top[n])) for n in range(11)])
    assert 0 < kept.sum() < kept.size  # some dropped, some kept
    np.testing.assert_allclose(np.asarray(out[0]), expected, atol=2e-5, rtol=1e-4)


def test_balance_loss_equals_transformers_load_balancing_loss_func():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers, b, t, e, k = 3, 2, 7, 5, 2
    logits = np.random.default_rng(0).normal(size=(layers, b * t, e)).astype(np.float32) * 2
    mask = np.ones((b, t), np.int64)
    mask[1, 4:] = 0  # padding is left out
    ours = []
    for layer in logits:
        experts = jax.lax.top_k(jax.nn.softmax(jnp.asarray(layer)), k)[1]
        ours.append(router_stats(jnp.asarray(layer), experts, jnp.asarray(mask.reshape(-1) > 0), e))
    stats = jax.tree.map(lambda *a: jnp.stack(a), *ours)
    combined = combine_stats(stats, e, k)
    ref = load_balancing_loss_func(tuple(torch.tensor(layer) for layer in logits), e, k, torch.tensor(mask))
    np.testing.assert_allclose(float(combined["balance_loss"]), float(ref), rtol=1e-6)
    # z-loss: the mean over layers and non-padding tokens of logsumexp^2
    valid = mask.reshape(-1) > 0
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))[:, valid]
    np.testing.assert_allclose(float(combined["router_z_loss"]), np.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(combined["expert_load_e"])), 1.0, rtol=1e-6)


def test_dropless_and_capacity_agree_when_nothing_is_dropped():
    """Logits, router losses and gradients of the whole model, with the training loss."""
    cfg = tiny(attention_pattern=["local", "global"], sliding_window=4)  # mixed: the unit scan and a left-over layer
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)))
    results = {}
    for dispatch in ("dropless", "capacity"):
        compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=5 / 2)
        graphdef = graphdef_of(cfg, compute)
        params = nnx.to_pure_dict(nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))[1])
        batch = {"tokens": tokens, "positions": None, "segment_ids": None, "targets": jnp.roll(tokens, -1, 1),
                 "loss_mask": jnp.ones(tokens.shape)}
        loss_fn = lm_loss_fn(graphdef)
        (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, 18.0)
        results[dispatch] = (apply_model_with_aux(graphdef, params, tokens), loss, aux, grads)
    (logits_a, moe_a), loss_a, aux_a, grads_a = results["dropless"]
    (logits_b, moe_b), loss_b, aux_b, grads_b = results["capacity"]
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=1e-5)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    assert float(moe_a["balance_loss"]) == pytest.approx(float(moe_b["balance_loss"]), rel=1e-6)
    assert aux_a["moe_balance_loss"] > 0 and set(aux_a) == set(aux_b)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5 * float(np.abs(a).max()))


def test_a_dense_family_with_experts_and_an_moe_family_without_are_refused():
    with pytest.raises(ValueError, match="family 'llama' has no experts .*mixtral, qwen3_moe"):
        ModelConfig(**SHAPE, num_experts=4)
    with pytest.raises(ValueError, match="family 'mixtral' is a mixture of experts, so num_experts must be set"):
        ModelConfig(**SHAPE, family="mixtral")
    with pytest.raises(ValueError, match=r"experts_per_token \(6\) exceeds num_experts \(5\)"):
        tiny(experts_per_token=6)
