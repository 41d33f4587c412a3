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
import json
import logging
import re
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from engine.config import ConfigError, load_config
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from engine.inference.sample import Sampler
from engine.interop.hf.convert import convert_hf
from engine.interop.hf.export import export_hf
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf
from engine.models import moe_ep
from engine.models.common import Build
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.families.base import rope_from_hf, rope_to_hf
from engine.models.moe import MoE, clamped_swiglu, combine_stats, dropless_experts, route, router_stats
from engine.models.params import abstract_model_params, apply_model, graphdef_of, param_shardings
from engine.models.rope import rope_inverse_frequencies
from engine.models.transformer import Transformer
from engine.ops.partitioning import use_mesh
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import batch_sharding, global_array, make_mesh
from engine.posttrain.config import SFTConfig
from engine.posttrain.sft import run_sft
from engine.train.checkpoint import Checkpointer, load_params, stored_configs
from engine.train.config import OptimizerConfig, ScheduleConfig
from engine.train.optimizer import make_optimizer
from engine.train.step import lm_loss_fn
from tests.deps import need

torch = need("torch")
transformers = need("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 37
SHAPE = dict(
    vocab_size=VOCAB, d_model=12, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=6, mlp_dim=7, init_std=0.3
)


def tiny(**fields) -> ModelConfig:
    return ModelConfig(**{"family": "mixtral", **SHAPE, "num_experts": 5, "experts_per_token": 2, **fields})


def random_params(cfg: ModelConfig, compute: ComputeConfig, std: float = 0.3) -> dict:
    """N(0, std^2) values (numpy) in the model's parameter shapes, for tests whose point is not the
    initialiser: the engine's compiles one threefry program per parameter shape (~1 s each here)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s.shape) * std, s.dtype), abstract_model_params(cfg, compute, None)
    )


# --------------------------------------------------------------------------- the block


def moe_spec(cfg: ModelConfig):
    """The spec of the model's first mixture-of-experts layer."""
    return next(spec.ffn for spec in cfg.layer_specs() if spec.is_moe)


def reference_moe(block: MoE, x_nd: np.ndarray) -> np.ndarray:
    """Every expert on every token, then each token's top-k mixed: the definition, in numpy."""
    w_router = np.asarray(block.w_router_de[...], np.float64)
    logits = x_nd @ w_router
    scores = np.exp(logits - logits.max(-1, keepdims=True)) if block.score == "softmax" else 1 / (1 + np.exp(-logits))
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
        g, u, d = (
            np.asarray(w[...], np.float64)
            for w in (block.w_shared_gate_dg, block.w_shared_up_dg, block.w_shared_down_gd)
        )
        out = out + (silu(x_nd @ g) * (x_nd @ u)) @ d
    return out


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize(
    "routing",
    [
        dict(),  # Mixtral: softmax, renormalised top-k
        dict(router_score="sigmoid", router_bias=True, num_shared_experts=2),  # DeepSeek-style
        dict(router_renormalize=False, expert_mlp_dim=3),  # Qwen3-MoE without norm_topk_prob
    ],
    ids=["softmax", "sigmoid-bias-shared", "unnormalised"],
)
def test_moe_block_matches_the_per_token_definition(routing, dispatch):
    cfg = tiny(**routing)
    compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=5 / 2)  # capacity >= every token
    block = MoE(moe_spec(cfg), Build.of(cfg, compute), rngs=nnx.Rngs(3))
    if cfg.moe.router_bias:  # a bias big enough to change choices, which must not change the weights
        block.b_router_e[...] = jnp.asarray([0.0, 0.4, -0.4, 0.2, 0.0])
    x = np.random.default_rng(0).normal(size=(2, 11, cfg.d_model)).astype(np.float32)
    out, stats = block(jnp.asarray(x))
    ref = reference_moe(block, x.reshape(-1, cfg.d_model).astype(np.float64)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)
    assert np.abs(ref).max() > 0.3
    np.testing.assert_allclose(float(np.sum(stats.assigned_e)), cfg.moe.experts_per_token, rtol=1e-6)


