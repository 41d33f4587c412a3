"""DeepSeek Sparse Attention (engine/models/dsa.py): DeepSeek-V3.2 and GLM-5 against
transformers 5, and the indexer's two training phases.

The tiny models keep index_topk = 5 keys per query, so on the 20-token rows (one
right-padded, one left-padded) and in 16 decoded tokens the selection decides what most
queries see; 8 indexer heads keep exact ties among its ReLU'd scores unlikely, and a GLM-5
with 2 (the `ties` case) makes them common: there the engine selects among tied keys as
torch.topk does on CPU (ComputeConfig.indexer_ties torch_cpu). A GLM-5 with indexer_types
"shared" layers (`glm_moe_dsa_shared`: no indexer of their own, the last earlier one's top-k)
is a case of its own. Each case gets test_hf_parity's checks (greedy tokens of the KV-cache
sampler, with the indexer's key cache, equal to transformers'; export -> convert bitwise;
config.json as transformers writes it), logits within 1e-5 with weights at their init scale, 1e-4 with N(0, 0.3^2) ones.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, load_config, resolve_model_preset  # noqa: E402
from engine.inference.sample import Sampler  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.models import dsa  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.dsa import indexer_kl, select_top_k  # noqa: E402
from engine.models.params import apply_model, graphdef_of  # noqa: E402
from engine.models.transformer import Transformer, layer_segments  # noqa: E402
from engine.ops.torch_cpu_topk import torch_cpu_top_k  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.config import OptimizerConfig, ScheduleConfig, TrainConfig  # noqa: E402
from engine.train.optimizer import make_optimizer  # noqa: E402
from engine.train.plan import plan_step  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from engine.train.targets import get_target  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

TOPK = 5
SIZES = dict(
    vocab_size=37,
    hidden_size=30,
    intermediate_size=26,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_rope_head_dim=4,
    qk_nope_head_dim=6,
    v_head_dim=8,
    index_topk=TOPK,
    index_head_dim=8,
    index_n_heads=8,
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=14,
    first_k_dense_replace=1,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)


SHARED = ["full", "shared", "full", "shared"]
"""GLM-5's indexer_types with layers that reuse the last earlier indexer's top-k: the dense
layer 0 and expert layer 2 select, 1 and 3 (a stack of their own, no indexer) reuse."""


def hf_config(name: str):
    if name == "deepseek_v32":  # group-limited routing: 2 groups of 3, one per token
        return transformers.DeepseekV32Config(**SIZES, n_group=2, topk_group=1)
    if name == "glm_moe_dsa_shared":
        sizes = {**SIZES, "num_hidden_layers": len(SHARED)}
        return transformers.GlmMoeDsaConfig(**sizes, n_group=1, topk_group=1, indexer_types=SHARED)
    return transformers.GlmMoeDsaConfig(**SIZES, n_group=1, topk_group=1)


CASES = ["deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_shared"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, **IMPLEMENTATIONS)
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits_to_1e4(case):
    """Scaled weights (logits up to ~6: float32 sums of another order); and the selection
    matters: all keys visible moves the logits."""
    tokens, mask = batch()
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4, f"{case.family}: max |delta logit| {delta}"
    assert case.cfg.mla.index_topk == TOPK and case.cfg.mla.index_rope_interleave == (case.cfg.family == "glm_moe_dsa")
    assert case.cfg.mla.index_shared_layers == ([1, 3] if case.family == "glm_moe_dsa_shared" else None)
    # num_params counts transformers' parameters (not the router's score bias, a buffer there),
    # the shared layers' missing indexers included
    assert sum(p.numel() for p in case.hf_model.parameters()) == case.cfg.num_params()
    dense = case.cfg.model_copy(update={"index_topk": 64})
    moved = np.abs(engine_logits(dense, case.compute, case.params, tokens, mask) - ours)[valid].max()
    assert moved > 0.1, f"{case.family}: selecting {TOPK} keys changed the logits by {moved} only"


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers_to_1e5_at_init_scale(name, tmp_path):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), **IMPLEMENTATIONS).float().eval()
    with torch.no_grad():  # transformers' init leaves these at 1 and 0: move them by their init scale
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    tokens, mask = batch()
    valid = mask.astype(bool)
    delta = np.abs(engine_logits(cfg, compute, params, tokens, mask) - hf_logits(model, tokens, mask))[valid].max()
    print(f"\n{name} at init scale: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-5


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_what_the_engine_cannot_run_is_refused_in_one_sentence():
    """GLM-5's indexer_types with a first layer that would reuse a selection before any, and
    a config whose dense layers do not come first; the older keys' schedule is read as
    transformers reads it, and training indexers is refused where some layers have none."""
    hf = {**hf_config("glm_moe_dsa").to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]}
    with pytest.raises(ConfigError, match=r"indexer_types \['shared', 'full', 'full'\] must be .* the first 'full'"):
        model_config_from_hf({**hf, "indexer_types": ["shared", "full", "full"]})
    older = {k: v for k, v in hf.items() if k != "indexer_types"}
    for keys, shared in (
        ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, [1]),
        ({"index_topk_pattern": "FFS"}, [2]),
    ):
        expected = transformers.GlmMoeDsaConfig(**{**SIZES, **keys}).indexer_types  # transformers' own reading
        assert [i for i, t in enumerate(expected) if t == "shared"] == shared
        assert model_config_from_hf(older | keys)[0].mla.index_shared_layers == shared
    shared_cfg, _ = model_config_from_hf(
        {**hf_config("glm_moe_dsa_shared").to_dict(), "architectures": hf["architectures"]}
    )
    with pytest.raises(ConfigError, match=r"indexer_loss sparse is not supported with model.index_shared_layers"):
        graphdef_of(shared_cfg, ComputeConfig(indexer_loss="sparse"))  # (the shared layers have no indexer to train)
    with pytest.raises(ConfigError, match=r"mlp_layer_types must be 3 entries, 'dense' ones first"):
        model_config_from_hf({**hf, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    cfg, _ = model_config_from_hf(hf)
    assert cfg.family == "glm_moe_dsa" and cfg.moe.first_dense_layers == 1 and cfg.mla.index_heads == 8


# --------------------------------------------------------------------------- ties at 0 (few indexer heads)

TIES = dict(index_n_heads=2, index_topk=6)
"""2 indexer heads: a key both heads' ReLU zeroes scores exactly 0, and on these rows many
queries have fewer than index_topk keys above 0, so which zeros fill their top-k is
torch.topk's tie order (CPU: libstdc++'s, engine/ops/torch_cpu_topk.py)."""


@pytest.fixture(scope="module")
def ties(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("ties")
    model = random_causal_lm(
        transformers.GlmMoeDsaConfig(**{**SIZES, **TIES}, n_group=1, topk_group=1), 0, **IMPLEMENTATIONS
    )
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    compute = stored_configs(root / "converted" / "checkpoint")[1].model_copy(update={"indexer_ties": "torch_cpu"})
    return Case("glm_moe_dsa", model, root / "hf", root / "converted", cfg, compute, params)


def test_torch_cpu_ties_select_what_torch_topk_selects():
    """torch_cpu_top_k against torch.topk itself on rows mostly of ties (0, -1, the mask's
    -1e30) among a few distinct scores, rows of every length up to 300 in two widths: both of
    torch's algorithms (nth_element; partial_sort where k * 64 <= the row's length); and an
    organ pipe of 44 (0, 1, ..., 21, 21, ..., 0), on which nth_element's median-of-3
    partitions spend their depth budget (2 * floor(log2 44) = 10 rounds) and it ends in a
    heap select, and its negation."""
    rng = np.random.default_rng(1)
    for width, k in ((24, 5), (300, 4), (44, 13)):
        rows = 60
        values = rng.choice([0.0, 0.0, 0.0, -1.0, -1e30], (rows, width)) + (
            rng.random((rows, width)) < 0.2
        ) * rng.random((rows, width))
        lengths = rng.integers(1, width + 1, rows)
        lengths[: rows // 3] = width
        if width == 44:
            values[0] = np.concatenate([np.arange(22), np.arange(22)[::-1]])
            values[1] = -values[0]
        values = values.astype(np.float32)
        picked = jax.jit(jax.vmap(lambda v, n, k=k: torch_cpu_top_k(v, k, n)))(
            jnp.asarray(values), jnp.asarray(lengths)
        )
        for row, n in enumerate(lengths):
            expected = torch.tensor(values[row, :n]).topk(min(k, int(n))).indices.tolist()
            assert {int(i) for i in np.asarray(picked[row]) if i < n} == set(expected), (width, k, n)


def test_with_two_indexer_heads_the_selection_and_logits_are_transformers(ties):
    """Logits to 1e-4 with torch_cpu ties, on the three batch() rows; the earliest-key rule
    moves them (the ties decide), and greedy decoding from the KV cache (whose indexer rows
    are as long as transformers' cache) gives transformers' generate tokens."""
    tokens, mask = batch(SIZES["vocab_size"])
    valid = mask.astype(bool)
    ref = hf_logits(ties.hf_model, tokens, mask)
    ours = engine_logits(ties.cfg, ties.compute, ties.params, tokens, mask)
    first = engine_logits(
        ties.cfg, ties.compute.model_copy(update={"indexer_ties": "first"}), ties.params, tokens, mask
    )
    delta, moved = (float(np.abs(x - ref)[valid].max()) for x in (ours, first))
    print(f"\nglm_moe_dsa, 2 indexer heads: max |delta logit| {delta:.2e} (earliest-key ties: {moved:.2e})")
    assert delta <= 1e-4 and moved > 1e-2
    prompt = np.random.default_rng(2).integers(0, SIZES["vocab_size"], (2, 7))
    ties.hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ties.hf_model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
    sampled = Sampler(ties.cfg, ties.compute)(
        ties.params, prompt.astype(np.int32), np.ones_like(prompt), max_new_tokens=16, temperature=0.0
    )
    np.testing.assert_array_equal(sampled.tokens, out[:, 7:].numpy())


# --------------------------------------------------------------------------- selection and loss


def test_top_k_selection_keeps_the_k_best_visible_keys_and_all_of_a_short_row():
    scores = jnp.asarray([[[3.0, 1.0, 2.0, 0.5, 2.5, -1e30]]])
    np.testing.assert_array_equal(select_top_k(scores, 3)[0, 0], [True, False, True, False, True, False])
    assert bool(select_top_k(scores, 6).all()) and select_top_k(scores, 9).shape == scores.shape


def test_indexer_kl_is_the_kl_from_the_head_summed_attention():
    """indexer_kl against the formula written out in NumPy: p = L1-normalised sum over heads
    of softmax(q.k * scale) over the target keys, KL(p || softmax(I)), mean over valid queries."""
    rng = np.random.default_rng(0)
    b, t, n, h = 2, 6, 3, 4
    q, k = rng.normal(size=(b, t, n, h)), rng.normal(size=(b, t, n, h))
    scores = rng.normal(size=(b, t, t))
    target = np.tril(np.ones((t, t), bool))[None] & (rng.random((b, t, t)) < 0.7)
    target |= np.eye(t, dtype=bool)[None]
    valid = np.ones((b, t), bool)
    valid[1, 4:] = False
    got = float(indexer_kl(*(jnp.asarray(a, jnp.float32) for a in (q, k)), 0.5, target, scores, valid))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * 0.5
    logits = np.where(target[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    p = (probs / probs.sum(-1, keepdims=True)).sum(1)
    p /= p.sum(-1, keepdims=True)
    i = np.where(target, scores, -np.inf)
    log_q = i - i.max(-1, keepdims=True) - np.log(np.exp(i - i.max(-1, keepdims=True)).sum(-1, keepdims=True))
    kl = np.where(target, p * (np.log(np.where(target, p, 1)) - np.where(target, log_q, 0)), 0).sum(-1)
    np.testing.assert_allclose(got, kl[valid].mean(), rtol=1e-5)


def _train_steps(preset: str, phase: str, steps: int = 1):
    """(params before, params after, the metrics of each step) of `steps` optimizer steps on a
    tiny preset, the indexer trained in `phase` (the trainer's optimizer: the warm-up trains
    the indexer alone)."""
    model = resolve_model_preset({"model": preset}, "tiny")["model"]
    cfg = ModelConfig.model_validate(model)
    compute = ComputeConfig(indexer_loss=phase)
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))[1])
    tx, _ = make_optimizer(
        OptimizerConfig(learning_rate=1e-3),
        ScheduleConfig(kind="constant", warmup_steps=0),
        steps,
        params,
        only="indexer" if phase == "warmup" else None,
    )
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
    segments = np.ones((2, 24), np.int32)
    segments[1, 17:] = 0  # a right-padded row
    data = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(24), (2, 24)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": segments.astype(np.float32),
    }
    grad_fn = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    state, current, metrics = tx.init(params), params, []
    for _ in range(steps):
        (_, aux), grads = grad_fn(current, data, jnp.sum(data["loss_mask"]))
        updates, state = tx.update(grads, state, current)
        current = jax.tree.map(lambda p, u: p + u, current, updates)
        metrics.append({k: float(v) for k, v in aux.items() if np.ndim(v) == 0})
    return params, current, metrics


def _changed(before, after) -> dict[str, bool]:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after))[0]
    return {jax.tree_util.keystr(path): changed for path, changed in flat}


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5"])
def test_the_dense_warm_up_trains_the_indexer_alone_and_lowers_its_kl(preset):
    before, after, metrics = _train_steps(preset, "warmup", steps=3)
    changed = _changed(before, after)
    indexer = {k: v for k, v in changed.items() if "'indexer'" in k}
    assert indexer and all(indexer.values()), indexer
    assert not any(v for k, v in changed.items() if "'indexer'" not in k), [k for k, v in changed.items() if v]
    assert metrics[0]["indexer_loss"] > 0 and metrics[-1]["indexer_loss"] < metrics[0]["indexer_loss"], metrics
    assert metrics[-1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-6)  # the LM is frozen


def test_sparse_training_moves_every_weight_and_each_loss_only_its_own():
    """Sparse phase: a step changes every weight; the indexer's gradient is its KL's alone
    (the LM loss's through the selection is zero) and the KL reaches no other weight."""
    before, after, metrics = _train_steps("tiny-deepseek-v3.2", "sparse")
    changed = _changed(before, after)  # (the routers' choosing bias moves by its own rule, not a gradient)
    assert all(v for k, v in changed.items() if "b_router_e" not in k), [k for k, v in changed.items() if not v]
    assert metrics[0]["indexer_loss"] > 0
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "tiny-deepseek-v3.2"}, "tiny")["model"])
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 20))
    data = {
        "tokens": tokens,
        "positions": np.arange(20)[None],
        "segment_ids": np.ones((1, 20), np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": np.ones((1, 20), np.float32),
    }
    grads = {}
    for phase in ("none", "sparse"):
        compute = ComputeConfig(indexer_loss=phase)
        loss_fn = lm_loss_fn(graphdef_of(cfg, compute))
        grads[phase] = jax.grad(lambda p, f=loss_fn: f(p, data, 20.0)[0])(before)
    lm_only, both = grads["none"], grads["sparse"]
    indexer_lm = jax.tree.leaves(lm_only["blocks"]["attn"]["indexer"])
    assert all(float(jnp.abs(g).max()) == 0 for g in indexer_lm)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(both["blocks"]["attn"]["indexer"]))
    for key in ("wq_b_qnh", "wkv_b_cny", "wo_nwd"):  # the KL leaves the main attention's gradient as it is
        np.testing.assert_allclose(both["blocks"]["attn"][key], lm_only["blocks"]["attn"][key], rtol=1e-4, atol=1e-7)


