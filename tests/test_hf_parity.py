"""Hugging Face parity, every family: convert a tiny random transformers model and get its
logits and greedy tokens; export it back and transformers loads it cleanly with the same
logits; export -> convert is bitwise identical.

The tiny models use odd sizes, two KV groups (6 query heads over 2 KV heads), head_dim !=
d_model / heads, a sliding window (5) shorter than the sequences, and random norm weights
so a (1 + w) mix-up shows. Everything about one family is built once (a module fixture).
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.inference.sample import Sampler  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.kv_cache import KVCache  # noqa: E402
from engine.models.params import apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402

VOCAB, WINDOW = 37, 5
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    intermediate_size=26,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
GEMMA2 = dict(sliding_window=WINDOW, query_pre_attn_scalar=12)


def hf_config(family: str):
    t = transformers
    return {
        # Llama 3.1 RoPE scaling, with an original context short enough to matter here.
        "llama": lambda: t.LlamaConfig(
            **COMMON,
            rope_theta=500.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW),
        # Qwen's per-layer window: layer 0 global, the rest local (a non-repeating pattern).
        "qwen2": lambda: t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**COMMON, tie_word_embeddings=True),
        "gemma": lambda: t.GemmaConfig(**COMMON),
        "gemma2": lambda: t.Gemma2Config(**COMMON, **GEMMA2, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
        # Pattern local, local, global over 4 layers; linear RoPE scaling on global layers.
        "gemma3": lambda: t.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            **GEMMA2,
            sliding_window_pattern=3,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    }[family]()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


@dataclass
class Case:
    family: str
    hf_model: object
    hf_dir: Path
    out_dir: Path
    cfg: ModelConfig
    compute: ComputeConfig
    params: dict


def random_causal_lm(config, seed: int = 0, **implementations):
    """A float32 transformers model of `config` with N(0, 0.3^2) matrices and norm weights
    away from their init, so routing, gating and norms matter."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **implementations).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model


def random_hf_model(family: str, seed: int = 0):
    return random_causal_lm(hf_config(family), seed, attn_implementation="eager")


def converted_case(name: str, model, root: Path, stand_in_tokenizer: bool = False) -> Case:
    """The parity case of transformers model `model`: saved under root/hf (with a stand-in
    tokenizer.json, which conversion carries over as a file, where asked), converted to
    root/converted and loaded back."""
    model.save_pretrained(root / "hf")
    if stand_in_tokenizer:
        (root / "hf" / "tokenizer.json").write_text('{"stand-in": true}')
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return Case(name, model, root / "hf", root / "converted", cfg, compute, params)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory) -> Case:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = random_hf_model(family)
    return converted_case(family, model, root, stand_in_tokenizer=True)


def batch(vocab: int = VOCAB):
    """Three rows of 20 tokens (4 windows long): full, right-padded, left-padded."""
    tokens = np.random.default_rng(1).integers(0, vocab, (3, 20))
    mask = np.ones_like(tokens)
    mask[1, 14:] = 0
    mask[2, :6] = 0
    return tokens, mask


def hf_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.float().numpy()


def engine_logits(cfg, compute, params, tokens, mask) -> np.ndarray:
    # Padding is segment 0; positions count rows as transformers does when given no position_ids.
    return np.asarray(apply_model(graphdef_of(cfg, compute), params, jnp.asarray(tokens), None, jnp.asarray(mask)))


def test_converted_model_matches_transformers_logits(case):
    tokens, mask = batch()
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4, f"{case.family}: max |delta logit| {delta}"
    assert np.abs(ref[valid]).max() > 0.5  # the logits are not all ~0 (a test that can fail)
    assert (case.out_dir / "tokenizer" / "tokenizer.json").is_file()


def prefill_then_decode(case, prompt: int = 9, total: int = 15):
    """(last logits, cache) after prefilling `prompt` tokens and decoding the rest one at a time,
    and (logits, cache) of one forward over all `total`: two rows, the second left-padded by 3,
    for the recurrent families' check that decoding carries a full forward's state."""
    module = nnx.merge(graphdef_of(case.cfg, case.compute), case.params)
    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, total)).astype(np.int32)
    segments = np.ones_like(tokens)
    segments[1, :3] = 0
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0).astype(np.int32)

    def run(length):
        cache = KVCache.init(case.cfg, case.compute, 2, total)
        return module(tokens[:, :length], positions[:, :length], segments[:, :length], cache)

    full_logits, full = jax.jit(lambda: run(total))()
    logits, cache = jax.jit(lambda: run(prompt))()
    step = jax.jit(lambda t, p, s, c: module(t, p, s, c))
    for n in range(prompt, total):
        logits, cache = step(tokens[:, n : n + 1], positions[:, n : n + 1], segments[:, n : n + 1], cache)
    return logits, cache, full_logits, full


def test_greedy_generation_of_16_tokens_is_identical(case):
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    case.hf_model.generation_config.eos_token_id = None  # no early stop, no eos suppression
    with torch.no_grad():
        out = case.hf_model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones_like(torch.tensor(prompt)),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == prompt.shape[1] + 16
    ref = out[:, prompt.shape[1] :].numpy()
    # The KV-cache sampler, two completions per prompt from one prefill: the same tokens. (The
    # cache-free forward is test_converted_model_matches_transformers_logits'.)
    sampled = Sampler(case.cfg, case.compute)(
        case.params,
        prompt.astype(np.int32),
        np.ones_like(prompt),
        max_new_tokens=16,
        num_generations=2,
        temperature=0.0,
    )
    np.testing.assert_array_equal(sampled.tokens, np.repeat(ref, 2, axis=0))