def test_capacity_dispatch_drops_the_assignments_past_capacity():
    """Capacity 1: per sequence each expert takes one assignment, first choices first; the
    others contribute nothing, exactly as if their routing weight were 0."""
    cfg = tiny()
    compute = ComputeConfig(moe_dispatch="capacity", moe_capacity_factor=0.01)
    block = MoE(moe_spec(cfg), Build.of(cfg, compute), rngs=nnx.Rngs(1))
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
    expected = np.stack(
        [
            sum(weights[n, s] * ((silu(x[0, n] @ gate[e]) * (x[0, n] @ up[e])) @ down[e]) for s, e in enumerate(top[n]))
            for n in range(11)
        ]
    )
    assert 0 < kept.sum() < kept.size  # some dropped, some kept
    np.testing.assert_allclose(np.asarray(out[0]), expected, atol=2e-5, rtol=1e-4)


def test_balance_loss_equals_transformers_load_balancing_loss_func():
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
    np.testing.assert_allclose(float(combined["router_z_loss"]), np.mean(lse**2), rtol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(combined["expert_load_e"])), 1.0, rtol=1e-6)


def test_a_sigmoid_routers_balance_probabilities_are_its_scores_normalised_per_token():
    """DeepSeek-V3's balance loss weighs each expert by its sigmoid score over the token's
    scores' sum, not by a softmax; padding rows count for nothing."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(6, 4)) * 2, jnp.float32)
    _, experts = route(logits, None, 2, "sigmoid", True)
    valid = jnp.asarray([True] * 5 + [False])
    stats = router_stats(logits, experts, valid, 4, "sigmoid")
    scores = 1 / (1 + np.exp(-np.asarray(logits[:5])))
    np.testing.assert_allclose(stats.probability_e, (scores / scores.sum(-1, keepdims=True)).mean(0), rtol=1e-6)
    assert not np.allclose(stats.probability_e, router_stats(logits, experts, valid, 4).probability_e, rtol=1e-3)


def test_dropless_and_capacity_agree_when_nothing_is_dropped():
    """The training loss, router losses, expert loads and gradients of the whole model."""
    cfg = tiny(attention_pattern=["local", "global"], sliding_window=4)  # mixed: the unit scan and a left-over layer
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)))
    results = {}
    for dispatch in ("dropless", "capacity"):
        compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=5 / 2)
        graphdef = graphdef_of(cfg, compute)
        params = random_params(cfg, compute)
        batch = {
            "tokens": tokens,
            "positions": None,
            "segment_ids": None,
            "targets": jnp.roll(tokens, -1, 1),
            "loss_mask": jnp.ones(tokens.shape),
        }
        loss_fn = lm_loss_fn(graphdef)
        (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, 18.0)
        results[dispatch] = (loss, aux, grads)
    (loss_a, aux_a, grads_a), (loss_b, aux_b, grads_b) = results["dropless"], results["capacity"]
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    assert set(aux_a) == set(aux_b) and {"moe_balance_loss", "moe_router_z_loss", "moe_load/4"} <= set(aux_a)
    for key in aux_a:
        np.testing.assert_allclose(float(aux_a[key]), float(aux_b[key]), rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5 * float(np.abs(a).max()))


def test_a_dense_family_with_experts_and_an_moe_family_without_are_refused():
    with pytest.raises(ValueError, match="family 'llama' has no experts .*mixtral, qwen3_moe"):
        ModelConfig(**SHAPE, num_experts=4)
    with pytest.raises(ValueError, match="family 'mixtral' is a mixture of experts, so num_experts must be set"):
        ModelConfig(**SHAPE, family="mixtral")
    with pytest.raises(ValueError, match=r"experts_per_token \(6\) exceeds num_experts \(5\)"):
        tiny(experts_per_token=6)


# --------------------------------------------------------------------------- Hugging Face parity

HF_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    intermediate_size=26,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)


def hf_config(family: str):
    if family == "mixtral":  # 5 experts, top-2, a sliding window shorter than the rows
        return transformers.MixtralConfig(**HF_COMMON, num_local_experts=5, sliding_window=5)
    # narrower experts than the dense width, top-k weights not renormalised (Qwen3-MoE's default),
    # YaRN with an original context short enough to matter here
    return transformers.Qwen3MoeConfig(
        **HF_COMMON,
        num_experts=5,
        moe_intermediate_size=10,
        norm_topk_prob=False,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
        },
    )


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family), attn_implementation="eager", experts_implementation="eager"
    ).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
    model.eval().save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(
        family=family, model=model, hf_dir=root / "hf", out=root / "converted", cfg=cfg, compute=compute, params=params
    )


def padded_batch():
    """Three rows of 20 tokens: full, right-padded, left-padded."""
    tokens = np.random.default_rng(1).integers(0, VOCAB, (3, 20))
    mask = np.ones_like(tokens)
    mask[1, 14:] = 0
    mask[2, :6] = 0
    return tokens, mask


def hf_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()


def test_converted_moe_matches_transformers_logits_and_routing_is_sensitive(case):
    cfg = case["cfg"]
    assert cfg.family == case["family"] and cfg.moe.num_experts == 5 and cfg.moe.experts_per_token == 2
    assert (cfg.rope.scaling is not None) == (case["family"] == "qwen3_moe")  # YaRN
    tokens, mask = padded_batch()
    ours = np.asarray(
        apply_model(graphdef_of(cfg, case["compute"]), case["params"], jnp.asarray(tokens), None, jnp.asarray(mask))
    )
    ref = hf_logits(case["model"], tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case['family']}: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    # The routing is close enough to its margins that a 5% change of the router moves choices,
    # so matching logits means matching routing.
    with torch.no_grad():
        out = case["model"](torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
        chosen = [torch.topk(r, 2).indices.sort().values for r in out.router_logits]
        loads = torch.bincount(chosen[0].flatten(), minlength=5)
        assert loads.min() > 0 and loads.max() > loads.min()  # every expert used, unevenly
        gates = [m for n, m in case["model"].named_modules() if n.endswith(".gate")]
        saved = [g.weight.clone() for g in gates]
        for g in gates:
            g.weight.mul_(1 + 0.05 * torch.randn_like(g.weight))
        moved = case["model"](torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
        for g, w in zip(gates, saved):
            g.weight.copy_(w)
    changed = sum(
        int((torch.topk(r, 2).indices.sort().values != c).any(-1).sum()) for r, c in zip(moved.router_logits, chosen)
    )
    assert changed > 0


def test_greedy_generation_with_the_engine_sampler_is_identical(case):
    assert_greedy_tokens_equal_transformers(case, VOCAB)


def assert_greedy_tokens_equal_transformers(case, vocab: int, prompt_len: int = 7, new_tokens: int = 16):
    """Two random prompts, greedy: the engine's Sampler on the converted checkpoint produces
    the tokens transformers' generate does (no EOS stop)."""
    prompt = np.random.default_rng(2).integers(0, vocab, (2, prompt_len))
    case["model"].generation_config.eos_token_id = None
    with torch.no_grad():
        out = case["model"].generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    ref = out[:, prompt_len:].numpy()
    ours = Sampler(case["cfg"], case["compute"])(
        case["params"], prompt, np.ones_like(prompt), max_new_tokens=new_tokens, temperature=0.0
    )
    assert ref.shape == (2, new_tokens)
    np.testing.assert_array_equal(ours.tokens, ref)


