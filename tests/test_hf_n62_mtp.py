"""Multi-token prediction of the families whose checkpoints publish it beside a decoder that
transformers 5.25 builds without it (issue 62): DeepSeek-V4 (`mtp.{k}.*`, its inference
code's MTPBlock: e_proj/h_proj over the residual streams, a sliding_attention layer, its own
streams' mix) and MiMo-V2-Flash (`model.mtp.layers.{k}.*`, as SGLang's reference reads it:
DeepSeek-V3's module around a sliding-window layer with a dense MLP).

transformers has no module for either, so the reference is built from its own layers: a
one-layer transformers model of the module's layer kind, drawn at random, whose decoder
layer, final norm (and DeepSeek-V4's streams' mix) are the module's; the checkpoint in the
published layout is the main model's tensors beside that model's, renamed as the publishers
name them, and the module's own projections and norms. Checked: conversion keeps the modules
(MiMo's counted in the weights, its config.json does not say), each module's logits equal the
reference's to 1e-4 (MiMo's two modules chained, DeepSeek-V3's recipe), the training loss's
multi-token term equals the reference's cross entropy averaged over modules (packed documents
included) and reaches the modules' parameters, and export writes the published layout back
bitwise.
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
from tests import test_hf_n62_dsv4 as dsv4  # noqa: E402
from tests import test_hf_n62_new_a as new_a  # noqa: E402
from tests.test_hf_parity import random_causal_lm  # noqa: E402

VOCAB = 37
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def _saved(model, root) -> dict[str, np.ndarray]:
    """The tensors transformers saves of `model` (its checkpoint names)."""
    model.save_pretrained(root)
    return load_file(root / "model.safetensors")


def _own(rng, d: int, shape) -> np.ndarray:
    """A module's own tensor: a norm's weight near 1, a projection N(0, 0.3^2)."""
    if len(shape) == 1:
        return (1 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    return (0.3 * rng.standard_normal(shape)).astype(np.float32)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ahead(tokens: np.ndarray, k: int) -> np.ndarray:
    return np.concatenate([tokens[:, k:], np.zeros((tokens.shape[0], k), tokens.dtype)], axis=1)


# ------------------------------------------------------------------ the published checkpoints


def save_checkpoint(root, tensors: dict[str, np.ndarray], **published) -> None:
    """root/hf: `tensors` as model.safetensors beside root/main's config.json with the
    `published` keys (the modules' count) added."""
    (root / "hf").mkdir()
    save_file(tensors, root / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "main" / "config.json").read_text())
    (root / "hf" / "config.json").write_text(json.dumps({**config, **published}))


def mimo_checkpoint(root, modules: int = 2):
    """(main model, [(reference model, eh_proj, enorm, hnorm)] per module) of a MiMo-V2-Flash
    checkpoint written to `root` in the published layout: model.mtp.layers.{k}. holds a
    sliding layer with a dense MLP (pre_mlp_layernorm its MLP's norm) and final_layernorm."""
    main = random_causal_lm(new_a.hf_config("mimo_v2_flash"), 0, **EAGER)
    tensors = _saved(main, root / "main")
    d, rng = main.config.hidden_size, np.random.default_rng(3)
    one = new_a.hf_config("mimo_v2_flash")
    one.num_hidden_layers, one.layer_types, one.mlp_layer_types = 1, ["sliding_attention"], ["dense"]
    refs = []
    for k in range(modules):
        ref = random_causal_lm(one, 10 + k, **EAGER)
        ref.model.embed_tokens.weight.data.copy_(main.model.embed_tokens.weight)
        ref.lm_head.weight.data.copy_(main.lm_head.weight)
        prefix, saved = f"model.mtp.layers.{k}.", _saved(ref, root / f"ref{k}")
        for name, tensor in saved.items():
            if name.startswith("model.layers.0."):
                rest = name.removeprefix("model.layers.0.").replace("post_attention_layernorm", "pre_mlp_layernorm")
                tensors[prefix + rest] = tensor
        tensors[prefix + "final_layernorm.weight"] = saved["model.norm.weight"]
        own = {n: _own(rng, d, s) for n, s in (("eh_proj", (d, 2 * d)), ("enorm", (d,)), ("hnorm", (d,)))}
        tensors.update({prefix + f"{n}.weight": v for n, v in own.items()})
        refs.append((ref, own))
    save_checkpoint(root, tensors)
    return main, refs