def assert_export_reloads_cleanly(case, out, **implementations):
    """transformers loads the export at `out` as the case's class with no missing, unexpected or
    mismatched tensor and no warning about them, and its logits are the reference model's."""
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True, **implementations
        )
    finally:
        hf_logger.removeHandler(handler)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert "were not initialized" not in records.getvalue() and "not used" not in records.getvalue()
    assert type(reloaded) is type(case.hf_model)
    tokens, mask = batch()
    valid = mask.astype(bool)
    np.testing.assert_array_equal(
        hf_logits(reloaded.eval(), tokens, mask)[valid], hf_logits(case.hf_model, tokens, mask)[valid]
    )


def train_batch(vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Two rows of 12 random tokens, one document each, as the training step takes them: each
    token's target the next, the last position's none (22 targets)."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (2, 12))
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(12), (2, 12)),
        "segment_ids": np.ones((2, 12), np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": np.concatenate([np.ones((2, 11)), np.zeros((2, 1))], axis=1).astype(np.float32),
    }


def assert_training_step_matches(case, lr: float, no_gradient: str | None = None):
    """On two rows of 12 random tokens the training loss (its router losses apart) is
    transformers' loss on the same rows; every parameter gets a finite gradient, non-zero but
    where its path names `no_gradient` (zero there), and one SGD step of `lr` lowers the loss."""
    data = train_batch(case.cfg.vocab_size, seed=4)
    tokens = data["tokens"]
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(case.cfg, case.compute)), has_aux=True))
    (loss, aux), grads = step(case.params, data, 22.0)
    with torch.no_grad():
        ref = case.hf_model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss.item()
    assert float(aux["loss"]) == pytest.approx(ref, rel=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        name = jax.tree_util.keystr(path)
        frozen = no_gradient is not None and no_gradient in name
        assert np.isfinite(np.asarray(g)).all() and (np.abs(np.asarray(g)).max() > 0) != frozen, name
    stepped = jax.tree.map(lambda p, g: p - lr * g, case.params, grads)
    (after, _), _ = step(stepped, data, 22.0)
    assert float(after) < float(loss)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    result = export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    out = tmp_path / "export"
    # One shard is named as transformers names it, with no index.
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"] and result["shards"] == 1
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert result["architecture"] == case.hf_model.config.architectures[0]

    assert_export_reloads_cleanly(case, out, attn_implementation="eager")


# Written by transformers but about the file, not the model.
BOOKKEEPING = {"transformers_version"}
# Keys we write beyond transformers 5's, in the meaning transformers 4 (and other readers
# such as vLLM) give them: the RoPE base and scaling before `rope_parameters`, Gemma 3's
# local base and layer period before `layer_types`, Gemma's activation before `hidden_act`.
OLDER_KEYS = {"rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern", "hidden_activation"}
# Keys of the published configs that transformers 5's classes dropped and vLLM 0.32 still reads
# (DeepSeek-V3's router, AFMoE's, GLM-4.7-Flash's and Hy3's dense prefix, Hy3's experts, LFM2's
# widths).
OLDER_KEYS |= {"topk_method", "scoring_func", "score_func", "route_norm", "first_k_dense_replace", "n_group"}
OLDER_KEYS |= {"topk_group", "expert_hidden_dim", "qk_norm", "conv_dim", "block_dim"}
# Read by the model though its config class does not declare it (Qwen2's attention).
UNDECLARED = {"head_dim"}


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    """Every key transformers writes for this model is in our config.json with the same
    value, both for the source (a config transformers made and saved) and for transformers'
    own rewrite of ours; the keys we add are only OLDER_KEYS. Equal values include the ones
    with no effect on this model (Qwen's max_window_layers without a window): a diff of the
    two files shows nothing."""
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    ours = json.loads((tmp_path / "export" / "config.json").read_text())
    source = json.loads((case.hf_dir / "config.json").read_text())
    transformers.AutoConfig.from_pretrained(tmp_path / "export").save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    for name, reference in (("source", source), ("resaved", resaved)):
        for key, value in reference.items():
            if key not in BOOKKEEPING:
                assert ours.get(key, "<missing>") == value, f"{case.family}: {key} ({name}: {value!r})"
    config_class = type(transformers.AutoConfig.for_model(ours["model_type"]))
    known = set(config_class().to_dict())
    assert set(ours) - known <= OLDER_KEYS | UNDECLARED, f"{case.family}: keys {config_class.__name__} does not have"
    if case.family == "gemma":  # what transformers 4's GemmaMLP reads
        assert ours["hidden_activation"] == ours["hidden_act"] == "gelu_pytorch_tanh"


def test_export_then_convert_is_bitwise_identical(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    convert_hf(tmp_path / "export", tmp_path / "again")
    cfg, params, _ = load_params(tmp_path / "again" / "checkpoint")
    assert cfg == case.cfg and stored_configs(tmp_path / "again" / "checkpoint")[1] == case.compute
    flat_a, tree_a = jax.tree.flatten(case.params)
    flat_b, tree_b = jax.tree.flatten(params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unrolled_layers_match_the_scanned_local_global_stack(case):
    """scan_layers: false runs the same per-layer local/global schedule as the scan."""
    if case.family not in ("gemma2", "gemma3", "qwen2"):
        pytest.skip("only the families with a mixed local/global pattern")
    unrolled = case.compute.model_copy(update={"scan_layers": False})
    params = dict(case.params)
    params["blocks"] = {i: jax.tree.map(lambda x: x[i], case.params["blocks"]) for i in range(case.cfg.num_layers)}  # noqa: B023
    tokens, mask = batch()
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        engine_logits(case.cfg, unrolled, params, tokens, mask)[valid],
        engine_logits(case.cfg, case.compute, case.params, tokens, mask)[valid],
        atol=1e-5,
    )