def export_loads_cleanly(case, directory):
    """Export the case's checkpoint to `directory` and load it in transformers: every tensor
    used, none missing, no warning about either, the same model class. Returns the model."""
    export_hf(case["out"] / "checkpoint", directory)
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    logging.getLogger("transformers").addHandler(handler)
    try:
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            directory, output_loading_info=True, attn_implementation="eager", experts_implementation="eager"
        )
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert "were not initialized" not in records.getvalue() and "not used" not in records.getvalue()
    assert type(reloaded) is type(case["model"])
    return reloaded


def test_export_loads_cleanly_in_transformers_and_converts_back_bitwise(case, tmp_path):
    reloaded = export_loads_cleanly(case, tmp_path / "export")
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    np.testing.assert_array_equal(
        hf_logits(reloaded.eval(), tokens, mask)[valid], hf_logits(case["model"], tokens, mask)[valid]
    )
    # every key transformers wrote for the source model, with its value
    ours = json.loads((tmp_path / "export" / "config.json").read_text())
    source = json.loads((case["hf_dir"] / "config.json").read_text())
    for key, value in source.items():
        if key not in ("transformers_version", "bos_token_id", "eos_token_id"):
            assert ours.get(key, "<missing>") == value, f"{key}: {ours.get(key, '<missing>')!r} != {value!r}"
    convert_hf(tmp_path / "export", tmp_path / "again")
    cfg, params, _ = load_params(tmp_path / "again" / "checkpoint")
    assert cfg == case["cfg"]
    for a, b in zip(jax.tree.leaves(case["params"]), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_x_fsdp_x_data_parallel_equals_one_device(dispatch):
    """Mesh expert=2 x fsdp=2 x data=2 on 8 simulated devices: the experts' weights split over
    `expert`, the same training loss (router losses included) and gradients as one device;
    both dispatches move tokens to the experts' devices with all-to-alls (dropless:
    engine/models/moe_ep.py)."""
    cfg = tiny(num_layers=2, num_experts=4, mlp_dim=8)
    compute = ComputeConfig(moe_dispatch=dispatch, moe_capacity_factor=2.0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (8, 8))
    segments = np.ones((8, 8), np.int32)
    segments[3, 5:] = 0  # padding: left out of the loss and of the router's statistics
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(8), (8, 8)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": segments.astype(np.float32),
    }
    assert_mesh_step_equals_one_device(
        cfg, compute, random_params(cfg, compute), batch, MeshConfig(data=2, expert=2, fsdp=2)
    )


