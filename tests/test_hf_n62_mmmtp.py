"""MiniMax's multi-token prediction (issue 62), as the serving engines that define it read it.

MiniMax-M3 (minimax_m3_vl_text): the modules `model.mtp.layers.{k}.*` that transformers 5.25
skips at load, as vLLM's drafter defines them (vllm/models/minimax_m3/nvidia/mtp.py,
MiniMaxM3MultiTokenPredictorLayer): Gemma norms enorm / hnorm, eh_proj of [enorm(embedding
of token i + 1), hnorm(the main model's final-normed state)], a block-sparse attention layer
with the experts (`transformer_layer.*`, under MiniMax's released names: vLLM reads them,
transformers' conversion mapping renames them for the decoder) run at the hidden state's
positions, its own final_layernorm, the shared LM head.

MiniMax-M2 (minimax_m2): its published checkpoints hold no module weights; SGLang's drafter
(python/sglang/srt/models/minimax_m2_nextn.py, MiniMaxM2ForCausalLMNextN) defines them:
`model.mtp_layers.{k}.` holds h_norm, e_norm, linear_projection of [h_norm(hidden), e_norm(
embedding)] (the hidden state first) and a decoder layer under the decoder's names; the output
norm is the model's own model.norm, then the shared LM head. Two modules, chained as
DeepSeek-V3's recipe (module k reads module k - 1's normed output, which SGLang's drafter
hands on too), over a batch with two documents packed in a row.

transformers has no module for either, so the reference is a one-layer transformers model of
the family drawn at random whose layer (and M3's final norm) are the module's. Checked:
conversion keeps the modules (counted in the weights; M3's layer sparse although the
decoder's last layer is full attention), the main logits still equal transformers', each
module's logits equal the reference's to 1e-4, the training loss's multi-token term is the
reference's cross entropy and one step on it lowers it, and export writes the checkpoint back
bitwise, modules included.

vLLM's and SGLang's drafters also zero the embedding at position 0 ("not needed by MTP"), as
they do for DeepSeek-V3's module; the engine, as transformers' MtpModel, does not (the
references follow the engine there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.models import transformer  # noqa: E402
from engine.models.mtp import mtp_depth_logits, mtp_loss  # noqa: E402
from engine.models.params import graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_moe_families as moe  # noqa: E402
from tests import test_hf_n62_new_a as new_a  # noqa: E402
from tests.test_hf_fam_moe_2 import IMPLEMENTATIONS, randomise_routing_bias  # noqa: E402
from tests.test_hf_n62_mtp import (  # noqa: E402
    assert_modules_match,
    assert_mtp_loss,
    export_bitwise,
    save_checkpoint,
)
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
    save_checkpoint(root, tensors, num_mtp_modules=1)
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


def m2_checkpoint(root, modules: int = 2):
    """(main model, [(reference model, own tensors)] per module) of a MiniMax-M2 checkpoint in
    SGLang's layout written to `root`: model.mtp_layers.{k}. holds a decoder layer under the
    decoder's names, e_norm, h_norm and linear_projection; config.json says num_mtp_modules."""
    main = moe.random_hf_model("minimax_m2")
    main.save_pretrained(root / "main")
    tensors = load_file(root / "main" / "model.safetensors")
    one = moe.hf_config("minimax_m2")
    one.num_hidden_layers = 1
    d, rng, refs = main.config.hidden_size, np.random.default_rng(5), []
    for k in range(modules):
        ref = _model(one, 20 + k)
        with torch.no_grad():  # the module's output norm is the model's
            ref.model.norm.weight.copy_(main.model.norm.weight)
            ref.lm_head.weight.copy_(main.lm_head.weight)
        ref.save_pretrained(root / f"ref{k}")
        for name, tensor in load_file(root / f"ref{k}" / "model.safetensors").items():
            if name.startswith("model.layers.0."):
                tensors[f"model.mtp_layers.{k}." + name.removeprefix("model.layers.0.")] = tensor
        own = {
            "linear_projection": (0.3 * rng.standard_normal((d, 2 * d))).astype(np.float32),
            "e_norm": (1 + 0.3 * rng.standard_normal(d)).astype(np.float32),
            "h_norm": (1 + 0.3 * rng.standard_normal(d)).astype(np.float32),
        }
        tensors.update({f"model.mtp_layers.{k}.{n}.weight": v for n, v in own.items()})
        refs.append((ref, own))
    save_checkpoint(root, tensors, use_mtp=True, num_mtp_modules=modules, mtp_transformer_layers=1)
    return main, refs