def mimo_reference(main, refs, tokens: np.ndarray) -> list[np.ndarray]:
    """Each module's logits (b, t, v): module k reads module k - 1's output (the main model's
    final-normed states for the first) and the embedding of token i + k + 1, SGLang's order
    [enorm(embedding), hnorm(hidden)], then its layer and final_layernorm (the one-layer model)."""
    eps = main.config.rms_norm_eps
    out = []
    with torch.no_grad():
        h = main.model(torch.tensor(tokens)).last_hidden_state
        for k, (ref, own) in enumerate(refs):
            e = main.model.embed_tokens(torch.tensor(_ahead(tokens, k + 1)))
            joined = torch.cat([_rms(e, torch.tensor(own["enorm"]), eps), _rms(h, torch.tensor(own["hnorm"]), eps)], -1)
            h = ref.model(inputs_embeds=joined @ torch.tensor(own["eh_proj"]).T).last_hidden_state
            out.append(main.lm_head(h).numpy())
    return out


def dsv4_checkpoint(root):
    """(main model, reference model, own tensors) of a DeepSeek-V4 checkpoint with one
    multi-token-prediction module written to `root` as DeepSeek publishes it: mtp.0. holds a
    sliding_attention layer with scored experts (DeepSeek's names, as transformers saves a
    layer), e_proj, h_proj, enorm, hnorm, norm and hc_head_fn/base/scale."""
    main = dsv4.random_hf_model()
    tensors = _saved(main, root / "main")
    one = transformers.DeepseekV4Config(
        **{**dsv4.SMALL, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}
    )
    ref = random_causal_lm(one, 5, **dsv4.IMPLEMENTATIONS)
    with torch.no_grad():
        for name, buffer in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape))
        ref.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        ref.lm_head.weight.copy_(main.lm_head.weight)
    saved = _saved(ref, root / "ref")
    for name, tensor in saved.items():
        if name.startswith("model.layers.0."):
            tensors["mtp.0." + name.removeprefix("model.layers.0.")] = tensor
    tensors["mtp.0.norm.weight"] = saved["model.norm.weight"]
    for part in ("fn", "base", "scale"):
        tensors[f"mtp.0.hc_head_{part}"] = saved[f"model.hc_head.hc_{part}"]
    d, rng = main.config.hidden_size, np.random.default_rng(4)
    own = {n: _own(rng, d, s) for n, s in (("e_proj", (d, d)), ("h_proj", (d, d)), ("enorm", (d,)), ("hnorm", (d,)))}
    tensors.update({f"mtp.0.{n}.weight": v for n, v in own.items()})
    save_checkpoint(root, tensors, num_nextn_predict_layers=1)
    return main, ref, own


def dsv4_reference(main, ref, own, tokens: np.ndarray) -> np.ndarray:
    """DeepSeek's MTPBlock.forward: e_proj(enorm(embedding of token i + 1)) added to
    h_proj(hnorm(each of the main model's streams before their mix)), the layer over the
    streams (the one-layer model's, its input swapped in), its hc_head, its norm, the head."""
    eps = main.config.rms_norm_eps
    streams = []
    hook = main.model.hc_head.register_forward_pre_hook(lambda _, args: streams.append(args[0]))
    with torch.no_grad():
        main.model(torch.tensor(tokens))
        hook.remove()
        e = _rms(main.model.embed_tokens(torch.tensor(_ahead(tokens, 1))), torch.tensor(own["enorm"]), eps)
        h = _rms(streams[0], torch.tensor(own["hnorm"]), eps)
        x = (e @ torch.tensor(own["e_proj"]).T)[:, :, None] + h @ torch.tensor(own["h_proj"]).T
        hook = ref.model.layers[0].register_forward_pre_hook(lambda _, args: (x, *args[1:]))
        logits = ref(torch.tensor(tokens)).logits.numpy()
        hook.remove()
    return logits


# ------------------------------------------------------------------------------- the cases