def assert_mesh_step_equals_one_device(cfg, compute, host_params, batch, mesh_config, denominator: float = 61.0):
    """The loss, the router's balance loss and every gradient of one step on `mesh_config`'s 8
    simulated devices equal one device's; with an expert axis the experts split over it and the
    tokens reach them by all-to-all. Returns the mesh step's compiled HLO text."""
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    results, text = {}, None
    for name, mesh in (("one", make_mesh(MeshConfig(data=1), jax.devices()[:1])), ("mesh", make_mesh(mesh_config))):
        params = jax.device_put(host_params, param_shardings(cfg, compute, mesh)[1])
        sharded = {k: global_array(v, batch_sharding(mesh)) for k, v in batch.items()}
        with use_mesh(mesh):
            compiled = step.lower(params, sharded, denominator).compile()
        (loss, aux), grads = compiled(params, sharded, denominator)
        results[name] = float(loss), float(aux["moe_balance_loss"]), jax.tree.map(np.asarray, grads)
        if name == "mesh" and mesh_config.expert > 1:
            assert params["blocks"]["mlp"]["w_gate_edf"].sharding.spec[:2] == (None, "expert")
            assert "all-to-all" in compiled.as_text()
        text = compiled.as_text()
    (loss_1, balance_1, grads_1), (loss_8, balance_8, grads_8) = results["one"], results["mesh"]
    assert np.isfinite(loss_1) and loss_8 == pytest.approx(loss_1, rel=1e-6)
    assert balance_8 == pytest.approx(balance_1, rel=1e-6)
    for path, a in jax.tree_util.tree_leaves_with_path(grads_1):
        b = grads_8
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(
            b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max()), err_msg=jax.tree_util.keystr(path)
        )
    return text