def m2_reference(main, refs, tokens: np.ndarray) -> list[np.ndarray]:
    """SGLang's MiniMaxM2ForCausalLMNextN.forward per module: linear_projection of
    [h_norm(hidden), e_norm(embedding of token i + k + 1)], the layer (the one-layer model's,
    its final norm the model's model.norm), the head; module k's hidden the main model's
    final-normed states for the first, module k - 1's output after that norm for the next."""
    eps, out = main.config.rms_norm_eps, []
    with torch.no_grad():
        h = main.model(torch.tensor(tokens)).last_hidden_state
        for k, (ref, own) in enumerate(refs):
            ahead = np.concatenate([tokens[:, k + 1 :], np.zeros((tokens.shape[0], k + 1), tokens.dtype)], axis=1)
            e = main.model.embed_tokens(torch.tensor(ahead))
            pair = [_rms(h, own["h_norm"], eps), _rms(e, own["e_norm"], eps)]
            h = ref.model(
                inputs_embeds=torch.cat(pair, -1) @ torch.tensor(own["linear_projection"]).T
            ).last_hidden_state
            out.append(main.lm_head(h).numpy())
    return out


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.tensor(w)


CUT = 11
LAYOUTS = {
    "m3": (np.tile(np.arange(19), (2, 1)), np.ones((2, 19), int), [(0, slice(0, 19)), (1, slice(0, 19))]),
    "m2": (
        np.stack([np.r_[np.arange(CUT), np.arange(19 - CUT)], np.arange(19)]),
        np.stack([np.r_[np.ones(CUT, int), np.full(19 - CUT, 2)], np.ones(19, int)]),
        [(0, slice(0, CUT)), (0, slice(CUT, 19)), (1, slice(0, 19))],
    ),
}
"""Per case: (positions, segment ids, documents as (row, columns)); M2's row 0 two documents
packed, M3's a document per row."""


def _converted(root) -> dict:
    messages: list[str] = []
    convert_hf(root / "hf", root / "converted", log=messages.append)
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(root=root, cfg=cfg, compute=compute, params=params, messages=messages)


def _run(case, layout) -> tuple:
    """(main logits, each module's logits, aux, gradients of the aux loss, L_MTP after one
    step along them) of TOKENS laid out as `layout`, under compute.mtp_loss 0.3: one jitted
    forward, twice."""
    graphdef = graphdef_of(case["cfg"], case["compute"].model_copy(update={"mtp_loss": 0.3}))
    positions, segments, _ = layout
    batch = [jnp.asarray(x) for x in (TOKENS, positions, segments)]

    def loss(params):
        logits = []

        def seen(model, hidden, *args):  # the loss's own logits, and what forward handed the modules
            logits.extend(depth for depth, _ in mtp_depth_logits(model, hidden, *args))
            return mtp_loss(model, hidden, *args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(transformer, "mtp_loss", seen)
            main, aux = nnx.merge(graphdef, params).forward(*batch)
        return aux["aux_loss"], (aux, [main, *logits])

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, (aux, (main, *logits))), grads = step(case["params"])
    mtp = [*case["cfg"].mtp_head_names(), "mtp_blocks"]
    moved = {
        k: jax.tree.map(lambda p, g: p - 0.5 * g, v, grads[k]) if k in mtp else v for k, v in case["params"].items()
    }
    (_, (after, _)), _ = step(moved)
    return np.asarray(main), [np.asarray(x) for x in logits], jax.device_get(aux), grads, float(after["mtp_loss"])


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    root = tmp_path_factory.mktemp("m3_mtp")
    main, ref, own = m3_checkpoint(root)
    case = _converted(root)

    def reference(tokens):  # (main logits, [module logits]) of one document
        with torch.no_grad():
            logits = main(torch.tensor(tokens)).logits.numpy()
        return logits, [m3_reference(main, ref, own, tokens)]

    return {**case, "reference": reference, "layout": LAYOUTS["m3"]}


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2_mtp")
    main, refs = m2_checkpoint(root)
    case = _converted(root)

    def reference(tokens):
        with torch.no_grad():
            logits = main(torch.tensor(tokens)).logits.numpy()
        return logits, m2_reference(main, refs, tokens)

    return {**case, "reference": reference, "layout": LAYOUTS["m2"]}