def _converted(root, messages=None):
    convert_hf(root / "hf", root / "converted", log=(messages or []).append)
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return cfg, compute, params


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_mtp")
    main, refs = mimo_checkpoint(root)
    messages: list[str] = []
    cfg, compute, params = _converted(root, messages)
    return dict(root=root, main=main, refs=refs, cfg=cfg, compute=compute, params=params, messages=messages)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4_mtp")
    main, ref, own = dsv4_checkpoint(root)
    cfg, compute, params = _converted(root)
    compute = compute.model_copy(update={"indexer_ties": "torch_cpu"})
    return dict(root=root, main=main, ref=ref, own=own, cfg=cfg, compute=compute, params=params)


TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, 19))
CUT = 11
PACKED = (
    np.stack([np.r_[np.arange(CUT), np.arange(19 - CUT)], np.arange(19)]),
    np.stack([np.r_[np.ones(CUT, int), np.full(19 - CUT, 2)], np.ones(19, int)]),
    [(0, slice(0, CUT)), (0, slice(CUT, 19)), (1, slice(0, 19))],
)
"""MiMo's batch: (positions, segment ids, documents as (row, columns)): row 0 two documents
packed, row 1 one."""
UNPACKED = (np.tile(np.arange(19), (2, 1)), np.ones((2, 19), int), [(0, slice(0, 19)), (1, slice(0, 19))])
"""DeepSeek-V4's: a document per row (its decoder's compressed attention does not keep
packed documents apart yet: a second document's logits differ from it alone)."""


def _layout(case):
    return PACKED if case["cfg"].family == "mimo_v2_flash" else UNPACKED