def test_dropless_on_an_fsdp_mesh_sorts_each_devices_own_assignments():
    """data=2 x fsdp=4 without an expert axis: each device sorts its own rows' (token, expert)
    assignments (engine/models/moe_ep.py); left to GSPMD, every device sorted the whole batch's
    (the (128 x 4,096 x 6, d) buffers DeepSeek-V4-Flash's v5p-256 plan ran out of memory on). The
    loss and every gradient equal one device's."""
    rows, t, k = 8, 8, 2
    cfg = tiny(num_layers=2, num_experts=4, mlp_dim=8, experts_per_token=k)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (rows, t))
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t), (rows, t)),
        "segment_ids": np.ones((rows, t), np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": np.ones((rows, t), np.float32),
    }
    compute = ComputeConfig(moe_dispatch="dropless")
    mesh = MeshConfig(data=2, fsdp=4)
    text = assert_mesh_step_equals_one_device(cfg, compute, random_params(cfg, compute), batch, mesh)
    assignments = rows * t * k
    sorted_lengths = {int(n) for n in re.findall(r"\[(\d+)\]\S* sort\(", text)}
    assert assignments // 8 in sorted_lengths and assignments not in sorted_lengths, sorted_lengths


@pytest.mark.parametrize("with_biases", [True, False])
def test_expert_parallel_dropless_with_a_tensor_axis_equals_the_plain_dropless(with_biases):
    """data=2 x expert=2 x tensor=2: the expert MLP width split over `tensor` (the down
    projection's partial sums summed over it), GPT-OSS's expert biases and clamped SwiGLU; the
    values and every gradient equal the single-device grouped matmul's."""
    rng = np.random.default_rng(3)
    n, d, f, e, k = 32, 6, 8, 4, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    weights, experts = route(jnp.asarray(rng.normal(size=(n, e)) * 3, jnp.float32), None, k, "softmax", True)
    assert len(np.unique(np.asarray(experts))) == e  # every expert, so every shard, gets rows
    w = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((e, d, f), (e, d, f), (e, f, d))]
    b = (
        [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((e, f), (e, f), (e, d))]
        if with_biases
        else None
    )
    glu = lambda gate, up: clamped_swiglu(gate, up, limit=1.5, alpha=1.702)  # noqa: E731 (a limit the values reach)
    mesh = make_mesh(MeshConfig(data=2, expert=2, tensor=2))
    assert moe_ep.applies(mesh, n) and not moe_ep.applies(mesh, 2)  # 2 rows do not split over 4 batch devices

    def loss(fn, x, w, b):
        return jnp.sum(jnp.sin(fn(x, experts, weights, *w, glu, b)))

    plain = jax.jit(jax.value_and_grad(lambda *a: loss(dropless_experts, *a), argnums=(0, 1, 2)))(x, w, b)
    ep = partial(moe_ep.expert_parallel_dropless, mesh=mesh)
    compiled = (
        jax.jit(jax.value_and_grad(lambda *a: loss(lambda *c: ep(*c[:7], biases=c[7]), *a), argnums=(0, 1, 2)))
        .lower(x, w, b)
        .compile()
    )
    assert "all-to-all" in compiled.as_text() and "all-reduce" in compiled.as_text()
    value, grads = compiled(x, w, b)
    assert float(value) == pytest.approx(float(plain[0]), rel=1e-5)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * float(np.abs(theirs).max()))


@pytest.fixture(scope="module")
def deepseek_step():
    """The tiny DeepSeek-V3's parameters (a routing bias set), its gradients and aux on one
    batch: the same for every rate, so computed once."""
    cfg = ModelConfig.model_validate(
        yaml.safe_load((REPO / "configs" / "models" / "tiny-deepseek-v3.yaml").read_text())
    )
    compute = ComputeConfig(scan_layers=True)
    graphdef = graphdef_of(cfg, compute)
    params = random_params(cfg, compute)
    params["blocks"]["mlp"]["b_router_e"] = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8)) * 0.1, jnp.float32)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 16))
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(16), (4, 16)),
        "segment_ids": np.ones((4, 16), np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": np.ones((4, 16), np.float32),
    }
    (_, aux), grads = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef), has_aux=True))(params, batch, 64.0)
    return params, grads, aux