@pytest.fixture(scope="module")
def runs(m3, m2):
    """Per case: (its case, the engine's run, the reference's (main, modules) logits of each
    document alone)."""
    out = {}
    for name, case in (("m3", m3), ("m2", m2)):
        refs = [case["reference"](TOKENS[row : row + 1, cols]) for row, cols in case["layout"][2]]
        out[name] = (case, _run(case, case["layout"]), refs)
    return out


def test_conversion_keeps_the_modules(m3, m2):
    """Counted in the weights; M3's layer block-sparse although the decoder's last layer is
    full attention, M2's the decoder's layer, its output norm the model's (no norm of its own)."""
    cfg = m3["cfg"]
    assert cfg.mtp_layers == 1 and not any("skipped" in m or "ignored" in m for m in m3["messages"]), m3["messages"]
    assert cfg.layer_pattern()[-1].mixer == "attention"
    spec = cfg.mtp_layer_spec()
    assert spec.mixer.block_indexer.topk_blocks == 2 and spec.ffn.kind == "moe" and spec.ffn.shared_dim == 11
    assert m3["params"]["mtp"]["w_eh_xd"].shape == (2 * cfg.d_model, cfg.d_model)
    cfg = m2["cfg"]
    assert cfg.mtp_layers == 2 and not any("skipped" in m or "ignored" in m for m in m2["messages"]), m2["messages"]
    assert cfg.mtp_layer_kind.hidden_first and cfg.mtp_layer_kind.shared_final_norm
    assert sorted(m2["params"]["mtp_1"]) == ["enorm", "hnorm", "w_eh_xd"]
    spec, last = cfg.mtp_layer_spec(), cfg.layer_specs()[-1]
    assert (spec.mixer, spec.ffn) == (last.mixer, last.ffn)


@pytest.mark.parametrize("name", ["m3", "m2"])
def test_main_and_module_logits_match_the_reference_document_by_document(name, runs):
    """The main logits still transformers'; module k's at the positions whose target is in
    their document (M2's two modules chained; its packed row's documents as if alone)."""
    case, (main, modules, _, _, _), refs = runs[name]
    for (row, cols), (ref_main, ref_modules) in zip(case["layout"][2], refs, strict=True):
        delta = float(np.abs(main[row, cols] - ref_main[0]).max())
        print(f"\n{name} main, row {row} [{cols.start}, {cols.stop}): max |delta logit| = {delta:.2e}")
        assert delta <= 1e-4 and np.abs(ref_main).max() > 0.5
        assert len(modules) == len(ref_modules) == case["cfg"].mtp_layers
    assert_modules_match(name, modules, [ref_modules for _, ref_modules in refs], case["layout"][2])


@pytest.mark.parametrize("name", ["m3", "m2"])
def test_the_training_loss_adds_the_modules_cross_entropy_and_trains_them(name, runs):
    """L_MTP: the mean over modules of each one's mean cross entropy of token i + k + 2 in the
    same document (the reference's logits), added times compute.mtp_loss (0.3); the modules'
    parameters get gradients (M3's indexer and the choosing biases none: selection has no
    gradient), and one step along them lowers L_MTP."""
    case, (_, _, aux, grads, after), refs = runs[name]
    modules = [ref_modules for _, ref_modules in refs]
    mtp = assert_mtp_loss(name, aux, case["compute"], TOKENS, modules, case["layout"][2])
    print(f"{name}: L_MTP after a step {after:.6f}")
    for head in [*case["cfg"].mtp_head_names(), "mtp_blocks"]:
        for path, grad in jax.tree_util.tree_leaves_with_path(grads[head]):
            keys = jax.tree_util.keystr(path)
            assert "indexer" in keys or "b_router_e" in keys or float(jnp.abs(grad).max()) > 0, (head, keys)
    assert after < mtp


@pytest.mark.parametrize("name", ["m3", "m2"])
def test_export_writes_the_checkpoint_back_bitwise(name, m3, m2, tmp_path):
    case = {"m3": m3, "m2": m2}[name]
    assert export_bitwise(case, tmp_path / "export")["num_mtp_modules"] == case["cfg"].mtp_layers
