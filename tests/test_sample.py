"""The KV-cache sampler: cache == recomputation, log-probs == teacher forcing, determinism,
group rollouts == sampling each prompt G times, one compilation per length bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.inference.sample import (
    Sampler,
    filter_logits,
    first_argmax,
    inverse_cdf_draw,
    left_pad,
    length_bucket,
    prompt_positions,
)
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.kv_cache import KVCache
from engine.models.params import apply_model, graphdef_of, param_shardings
from engine.models.transformer import Transformer
from engine.ops import cpu_kernels
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import make_mesh

# Odd sizes so a transposed or mis-broadcast dimension cannot hide; a large init_std makes
# the distributions peaked enough that greedy decoding has no near-ties.
ODD = dict(
    vocab_size=37,
    d_model=22,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=10,
    mlp_dim=26,
    max_seq_len=64,
    init_std=0.4,
)
PROMPTS = [[5, 9, 2, 31, 7], [6, 7], [8, 30, 10], [1]]


SETTINGS = dict(max_new_tokens=10, top_k=12, top_p=0.9)  # one compilation serves every test below


@pytest.fixture(scope="module")
def model():
    """(config, params, sampler): one compiled sampler shared by the tests of this file."""
    cfg = ModelConfig(**ODD)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]))()
    return cfg, params, Sampler(cfg)


def teacher_forced(cfg, params, prompt_tokens, prompt_mask, out, temperature):
    """(log p of the generated tokens, logits) from one full forward pass, no cache."""
    tokens = np.concatenate([prompt_tokens, out.tokens], 1)
    mask = np.concatenate([prompt_mask, out.mask], 1).astype(np.int32)
    graphdef = graphdef_of(cfg, ComputeConfig())
    logits = jax.jit(lambda *args: apply_model(graphdef, *args))(
        params, tokens, prompt_positions(jnp.asarray(mask)), mask
    )
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / (temperature or 1.0), axis=-1)
    p = prompt_tokens.shape[1]
    return np.take_along_axis(np.asarray(logp[:, p - 1 : -1]), out.tokens[..., None], axis=-1)[..., 0], logits


# XLA's lowering and the C++ kernel (engine/ops/cpu_kernels), which needs a C++ compiler.
DECODE_IMPLS = [
    "reference",
    pytest.param(
        "cpu_kernel",
        marks=pytest.mark.skipif(
            cpu_kernels.compiler() is None, reason="no C++ compiler: the engine decodes with XLA's lowering"
        ),
    ),
]


@pytest.mark.parametrize("impl", DECODE_IMPLS)
@pytest.mark.parametrize("variant", ["scanned", "unrolled_sliding_window"])
def test_kv_cache_decoding_equals_full_recomputation(variant, impl):
    extra = dict(attention_pattern=["local", "global"], sliding_window=3) if variant != "scanned" else {}
    cfg = ModelConfig(**ODD, **extra)
    compute = ComputeConfig(scan_layers=variant == "scanned", decode_attention_impl=impl)
    graphdef, params = nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompt_len, steps = 5, 6
    _, mask = left_pad(PROMPTS, length=prompt_len)
    mask = np.concatenate([mask, np.ones((len(PROMPTS), steps), np.int32)], 1)
    tokens = rng.integers(1, 37, mask.shape) * mask
    positions = np.asarray(prompt_positions(jnp.asarray(mask)))
    forward = jax.jit(lambda params, *args, cache=None: nnx.merge(graphdef, params)(*args, cache=cache))
    full = forward(params, tokens, positions, mask)

    cache = KVCache.init(cfg, compute, len(PROMPTS), prompt_len + steps)
    logits, cache = forward(
        params, tokens[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache=cache
    )
    pieces = [logits]
    for i in range(prompt_len, prompt_len + steps):  # one token at a time, as the decode loop does
        logits, cache = forward(params, tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache=cache)
        pieces.append(logits)
    incremental = np.asarray(jnp.concatenate(pieces, axis=1))
    real = mask.astype(bool)
    np.testing.assert_allclose(incremental[real], np.asarray(full)[real], atol=2e-5)
    assert int(cache.end) == prompt_len + steps


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_decoding_over_a_shared_prompt_cache_equals_full_recomputation(impl):
    """G rows per prompt attending to one copy of the prompt's cache (KVCache.share: the
    prefix read once per group, one softmax over prefix and own slots) give the logits of a
    full forward pass over each row's prompt + completion; with a sliding window that
    reaches into the prompt, attention sinks and a logit softcap."""
    extra = dict(attention_pattern=["local", "global"], sliding_window=3, attention_sinks=True, attn_logit_softcap=3.0)
    cfg, compute = ModelConfig(**ODD, **extra), ComputeConfig(scan_layers=False, decode_attention_impl=impl)
    graphdef, params = nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda a: a + 0.5 if a.shape == (ODD["num_heads"],) else a, params)  # sinks that matter
    group, prompt_len, steps = 3, 5, 4
    prompts, prompt_mask = left_pad(PROMPTS, length=prompt_len)
    rng = np.random.default_rng(1)
    completions = rng.integers(1, 37, (len(PROMPTS) * group, steps))  # each row of a group its own tokens
    tokens = np.concatenate([np.repeat(prompts, group, 0), completions], 1)
    mask = np.concatenate([np.repeat(prompt_mask, group, 0), np.ones_like(completions)], 1)
    positions = np.asarray(prompt_positions(jnp.asarray(mask)))
    forward = jax.jit(lambda params, *args, cache=None: nnx.merge(graphdef, params)(*args, cache=cache))
    full = np.asarray(forward(params, tokens, positions, mask))

    cache = KVCache.init(cfg, compute, len(PROMPTS), prompt_len)
    _, cache = forward(params, prompts, positions[::group, :prompt_len], prompt_mask, cache=cache)
    cache = cache.share(group, steps)
    assert cache.k[0].shape[0] == len(PROMPTS) * group and cache.shared_k[0].shape[0] == len(PROMPTS)
    for i in range(prompt_len, prompt_len + steps):
        logits, cache = forward(params, tokens[:, i : i + 1], positions[:, i : i + 1], mask[:, i : i + 1], cache=cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, i], atol=2e-5)


def test_returned_logprobs_equal_teacher_forced_logprobs(model):
    cfg, params, sampler = model
    tokens, mask = left_pad(PROMPTS)  # mixed lengths, left-padded
    out = sampler(params, tokens, mask, seed=3, temperature=0.7, eos_ids=(4,), **SETTINGS)
    forced, _ = teacher_forced(cfg, params, tokens, mask, out, 0.7)
    np.testing.assert_allclose(out.logprobs[out.mask], forced[out.mask], atol=1e-4)
    assert np.all(out.logprobs[out.mask] < 0) and np.all(out.logprobs[~out.mask] == 0)


def test_greedy_is_deterministic_and_each_token_is_the_argmax_of_a_full_forward_pass(model):
    cfg, params, sampler = model
    tokens, mask = left_pad(PROMPTS)
    first = sampler(params, tokens, mask, seed=0, temperature=0.0, **SETTINGS)
    second = sampler(params, tokens, mask, seed=123, temperature=0.0, **SETTINGS)
    np.testing.assert_array_equal(first.tokens, second.tokens)
    assert first.mask.all()
    forced, logits = teacher_forced(cfg, params, tokens, mask, first, 0.0)
    p = tokens.shape[1]
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, p - 1 : -1]), -1), first.tokens)
    np.testing.assert_allclose(first.logprobs, forced, atol=1e-4)


def test_sampling_is_deterministic_for_a_seed_and_the_same_on_an_8_device_mesh(model):
    cfg, params, sampler = model
    mesh = make_mesh(MeshConfig(data=-1))
    _, shardings = param_shardings(cfg, ComputeConfig(), mesh)
    sharded_params = jax.device_put(params, shardings)
    tokens, mask = left_pad(PROMPTS)  # 4 rows on 8 devices: the sampler pads the batch
    sharded = Sampler(cfg, ComputeConfig(), mesh, shardings)(sharded_params, tokens, mask, seed=7, **SETTINGS)
    single = sampler(params, tokens, mask, seed=7, **SETTINGS)
    again = sampler(params, tokens, mask, seed=7, **SETTINGS)
    other_seed = sampler(params, tokens, mask, seed=8, **SETTINGS)
    np.testing.assert_array_equal(single.tokens, again.tokens)
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    np.testing.assert_allclose(sharded.logprobs, single.logprobs, atol=1e-5)
    assert not np.array_equal(single.tokens, other_seed.tokens)


def test_a_row_stops_at_its_first_eos_and_is_padded_after_it(model):
    cfg, params, sampler = model
    tokens, mask = left_pad(PROMPTS)
    free = sampler(params, tokens, mask, seed=5, **SETTINGS)
    eos = int(free.tokens[0, 3])  # a token row 0 certainly generates (at step 3 or earlier)
    out = sampler(params, tokens, mask, seed=5, eos_ids=(eos,), pad_id=36, **SETTINGS)
    n = SETTINGS["max_new_tokens"]
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(free.tokens[row] == eos)
        stop = hits[0] + 1 if hits.size else n
        assert out.lengths[row] == stop
        np.testing.assert_array_equal(out.tokens[row, :stop], free.tokens[row, :stop])  # same draws until then
        assert np.all(out.tokens[row, stop:] == 36) and not out.mask[row, stop:].any()
    assert out.lengths[0] <= 4


def test_top_k_and_top_p_keep_exactly_the_documented_tokens():
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda x: np.flatnonzero(np.isfinite(np.asarray(x[0]))).tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.65)) == [1, 3]  # 0.4 + 0.3 covers 0.65
    assert kept(filter_logits(logits, top_p=0.75)) == [1, 3, 4]
    assert kept(filter_logits(logits, top_k=4, top_p=0.99)) == [1, 2, 3, 4]
    assert kept(filter_logits(logits)) == [0, 1, 2, 3, 4]


def test_group_rollouts_prefill_once_and_equal_sampling_each_prompt_g_times(model):
    """G completions per prompt from one prefill (its cache copied to the group) are the
    completions of the prompt repeated G times: the same draws (row r's key is fold_in(seed, r))
    and, greedy, G copies of the one-row-per-prompt greedy completion."""
    _, params, sampler = model
    tokens, mask = left_pad(PROMPTS)
    G = 3
    grouped = sampler(params, tokens, mask, num_generations=G, seed=11, temperature=0.7, eos_ids=(4,), **SETTINGS)
    repeated = sampler(
        params, np.repeat(tokens, G, 0), np.repeat(mask, G, 0), seed=11, temperature=0.7, eos_ids=(4,), **SETTINGS
    )
    np.testing.assert_array_equal(grouped.tokens, repeated.tokens)
    np.testing.assert_array_equal(grouped.mask, repeated.mask)
    np.testing.assert_allclose(grouped.logprobs, repeated.logprobs, atol=1e-4)  # float32 rounding (prefill batch)
    rows = grouped.tokens.reshape(len(PROMPTS), G, -1)
    assert any(not np.array_equal(group[0], group[g]) for group in rows for g in range(1, G))  # G distinct draws

    greedy_grouped = sampler(params, tokens, mask, num_generations=G, seed=0, temperature=0.0, **SETTINGS)
    greedy = sampler(params, tokens, mask, seed=0, temperature=0.0, **SETTINGS)
    np.testing.assert_array_equal(greedy_grouped.tokens, np.repeat(greedy.tokens, G, 0))
    np.testing.assert_allclose(greedy_grouped.logprobs, np.repeat(greedy.logprobs, G, 0), atol=1e-5)


def test_a_batch_in_the_same_length_buckets_reuses_the_compiled_sampler(model):
    """Prompts of 5 and of 7 tokens (bucket 8), 10 and 12 new tokens (bucket 16): one
    compilation; the token budget is traced, so 10 tokens are the first 10 of 12."""
    _, params, sampler = model
    assert [length_bucket(n) for n in (1, 5, 8, 9, 12)] == [8, 8, 8, 16, 16]
    assert length_bucket(5, (6, 12)) == 6 and length_bucket(13, (6, 12)) == 16
    tokens, mask = left_pad(PROMPTS)
    first = sampler(params, tokens, mask, seed=2, **SETTINGS)  # compiled here or by an earlier test
    compiles = []

    def on_event(event: str, duration: float, **kwargs):
        compiles.extend([event] if event == "/jax/core/compile/backend_compile_duration" else [])

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        longer_prompts = left_pad([[3, 3, 5, 9, 2, 31, 7], *PROMPTS[1:]])
        longer = sampler(params, *longer_prompts, seed=2, **{**SETTINGS, "max_new_tokens": 12})
        wider = sampler(params, tokens, mask, seed=2, **{**SETTINGS, "max_new_tokens": 12})
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == []
    assert longer.tokens.shape == wider.tokens.shape == (len(PROMPTS), 12)
    np.testing.assert_array_equal(wider.tokens[:, :10], first.tokens)
    np.testing.assert_array_equal(longer.tokens[1:, :10], first.tokens[1:])  # rows 1-3: same prompt, same key


@pytest.mark.parametrize("block", [128, 2])  # one block; three, the last padded (the two-level draw)
def test_inverse_cdf_draws_follow_the_distribution_and_never_a_filtered_token(block):
    logits = filter_logits(jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]])), top_k=3)  # keeps 1, 3, 4
    n = 20_000
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0), jnp.arange(n))
    draws = np.asarray(inverse_cdf_draw(keys, jnp.broadcast_to(logits, (n, 5)), block))
    frequencies = np.bincount(draws, minlength=5) / n
    assert frequencies[0] == frequencies[2] == 0
    np.testing.assert_allclose(frequencies, np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85, atol=0.015)  # ~4 sigma
    ties = jnp.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, -1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 4.0, 2.0, 5.0]])
    assert first_argmax(ties, block).tolist() == [1, 0, 4]  # the first of equal maxima, in any block


def test_bfloat16_sampling_agrees_with_float32_within_bf16_rounding(model):
    """Sampler dtype=bfloat16 samples with a bf16 copy of f32 params (products accumulated in
    f32): greedy tokens are f32's, log-probs the f32 model's within bf16 rounding, yet not
    f32's exactly (the products did run in bf16)."""
    cfg, params, sampler = model
    tokens, mask = left_pad(PROMPTS)
    bf16 = Sampler(cfg, dtype="bfloat16")
    greedy = bf16(params, tokens, mask, temperature=0.0, **SETTINGS)
    reference = sampler(params, tokens, mask, temperature=0.0, **SETTINGS)
    assert np.mean(greedy.tokens == reference.tokens) >= 0.9
    assert np.abs(greedy.logprobs - reference.logprobs).max() > 1e-4
    sampled = bf16(params, tokens, mask, seed=3, temperature=0.7, eos_ids=(4,), **SETTINGS)
    forced, _ = teacher_forced(cfg, params, tokens, mask, sampled, 0.7)
    np.testing.assert_allclose(sampled.logprobs[sampled.mask], forced[sampled.mask], atol=0.15)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_a_bfloat16_cache_on_cpu_is_written_in_place(impl):
    """A bf16 KV cache is stored as its bits on CPU, so a decode step writes its slot in place:
    stored as bf16, XLA:CPU converted each layer's whole cache to float32, wrote the slot and
    converted it back, every step (docs/benchmarks.md). The kernel reads no copy of it."""
    cfg = ModelConfig(**ODD)
    compute = ComputeConfig(dtype="bfloat16", param_dtype="bfloat16", scan_layers=False, decode_attention_impl=impl)
    graphdef, params = nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))
    slots, rows = 16, len(PROMPTS)
    cache = KVCache.init(cfg, compute, rows, slots)
    assert cache.k[0].dtype == jnp.uint16 and cache.k[0].shape == (rows, 2, 10, slots)
    step = jax.jit(
        lambda params, cache, token: nnx.merge(graphdef, params)(
            token, jnp.zeros_like(token), jnp.ones_like(token), cache=cache
        )
    )
    hlo = step.lower(params, cache, jnp.ones((rows, 1), jnp.int32)).compile().as_text()
    for shape in (f"{rows},2,10,{slots}", f"{rows},2,{slots},10"):  # keys, values
        assert f"u16[{shape}]" in hlo and f"f32[{shape}]" not in hlo
        # The kernel reads the bits where they lie; XLA's lowering reads a bf16 view of them.
        assert (f"bf16[{shape}]" in hlo) == (impl == "reference")