@pytest.mark.parametrize("rate", [1e-3, 0.0])
def test_a_choosing_bias_moves_against_its_layers_load_imbalance_and_nothing_else_changes(rate, deepseek_step):
    """DeepSeek-V3's auxiliary-loss-free balancing: each step every MoE layer's routing bias
    moves by `rate` per expert, down for experts over the mean load, up under it; the other
    parameters get AdamW's update exactly as without the bias, and rate 0 keeps it as loaded."""
    params, grads, aux = deepseek_step
    # The bias's gradient is each layer's imbalance: the per-layer loads, minus their mean.
    imbalance = np.asarray(grads["blocks"]["mlp"]["b_router_e"])
    assert imbalance.shape == (2, 8) and np.allclose(imbalance.sum(-1), 0, atol=1e-6) and np.abs(imbalance).max() > 0
    loads = np.asarray([aux[f"moe_load/{e}"] for e in range(8)])  # shares of the assignments, layer mean
    np.testing.assert_allclose(imbalance.mean(0) + 2 / 8, 2 * loads, atol=1e-6)
    opt = OptimizerConfig(router_bias_update_rate=rate, weight_decay=0.1)
    tx, _ = make_optimizer(opt, ScheduleConfig(kind="constant"), 10, params)
    # Jitted, as in training (op by op, the first update dispatches hundreds of tiny programs: ~20 s).
    first_update = lambda tx, grads, params: tx.update(grads, tx.init(params), params)[0]  # noqa: E731
    updates = jax.jit(partial(first_update, tx))(grads, params)
    np.testing.assert_array_equal(np.asarray(updates["blocks"]["mlp"]["b_router_e"]), -rate * np.sign(imbalance))
    # Every other leaf: plain AdamW on the gradients without the bias's.
    rest = lambda tree: {
        **tree,
        "blocks": {
            **tree["blocks"],
            "mlp": {  # noqa: E731
                k: v for k, v in tree["blocks"]["mlp"].items() if k != "b_router_e"
            },
        },
    }
    plain, _ = make_optimizer(opt, ScheduleConfig(kind="constant"), 10, rest(params))
    expected = jax.jit(partial(first_update, plain))(rest(grads), rest(params))
    for ours, theirs in zip(jax.tree.leaves(rest(updates)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-12)


# --------------------------------------------------------------------------- post-training


def test_sft_on_a_mixture_of_experts_checkpoint_learns_and_logs_the_router(tmp_path):
    """SFT from an MoE checkpoint: the completions are learnt, the router's losses and every
    expert's load are in metrics.jsonl, the result is still the same architecture."""
    bundle = train_tokenizer(
        TokenizerConfig(vocab_size=300), ["the quick brown fox jumps " * 20, "colour red"], add_bos=True
    )
    save_tokenizer(bundle, tmp_path / "base" / "tokenizer")
    cfg = ModelConfig(
        family="mixtral",
        vocab_size=300,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        max_seq_len=64,
        num_experts=4,
        experts_per_token=2,
    )
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    checkpointer = Checkpointer(tmp_path / "base" / "checkpoint", async_save=False)
    checkpointer.save(
        0,
        params,
        {"unused": np.zeros((), np.int32)},
        {"step": 0, "model": cfg.model_dump(mode="json"), "format": "trainflow.checkpoint/1"},
        {},
    )
    checkpointer.close()
    data = tmp_path / "pairs.jsonl"
    colours = ["red", "green", "blue"]
    data.write_text(
        "".join(
            json.dumps({"prompt": f"colour {i % 3}:", "completion": f" {colours[i % 3]}"}) + "\n" for i in range(40)
        )
    )
    config = load_config(
        tree={
            "checkpoint": {
                "init_from": str(tmp_path / "base" / "checkpoint"),
                "directory": str(tmp_path / "run" / "ckpt"),
                "every_steps": 100,
                "async_save": False,
            },
            "data": {"path": str(data), "seq_len": 32, "batch_size": 8, "eval_fraction": 0.2},
            "optimizer": {"learning_rate": 1e-2},
            "schedule": {"kind": "constant"},
            "steps": 25,
            "log_every": 5,
            "progress": False,
            "metrics_dir": str(tmp_path / "run"),
        },
        schema=SFTConfig,
    )
    result = run_sft(config)
    assert result["eval_loss"] < 0.25 * np.log(300), result["eval_loss"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "moe_balance_loss" in r]
    assert train and all(0 < r["moe_balance_loss"] < 4 and r["moe_router_z_loss"] > 0 for r in train)  # k=2 balanced
    assert sum(train[-1][f"moe_load/{e}"] for e in range(4)) == pytest.approx(1.0, abs=1e-4)
    assert load_params(tmp_path / "run" / "ckpt")[0] == cfg


# --------------------------------------------------------------------------- YaRN


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 16},  # Qwen3's long context
        {
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },  # DeepSeek-V3's
        {"factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.3, "truncate": False},
    ],
    ids=["qwen3", "deepseek-mscale", "explicit-factor-untruncated"],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=4 * rope["original_max_position_embeddings"],
        rope_parameters=params,
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, scaling = rope_from_hf(params, "config.json")
    scaling = ModelConfig(**SHAPE, rope_scaling=scaling).rope.scaling
    np.testing.assert_allclose(
        np.asarray(rope_inverse_frequencies(16, theta, scaling)), ref_inv_freq.numpy(), rtol=1e-6
    )
    assert scaling.yarn_attention_factor() == pytest.approx(ref_factor, rel=1e-9)
    assert rope_from_hf({**rope_to_hf(scaling), "rope_theta": theta}, "again")[1] == rope_from_hf(params, "x")[1]