def test_the_kv_cache_sampler_selects_as_the_full_forward_does(case):
    """Left-padded prompts of 3 and 9 tokens, 14 decoded (past index_topk at every step): the
    sampler's log-probabilities, from the cache and the indexer's cached keys, are those of
    one teacher-forced forward over each row's real tokens."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, case.cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(prompt)
    mask[0, :6] = 0
    out = Sampler(case.cfg, case.compute)(case.params, prompt, mask, max_new_tokens=14, temperature=0.0)
    graphdef = graphdef_of(case.cfg, case.compute)
    for row in range(2):
        tokens = np.concatenate([prompt[row][mask[row].astype(bool)], out.tokens[row]])[None]
        logits = np.asarray(apply_model(graphdef, case.params, jnp.asarray(tokens)))[0].astype(np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        log_probs -= logits.max(-1, keepdims=True)
        start = int(mask[row].sum())
        expected = log_probs[np.arange(start - 1, tokens.shape[1] - 1), tokens[0, start:]]
        np.testing.assert_allclose(out.logprobs[row], expected, atol=2e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")
def test_a_sparse_training_step_compiles_for_a_tpu_slice():
    """The sparse phase's training step of tiny-deepseek-v3.2 at 256 positions (past
    index_topk), the indexer's heads split over the tensor axis, as XLA's TPU compiler lowers
    it for a v5p-8."""
    cfg = load_config(
        tree={
            "model": "tiny-deepseek-v3.2",
            "compute": {"indexer_loss": "sparse"},
            "mesh": {"data": 1, "fsdp": -1, "tensor": 2},
            "data": {"seq_len": 256, "batch_size": 16},
            "steps": 3,
        },
        schema=TrainConfig,
    )
    plan = plan_step(cfg, get_target("v5p-8"))
    assert plan.how == "compiled" and plan.fits and plan.devices == 4


# --------------------------------------------------------------------------- the sparse path


def _one_layer_dsa() -> ModelConfig:
    """tiny-deepseek-v3.2 cut to its first (dense-MLP) layer: attention and indexer as the preset's."""
    model = resolve_model_preset({"model": "tiny-deepseek-v3.2"}, "tiny")["model"]
    return ModelConfig.model_validate({**model, "num_layers": 1})


