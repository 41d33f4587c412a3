"""MiniMax's multi-token prediction (issue 62).

MiniMax-M3 (minimax_m3_vl_text): the modules `model.mtp.layers.{k}.*` that transformers 5.25
skips at load, as vLLM's drafter defines them (vllm/models/minimax_m3/nvidia/mtp.py,
MiniMaxM3MultiTokenPredictorLayer): Gemma norms enorm / hnorm, eh_proj of [enorm(embedding
of token i + 1), hnorm(the main model's final-normed state)], a block-sparse attention layer
with the experts (`transformer_layer.*`, under MiniMax's released names: vLLM reads them,
transformers' conversion mapping renames them for the decoder) run at the hidden state's
positions, its own final_layernorm, the shared LM head. transformers has no module for it, so
the reference is a one-layer transformers MiniMax-M3 drawn at random whose layer and final
norm are the module's. Checked: conversion keeps the module (counted in the weights) with a
sparse-attention layer although the decoder's last layer is full attention, the main logits
still equal transformers', the module's logits equal the reference's to 1e-4, the training
loss's multi-token term is the reference's cross entropy and one step on it lowers it, and
export writes the checkpoint back bitwise, module included.

vLLM's drafter also zeroes the embedding at position 0 ("not needed by MTP"), as it does for
DeepSeek-V3's module; the engine, as transformers' MtpModel, does not (the reference follows
the engine there).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.models import transformer  # noqa: E402
from engine.models.mtp import mtp_depth_logits, mtp_loss  # noqa: E402
from engine.models.params import graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_n62_new_a as new_a  # noqa: E402
from tests.test_hf_fam_moe_2 import IMPLEMENTATIONS, randomise_routing_bias  # noqa: E402
from tests.test_hf_parity import random_causal_lm  # noqa: E402

TOKENS = np.random.default_rng(1).integers(0, 37, (2, 19))


def _config(layers: int, sparse: list[bool], moe: list[bool]):
    """The tiny MiniMax-M3 of test_hf_n62_new_a (blocks of 3 keys, the best 2 per group)."""
    hf = new_a.hf_config("minimax_m3_vl_text")
    hf.num_hidden_layers = layers
    hf.layer_types = ["minimax_m3_sparse" if x else "full_attention" for x in sparse]
    hf.mlp_layer_types = ["sparse" if x else "dense" for x in moe]
    return hf


def _model(hf, seed: int):
    model = random_causal_lm(hf, seed, **IMPLEMENTATIONS)
    randomise_routing_bias(model, seed)
    return model


def _released(saved: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Layer 0 of a transformers-saved MiniMax-M3 under MiniMax's released names at `prefix`
    (the inverse of transformers' conversion mapping for minimax_m3_vl: per-expert w1 / w3 /
    w2 under block_sparse_moe, the shared expert's gate_proj / up_proj, index_q_proj ...)."""
    out = {}
    for name, tensor in saved.items():
        if not name.startswith("model.layers.0."):
            continue
        rest = name.removeprefix("model.layers.0.")
        if rest == "mlp.experts.gate_up_proj":  # (E, 2f, d): gate then up
            f = tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                out[f"{prefix}block_sparse_moe.experts.{j}.w1.weight"] = tensor[j, :f]
                out[f"{prefix}block_sparse_moe.experts.{j}.w3.weight"] = tensor[j, f:]
        elif rest == "mlp.experts.down_proj":
            for j in range(tensor.shape[0]):
                out[f"{prefix}block_sparse_moe.experts.{j}.w2.weight"] = tensor[j]
        elif rest == "mlp.shared_experts.gate_up_proj.weight":
            g = tensor.shape[0] // 2
            out[prefix + "block_sparse_moe.shared_experts.gate_proj.weight"] = tensor[:g]
            out[prefix + "block_sparse_moe.shared_experts.up_proj.weight"] = tensor[g:]
        else:
            for old, new in (
                ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
                ("mlp.", "block_sparse_moe."),
                ("self_attn.indexer.", "self_attn.index_"),
            ):
                rest = rest.replace(old, new)
            out[prefix + rest] = tensor
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def m3_checkpoint(root):
    """(main model, reference model, own tensors) of a MiniMax-M3 checkpoint with one module
    written to `root`: a decoder whose last layer is full attention (sparse, sparse, full;
    dense, experts, experts) and model.mtp.layers.0. holding transformer_layer (a sparse
    layer with experts, released names), enorm, hnorm, eh_proj, final_layernorm."""
    main = _model(_config(3, [True, True, False], [False, True, True]), 0)
    main.save_pretrained(root / "main")
    tensors = load_file(root / "main" / "model.safetensors")
    ref = _model(_config(1, [True], [True]), 7)
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        ref.lm_head.weight.copy_(main.lm_head.weight)
    ref.save_pretrained(root / "ref")
    saved = load_file(root / "ref" / "model.safetensors")
    tensors.update(_released(saved, "model.mtp.layers.0.transformer_layer."))
    tensors["model.mtp.layers.0.final_layernorm.weight"] = saved["model.norm.weight"]
    d, rng = main.config.hidden_size, np.random.default_rng(4)
    own = {
        "eh_proj": (0.3 * rng.standard_normal((d, 2 * d))).astype(np.float32),
        "enorm": (0.3 * rng.standard_normal(d)).astype(np.float32),  # Gemma norms: x * (1 + w)
        "hnorm": (0.3 * rng.standard_normal(d)).astype(np.float32),
    }
    tensors.update({f"model.mtp.layers.0.{n}.weight": v for n, v in own.items()})
    (root / "hf").mkdir()
    save_file(tensors, root / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "main" / "config.json").read_text())
    (root / "hf" / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 1}))
    return main, ref, own