def test_what_the_engine_does_not_implement_is_refused_by_name():
    base = {
        "vocab_size": 17,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 7,
    }
    qwen = {**base, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
    # dense layers among the expert ones are a layer pattern (tests/test_hf_patterns.py); nonsense is refused
    assert model_config_from_hf({**qwen, "num_experts_per_tok": 2, "decoder_sparse_step": 2})[0].ffn_pattern == [
        "mlp",
        "moe",
    ]
    assert model_config_from_hf({**qwen, "num_experts_per_tok": 2, "mlp_only_layers": [1]})[0].ffn_pattern == [
        "moe",
        "mlp",
    ]
    with pytest.raises(ConfigError, match=r"decoder_sparse_step must be a whole number >= 1, got 0"):
        model_config_from_hf({**qwen, "decoder_sparse_step": 0})
    with pytest.raises(ConfigError, match=r"mlp_only_layers must list layers in \[0, 2\), got \[2\]"):
        model_config_from_hf({**qwen, "mlp_only_layers": [2]})
    mixtral = {**base, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ConfigError, match=r"router_jitter_noise=0.1 is not supported \(only 0\)"):
        model_config_from_hf({**mixtral, "router_jitter_noise": 0.1})
    with pytest.raises(ConfigError, match=r"RoPE type 'yarn' needs factor and original_max_position_embeddings"):
        model_config_from_hf({**mixtral, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # a Mixtral with a field its config.json cannot hold is refused at export, naming it
    cfg, _ = model_config_from_hf(mixtral)
    with pytest.raises(
        ConfigError, match=r"model.router_score='sigmoid' cannot be expressed as a Hugging Face Mixtral"
    ):
        model_config_to_hf(cfg.model_copy(update={"router_score": "sigmoid"}))