def test_the_sparse_path_equals_the_dense_masked_one_in_loss_kl_and_gradients(monkeypatch):
    """Sparse training (indexer_loss sparse), float32, 29 positions (past index_topk 8) in
    chunks of 4 queries (the last one padded), one row of two packed documents, one
    right-padded: the gathered path (dsa.sparse_attention) against the dense-masked reference
    (attention_impl reference): the loss to 1e-6, the indexer KL (~6e-5 here, a difference of
    near-equal distributions) to 1e-7, every gradient to 1e-5 of its largest entry, the
    indexer's (the KL's alone, its target the attention computed in the other form) to 1e-4."""
    monkeypatch.setattr(dsa, "QUERY_CHUNK_BYTES", 2000)
    cfg = _one_layer_dsa()
    t = 29
    assert dsa.query_chunk(t, t, cfg.attention.num_heads, cfg.mla.index_heads, cfg.mla.index_topk) == 4
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, t))
    segments = np.ones((2, t), np.int32)
    segments[0, 13:], segments[1, 20:] = 2, 0
    positions = np.broadcast_to(np.arange(t), (2, t)).copy()
    positions[0, 13:] -= 13
    data = {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": (segments != 0).astype(np.float32),
    }
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, ComputeConfig(), rngs=nnx.Rngs(0)))[1])
    with jax.default_matmul_precision("float32"):
        results = {}
        for impl in ("reference", "auto"):
            loss_fn = lm_loss_fn(graphdef_of(cfg, ComputeConfig(indexer_loss="sparse", attention_impl=impl)))
            grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
            results[impl] = grad_fn(params, data, float(data["loss_mask"].sum()))
    (loss_ref, aux_ref), grads_ref = results["reference"]
    (loss, aux), grads = results["auto"]
    assert float(aux["indexer_loss"]) > 0
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    np.testing.assert_allclose(float(aux["indexer_loss"]), float(aux_ref["indexer_loss"]), rtol=1e-5, atol=1e-7)
    for (path, g_ref), g in zip(jax.tree_util.tree_flatten_with_path(grads_ref)[0], jax.tree.leaves(grads)):
        scale = float(jnp.abs(g_ref).max())
        assert scale > 0, jax.tree_util.keystr(path)
        tolerance = 1e-4 if "'indexer'" in jax.tree_util.keystr(path) else 1e-5
        np.testing.assert_allclose(g, g_ref, atol=tolerance * scale, err_msg=jax.tree_util.keystr(path))