def m3_reference(main, ref, own, tokens: np.ndarray) -> np.ndarray:
    """vLLM's MiniMaxM3MultiTokenPredictorLayer.forward then compute_logits: eh_proj of
    [enorm(embedding of token i + 1), hnorm(the main model's final-normed state at i)], the
    layer at position i (the one-layer model's, its final norm the module's), the head."""
    eps = main.config.rms_norm_eps

    def gemma(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + torch.tensor(w))

    ahead = np.concatenate([tokens[:, 1:], np.zeros((tokens.shape[0], 1), tokens.dtype)], axis=1)
    with torch.no_grad():
        h = main.model(torch.tensor(tokens)).last_hidden_state
        e = main.model.embed_tokens(torch.tensor(ahead))
        joined = torch.cat([gemma(e, own["enorm"]), gemma(h, own["hnorm"])], -1) @ torch.tensor(own["eh_proj"]).T
        return main.lm_head(ref.model(inputs_embeds=joined).last_hidden_state).numpy()


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    root = tmp_path_factory.mktemp("m3_mtp")
    main, ref, own = m3_checkpoint(root)
    messages: list[str] = []
    convert_hf(root / "hf", root / "converted", log=messages.append)
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(root=root, main=main, ref=ref, own=own, cfg=cfg, compute=compute, params=params, messages=messages)


@pytest.fixture(scope="module")
def reference(m3):
    return m3_reference(m3["main"], m3["ref"], m3["own"], TOKENS)