def _engine(case, weight: float):
    """(each module's logits, the forward's aux, the aux loss's gradients) of the batch: one
    jitted call, under compute.mtp_loss `weight`."""
    graphdef = graphdef_of(case["cfg"], case["compute"].model_copy(update={"mtp_loss": weight}))
    positions, segments, _ = _layout(case)
    batch = [jnp.asarray(x) for x in (TOKENS, positions, segments)]

    def loss(params):
        logits = []

        def seen(model, hidden, *args):  # the loss's own, and what forward handed the modules
            logits.extend(depth for depth, _ in mtp_depth_logits(model, hidden, *args))
            return mtp_loss(model, hidden, *args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(transformer, "mtp_loss", seen)
            _, aux = nnx.merge(graphdef, params).forward(*batch)
        return aux["aux_loss"], (aux, logits)

    (_, (aux, logits)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(case["params"])
    return [np.asarray(x) for x in logits], jax.device_get(aux), grads


def _reference(case, tokens):
    if case["cfg"].family == "mimo_v2_flash":
        return mimo_reference(case["main"], case["refs"], tokens)
    return [dsv4_reference(case["main"], case["ref"], case["own"], tokens)]


@pytest.fixture(scope="module")
def runs(mimo, v4):
    """Per family: the engine's (logits, aux, gradients) of the batch, and the reference's
    logits of each of its documents alone."""
    out = {}
    for name, case in (("mimo", mimo), ("v4", v4)):
        refs = [_reference(case, TOKENS[row : row + 1, cols]) for row, cols in _layout(case)[2]]
        out[name] = (*_engine(case, 0.3), refs)
    return out


def test_conversion_keeps_the_modules_mimo_counted_in_its_weights(mimo, v4):
    cfg = mimo["cfg"]
    assert cfg.mtp_layers == 2 and cfg.mtp_layer_kind.local and cfg.mtp_layer_kind.ffn == "mlp"
    assert not any("skipped" in m for m in mimo["messages"]), mimo["messages"]
    spec = cfg.mtp_layer_spec()
    assert spec.mixer.sinks and spec.mixer.window == 5 and spec.ffn.kind == "mlp"
    assert mimo["params"]["mtp_1"]["w_eh_xd"].shape == (2 * cfg.d_model, cfg.d_model)
    assert v4["cfg"].mtp_layers == 1 and v4["cfg"].mtp_layer_spec().mixer.compress_ratio == 0
    assert v4["cfg"].mtp_layer_spec().ffn.hash_vocab == 0


@pytest.mark.parametrize("name", ["mimo", "v4"])
def test_each_modules_logits_match_the_reference_document_by_document(name, runs, mimo, v4):
    """Module k's logits at the positions whose target is in their document (DeepSeek-V3's
    chain over MiMo's two modules): the packed row's documents as if each were alone."""
    ours, _, _, refs = runs[name]
    assert_modules_match(name, ours, refs, _layout({"mimo": mimo, "v4": v4}[name])[2])


def assert_modules_match(name: str, ours: list, refs: list, documents: list) -> None:
    """Module k's logits (`ours[k]`, the batch's) equal the reference's of each document alone
    (`refs[j][k]`, document j's) to 1e-4 at the positions whose target (k + 2 ahead) is in it."""
    for (row, cols), ref_modules in zip(documents, refs, strict=True):
        for k, (mine, ref) in enumerate(zip(ours, ref_modules, strict=True)):
            valid = slice(0, cols.stop - cols.start - k - 2)
            a, b = mine[row, cols][valid], ref[0, valid]
            delta = float(np.abs(a - b).max())
            print(f"\n{name} module {k}, row {row} [{cols.start}, {cols.stop}): max |delta logit| = {delta:.2e}")
            assert delta <= 1e-4 and np.abs(b).max() > 0.5


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def assert_mtp_loss(name: str, aux: dict, compute, tokens: np.ndarray, refs: list, documents: list) -> float:
    """The forward's L_MTP is the mean over modules of each one's mean cross entropy of the
    `tokens` k + 2 ahead in the same document by the reference's logits (`refs[j][k]`,
    document j's alone), and its aux loss adds it times 0.3 to the router losses; returns L_MTP."""
    expected = []
    for k in range(len(refs[0])):
        nll = [
            _nll(ref[k][0, : cols.stop - cols.start - k - 2], tokens[row, cols][k + 2 :])
            for (row, cols), ref in zip(documents, refs, strict=True)
        ]
        expected.append(np.concatenate(nll).mean())
    mtp = float(aux["mtp_loss"])
    print(f"\n{name}: L_MTP {mtp:.6f}, reference {np.mean(expected):.6f} (per module {expected})")
    np.testing.assert_allclose(mtp, np.mean(expected), rtol=1e-5)
    routers = compute.moe_balance_loss * float(aux["balance_loss"])
    routers += compute.moe_router_z_loss * float(aux["router_z_loss"])
    np.testing.assert_allclose(float(aux["aux_loss"]), routers + 0.3 * np.mean(expected), rtol=1e-5)
    return mtp


@pytest.mark.parametrize("name", ["mimo", "v4"])
def test_the_training_loss_adds_the_modules_mean_cross_entropy(name, runs, mimo, v4):
    """The forward's multi-token term (the hidden states it hands the modules its own:
    DeepSeek-V4's streams before their mix): module k's targets the tokens k + 2 ahead in
    the same document, L_MTP the mean over modules of each one's mean (DeepSeek-V3's
    (1/D) sum_k L_k), added to the loss times compute.mtp_loss (0.3); every parameter of the
    modules gets a gradient."""
    _, aux, grads, refs = runs[name]
    case = {"mimo": mimo, "v4": v4}[name]
    assert len(refs[0]) == case["cfg"].mtp_layers
    assert_mtp_loss(name, aux, case["compute"], TOKENS, refs, _layout(case)[2])
    for head in case["cfg"].mtp_head_names() + ["mtp_blocks"]:
        for path, grad in jax.tree_util.tree_leaves_with_path(grads[head]):
            assert float(jnp.abs(grad).max()) > 0, (head, path)


def test_without_the_weight_the_modules_do_not_run(mimo):
    graphdef = graphdef_of(mimo["cfg"], mimo["compute"].model_copy(update={"mtp_loss": 0.0}))
    aux = jax.eval_shape(lambda params: nnx.merge(graphdef, params).forward(jnp.asarray(TOKENS))[1], mimo["params"])
    assert "balance_loss" in aux and "mtp_loss" not in aux


@pytest.mark.parametrize("name", ["mimo", "v4"])
def test_export_writes_the_published_layout_back_bitwise(name, mimo, v4, tmp_path):
    case = {"mimo": mimo, "v4": v4}[name]
    config = export_bitwise(case, tmp_path / "export")
    assert config["num_nextn_predict_layers"] == case["cfg"].mtp_layers


def export_bitwise(case, out) -> dict:
    """Exports the case's converted checkpoint to `out`, asserts its tensors are the source
    checkpoint's bit for bit (no more, no fewer), and returns its config.json."""
    export_hf(case["root"] / "converted" / "checkpoint", out)
    source = load_file(case["root"] / "hf" / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(source)
    for key, value in source.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    return json.loads((out / "config.json").read_text())