def test_the_kv_cache_sampler_gathers_as_the_dense_masked_one_attends(monkeypatch):
    """Greedy sampling, left-padded prompts of 9 and 4 tokens and 14 decoded (a 23-slot cache
    past index_topk 8, prefill in chunks of 2 queries): the gathered path's tokens and
    log-probabilities are the dense-masked reference's."""
    monkeypatch.setattr(dsa, "QUERY_CHUNK_BYTES", 400)
    cfg = _one_layer_dsa()
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, ComputeConfig(), rngs=nnx.Rngs(1)))[1])
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(prompt)
    mask[1, :5] = 0
    with jax.default_matmul_precision("float32"):
        out = {
            impl: Sampler(cfg, ComputeConfig(attention_impl=impl))(
                params, prompt, mask, max_new_tokens=14, temperature=0.0
            )
            for impl in ("reference", "auto")
        }
    np.testing.assert_array_equal(out["auto"].tokens, out["reference"].tokens)
    np.testing.assert_allclose(out["auto"].logprobs, out["reference"].logprobs, atol=1e-5)


def test_shared_indexer_layers_carry_the_selection_through_scanned_runs_and_units():
    """tiny-glm-5 with 9 layers, 2, 3, 5, 7 and 8 shared: scanned, the layers run as a run of
    two shared ones and a unit of (full, shared) twice (layer_segments), each scan carrying the
    last indexer's queries, weights and keys beside x; the logits are the unscanned list's,
    with the same weights, to 1e-6. The shared stack has no indexer."""
    model = resolve_model_preset({"model": "tiny-glm-5"}, "tiny")["model"]
    cfg = ModelConfig.model_validate({**model, "num_layers": 9, "index_shared_layers": [2, 3, 5, 7, 8]})
    assert [seg.unit is not None for seg in layer_segments(cfg.layer_specs())] == [False, False, False, True, False]
    scanned, unrolled = ComputeConfig(scan_layers=True), ComputeConfig(scan_layers=False)
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, scanned, rngs=nnx.Rngs(0)))[1])
    assert "indexer" in params["blocks"]["attn"] and "indexer" not in params["index_shared_blocks"]["attn"]
    listed = dict(params)
    for name, indices in cfg.layer_stacks():  # the same weights, one entry per layer
        listed[name] = {j: jax.tree.map(lambda a, j=j: a[j], params[name]) for j in range(len(indices))}
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 20)))
    with jax.default_matmul_precision("float32"):
        ours = np.asarray(apply_model(graphdef_of(cfg, scanned), params, tokens))
        ref = np.asarray(apply_model(graphdef_of(cfg, unrolled), listed, tokens))
    np.testing.assert_allclose(ours, ref, atol=1e-6)