@pytest.fixture(scope="module")
def run(m3):
    """(main logits, module logits, aux, gradients of the aux loss, loss after one step on it)
    of TOKENS, a document per row, under compute.mtp_loss 0.3: one jitted forward."""
    graphdef = graphdef_of(m3["cfg"], m3["compute"].model_copy(update={"mtp_loss": 0.3}))

    def loss(params):
        logits = []

        def seen(model, hidden, *args):  # the loss's own logits, and what forward handed the module
            logits.extend(depth for depth, _ in mtp_depth_logits(model, hidden, *args))
            return mtp_loss(model, hidden, *args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(transformer, "mtp_loss", seen)
            main, aux = nnx.merge(graphdef, params).forward(jnp.asarray(TOKENS))
        return aux["aux_loss"], (aux, [main, *logits])

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, (aux, (main, *logits))), grads = step(m3["params"])
    mtp = ["mtp", "mtp_blocks"]
    moved = {k: jax.tree.map(lambda p, g: p - 0.5 * g, v, grads[k]) if k in mtp else v for k, v in m3["params"].items()}
    (_, (after, _)), _ = step(moved)
    return np.asarray(main), [np.asarray(x) for x in logits], jax.device_get(aux), grads, float(after["mtp_loss"])


def test_conversion_keeps_the_module_with_a_sparse_attention_layer(m3):
    cfg = m3["cfg"]
    assert cfg.mtp_layers == 1 and not any("skipped" in m or "ignored" in m for m in m3["messages"]), m3["messages"]
    assert cfg.layer_pattern()[-1].mixer == "attention"
    spec = cfg.mtp_layer_spec()
    assert spec.mixer.block_indexer.topk_blocks == 2 and spec.ffn.kind == "moe" and spec.ffn.shared_dim == 11
    assert m3["params"]["mtp"]["w_eh_xd"].shape == (2 * cfg.d_model, cfg.d_model)


def test_the_main_logits_still_match_transformers(m3, run):
    ours = run[0]
    with torch.no_grad():
        ref = m3["main"](torch.tensor(TOKENS)).logits.numpy()
    delta = float(np.abs(ours - ref).max())
    print(f"\nminimax_m3 main: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref).max() > 0.5


def test_the_modules_logits_match_vllms_module(run, reference):
    """Row by row (each its own document), at the positions whose target is in the row."""
    _, (ours,), _, _, _ = run
    ref = reference
    delta = float(np.abs(ours[:, :-2] - ref[:, :-2]).max())
    print(f"\nminimax_m3 module 0: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref).max() > 0.5


def test_the_training_loss_adds_the_modules_cross_entropy_and_trains_it(m3, run, reference):
    """L_MTP: the mean cross entropy of the module's predictions of token i + 2 (the reference's
    logits), added times compute.mtp_loss (0.3); the module's parameters get gradients (the
    indexer's and the choosing bias's none: selection has no gradient), and one step along
    them lowers L_MTP."""
    _, _, aux, grads, after = run
    ref = reference[:, :-2]
    top = ref.max(-1, keepdims=True)
    lse = np.log(np.exp(ref - top).sum(-1)) + top[..., 0]
    expected = (lse - np.take_along_axis(ref, TOKENS[:, 2:, None], -1)[..., 0]).mean()
    print(f"\nminimax_m3: L_MTP {float(aux['mtp_loss']):.6f}, reference {expected:.6f}, after a step {after:.6f}")
    np.testing.assert_allclose(float(aux["mtp_loss"]), expected, rtol=1e-5)
    compute = m3["compute"]
    routers = compute.moe_balance_loss * float(aux["balance_loss"]) + compute.moe_router_z_loss * float(
        aux["router_z_loss"]
    )
    np.testing.assert_allclose(float(aux["aux_loss"]), routers + 0.3 * expected, rtol=1e-5)
    for head in ("mtp", "mtp_blocks"):
        for path, grad in jax.tree_util.tree_leaves_with_path(grads[head]):
            keys = jax.tree_util.keystr(path)
            if "indexer" in keys or "b_router_e" in keys:
                continue
            assert float(jnp.abs(grad).max()) > 0, (head, keys)
    assert after < float(aux["mtp_loss"])


def test_export_writes_the_checkpoint_back_bitwise(m3, tmp_path):
    export_hf(m3["root"] / "converted" / "checkpoint", tmp_path / "export")
    source = load_file(m3["root"] / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_mtp_modules"] == 1
