"""Hugging Face parity of the convolution, recurrent and lightning hybrids of issue 62: LFM2
(Lfm2ForCausalLM: gated short convolutions beside QK-norm attention, engine/models/short_conv.py),
LFM2-MoE (its sigmoid-routed experts), LFM3 (sliding and global attention, per-head gates,
sandwich norms), RecurrentGemma (Griffin's RG-LRU blocks beside local MQA, engine/models/rglru.py)
and MiniMax-Text-01 (lightning attention beside softmax attention, alpha/beta residuals,
engine/models/lightning.py).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4 with N(0, 0.3^2) weights (a row
right-padded, one left-padded), greedy tokens and the recurrent/KV-cache sampler equal to
transformers' generate, export loading cleanly with the same logits, config.json as
transformers writes it, export -> convert bitwise; and here each mixer's decoded state against
one forward, each new block against transformers' module and its training form against its
recurrence, the published config.json keys, and each preset's parameter count against
transformers' model of it on the meta device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.common import Build  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.kv_cache import KVCache  # noqa: E402
from engine.models.lightning import LightningAttention, lightning_chunked, lightning_scan  # noqa: E402
from engine.models.lightning import decay_rates as lightning_decay_rates  # noqa: E402
from engine.models.rglru import RecurrentBlock  # noqa: E402
from engine.models.rglru import initial_state as rglru_initial_state  # noqa: E402
from engine.models.short_conv import ShortConv, initial_state  # noqa: E402
from engine.models.specs import LightningSpec, RGLRUSpec, ShortConvSpec  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    assert_export_reloads_cleanly,
    batch,
    engine_logits,
    hf_logits,
    prefill_then_decode,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

# Odd sizes: 6 query heads over 2 KV heads of 8 (not hidden / heads), an MLP of 26, 4 taps.
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
# LFM2: conv, attention, conv, conv (a period of 4), the MLP's width as given, untied.
LFM2 = dict(
    **SMALL,
    num_hidden_layers=4,
    intermediate_size=26,
    block_auto_adjust_ff_dim=False,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=4,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)

# LFM2-MoE: LFM2's layers, the first dense (an MLP of 26), then 5 experts of 14, top 2 by
# sigmoid score + expert bias (drawn, not zero), renormalised and scaled by 1.7; tied.
LFM2_MOE = dict(
    {k: v for k, v in LFM2.items() if k not in ("block_auto_adjust_ff_dim", "tie_word_embeddings")},
    num_dense_layers=1,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=14,
    routed_scaling_factor=1.7,
)

# LFM3: conv, sliding (window 5), global, conv, sliding; plain RoPE of base 500 on the sliding
# layers, proportional RoPE (half the head's frequencies rotating) of base 2000 on the global
# one; gates per head, sandwich norms, 3 taps; tied.
LFM3 = dict(
    **SMALL,
    num_hidden_layers=5,
    intermediate_size=26,
    layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
    sliding_window=5,
    conv_L_cache=3,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 2000.0, "partial_rotary_factor": 0.5},
    },
)

# RecurrentGemma: recurrent, recurrent, attention, recurrent; 5 heads of 8 (one KV head), RoPE on
# half of each, window 5; the recurrence 30 wide (not hidden_size) in 5 blocks of 6, 3 taps; an
# MLP of 13 (intermediate_size / 2); logits soft-capped at 4.
RECURRENT_GEMMA = dict(
    **{k: v for k, v in SMALL.items() if k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")},
    hidden_size=40,
    num_attention_heads=5,
    num_key_value_heads=1,
    num_hidden_layers=4,
    intermediate_size=26,
    lru_width=30,
    conv1d_width=3,
    attention_window_size=5,
    logits_soft_cap=4.0,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
)

# MiniMax-Text-01: attention, lightning, lightning, attention (layer_types), 6 heads of 8 over 2
# KV heads, lightning chunks of 4 (the 20-token rows are 5 of them, a prompt of 7 a ragged one);
# 5 experts of 14, top 2; the residual factors of neither 1 (alpha 1.5 on the lightning layers).
MINIMAX = dict(
    **SMALL,
    num_hidden_layers=4,
    intermediate_size=14,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    block_size=4,
    num_local_experts=5,
    num_experts_per_tok=2,
    full_attn_alpha_factor=1.3,
    full_attn_beta_factor=0.8,
    linear_attn_alpha_factor=1.5,
    linear_attn_beta_factor=0.9,
    mlp_alpha_factor=1.2,
    mlp_beta_factor=0.7,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)


def hf_config(name: str):
    t = transformers
    return {
        "lfm2": lambda: t.Lfm2Config(**LFM2),
        "lfm2_moe": lambda: t.Lfm2MoeConfig(**LFM2_MOE),
        "lfm3": lambda: t.Lfm3Config(**LFM3),
        "recurrent_gemma": lambda: t.RecurrentGemmaConfig(**RECURRENT_GEMMA),
        "minimax": lambda: t.MiniMaxConfig(**MINIMAX),
    }[name]()


CASES = ["lfm2", "lfm2_moe", "lfm3", "recurrent_gemma", "minimax"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""
PRESETS = {
    "lfm2-1.2b": 1.17,
    "lfm2-8b-a1b": 8.34,
    "lfm3-1.7b": 1.73,
    "recurrentgemma-2b": 2.68,
    "minimax-text-01": 456.09,
}
"""Each preset of a published size and its parameter count in billions (transformers' count of it)."""


def converted(model, root) -> tuple:
    model.save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_text('{"stand-in": true}')  # carried over as a file
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return cfg, compute, params


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, **IMPLEMENTATIONS)
    with torch.no_grad():  # the routers' choosing biases (buffers, zero at initialisation)
        for key, buffer in model.named_buffers():
            if key.endswith("expert_bias"):
                buffer.normal_(0.0, 0.3)
    cfg, compute, params = converted(model, root)
    return Case(name, model, root / "hf", root / "converted", cfg, compute, params)


def test_converted_model_matches_transformers_logits(case):
    """test_hf_parity's check (a full, a right-padded and a left-padded row); RecurrentGemma's
    transformers runs its recurrence over padding (no mask reaches it), so there each row is
    transformers' on its own tokens alone, which the engine's left-padded row must equal."""
    if case.family != "recurrent_gemma":
        return test_hf_parity.test_converted_model_matches_transformers_logits(case)
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = np.zeros(ours.shape, np.float32)
    with torch.no_grad():
        for row, keep in enumerate(valid):
            ref[row, keep] = case.hf_model(torch.tensor(tokens[row, keep][None])).logits[0].numpy()
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    if case.family != "minimax":
        return assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)
    # MiniMax's decay tables are buffers in the checkpoint, which export computes as transformers
    # does but not to its last bit (its float32 pow and exp): no tensor is missing, logits to 1e-4.
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", output_loading_info=True, **IMPLEMENTATIONS
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens, mask = batch()
    valid = mask.astype(bool)
    theirs, ours = hf_logits(case.hf_model, tokens, mask)[valid], hf_logits(reloaded.eval(), tokens, mask)[valid]
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    source = dict(case.hf_model.named_buffers())
    for name, buffer in reloaded.named_buffers():
        if name.endswith("decay") or name.endswith("slope_rate"):
            np.testing.assert_allclose(buffer.numpy(), source[name].numpy(), rtol=1e-6)


def test_the_layers_are_what_the_config_says(case):
    cfg, layers = case.cfg, case.cfg.layer_pattern()
    kinds = {
        "lfm3": [("short_conv", False), ("attention", True), ("attention", False), ("short_conv", False)],
        "recurrent_gemma": [("rglru", False), ("rglru", False), ("attention", True), ("rglru", False)],
        "minimax": [("attention", False), ("lightning", False), ("lightning", False), ("attention", False)],
    }.get(case.family, [("short_conv", False), ("attention", False), ("short_conv", False), ("short_conv", False)])
    assert [(layer.mixer, layer.local) for layer in layers][:4] == kinds
    assert cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())
    if case.family == "minimax":
        slopes = [spec.mixer.slope_factor for spec in cfg.layer_specs() if spec.mixer.kind == "lightning"]
        assert slopes == pytest.approx([1 - 1 / 3, 1 - 2 / 3], abs=1e-4) and cfg.normed_residual.lightning_alpha == 1.5
        return
    if case.family == "recurrent_gemma":
        assert cfg.rglru.width == 30 and cfg.rope.rotary_dim == 4 and cfg.embedding.multiplier == 6.3125  # sqrt(40)
        assert case.params["rglru_blocks"]["attn"]["w_input_gate_nkk"].shape == (3, 5, 6, 6)
        return
    if case.family == "lfm3":
        assert cfg.block.post_norms and cfg.attention.head_gate and cfg.rope.local_theta == 500.0
    if case.family == "lfm2_moe":
        assert [layer.ffn for layer in layers] == ["mlp", "moe", "moe", "moe"] and cfg.moe.router_scale == 1.7
        assert np.abs(np.asarray(case.params["blocks"]["mlp"]["b_router_e"])).max() > 0.1
    conv = case.params["short_conv_blocks"]["attn"]  # (LFM2-MoE: the first, dense, is short_conv_dense_blocks')
    taps = case.hf_model.config.conv_L_cache
    assert conv["conv_c1k"].shape[1:] == (30, 1, taps) and conv["w_in_d3c"].shape[1:] == (30, 3, 30)


def test_the_state_after_a_prompt_and_decoded_tokens_is_a_full_forwards(case):
    """Prefill 9 tokens (one row left-padded by 3), decode 6 one at a time: every stateful
    layer's state equals that of one forward over all 15, and so do the last logits."""
    logits, cache, full_logits, full = prefill_then_decode(case)
    stateful = [i for i, state in enumerate(cache.states) if state is not None]
    assert stateful
    for i in stateful:
        for a, b in zip(jax.tree.leaves(cache.states[i]), jax.tree.leaves(full.states[i]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # (states of order 1)
            assert np.abs(np.asarray(a)).max() > 0.1
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(full_logits[:, -1]), atol=1e-4)


# --------------------------------------------------------------------------- blocks


def test_the_short_convolution_with_biases_is_transformers_and_decodes_as_it_trains():
    """Lfm2ShortConv with conv_bias (biases on in_proj, the convolution and out_proj; no
    published model has them) against the engine's block on the same weights, and the block's
    whole-sequence form against its one-token-at-a-time decoding from the window state."""
    config = transformers.Lfm2Config(**{**LFM2, "conv_bias": True, "conv_L_cache": 5})
    torch.manual_seed(1)
    ref = transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    spec = ShortConvSpec(width=30, conv_kernel=5, bias=True)
    block = ShortConv(spec, Build(30, ComputeConfig(dtype="float32")), rngs=nnx.Rngs(0))
    w = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    block.w_in_d3c[...] = jnp.asarray(w["in_proj.weight"].T.reshape(30, 3, 30))
    block.b_in_3c[...] = jnp.asarray(w["in_proj.bias"].reshape(3, 30))
    block.conv_c1k[...] = jnp.asarray(w["conv.weight"])
    block.conv_bias_c[...] = jnp.asarray(w["conv.bias"])
    block.w_out_cd[...] = jnp.asarray(w["out_proj.weight"].T)
    block.b_out_d[...] = jnp.asarray(w["out_proj.bias"])
    x = np.random.default_rng(2).normal(size=(2, 11, 30)).astype(np.float32)
    with torch.no_grad():
        theirs = ref(torch.tensor(x)).numpy()
    ours = np.asarray(block(jnp.asarray(x), None, None, spec))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert np.abs(theirs).max() > 0.5
    cache = KVCache(
        (), (), jnp.zeros((2, 0), bool), jnp.zeros((), jnp.int32), states=(initial_state(spec, ComputeConfig(), 2),)
    )
    out, cache = block(jnp.asarray(x[:, :4]), None, None, spec, cache)
    steps = [out]
    for n in range(4, 11):
        out, cache = block(jnp.asarray(x[:, n : n + 1]), None, None, spec, cache)
        steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), ours, atol=1e-5)


def test_the_recurrent_block_is_transformers_and_its_scan_decodes_as_it_trains():
    """RecurrentGemmaRecurrentBlock against the engine's block on the same weights (two rows,
    the second restarting at position 0 mid-row, as a packed document), and the block's
    associative scan against one token at a time from its carried state."""
    config = transformers.RecurrentGemmaConfig(**RECURRENT_GEMMA)
    torch.manual_seed(2)
    ref = transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock(config, 0)
    with torch.no_grad():
        for key, p in ref.named_parameters():
            p.normal_(0.0, 0.3) if key != "rg_lru.recurrent_param" else p.uniform_(-1.0, 3.0)
    ref = ref.float().eval()
    spec = RGLRUSpec(width=30, num_heads=5, conv_kernel=3)
    block = RecurrentBlock(spec, Build(40, ComputeConfig(dtype="float32")), rngs=nnx.Rngs(0))
    w = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    for ours, theirs in (("w_y_dw", "linear_y"), ("w_x_dw", "linear_x"), ("w_out_wd", "linear_out")):
        getattr(block, ours)[...] = jnp.asarray(w[theirs + ".weight"].T)
    for ours, theirs in (
        ("b_y_w", "linear_y.bias"),
        ("b_x_w", "linear_x.bias"),
        ("b_out_d", "linear_out.bias"),
        ("conv_w1k", "conv_1d.weight"),
        ("conv_bias_w", "conv_1d.bias"),
        ("recurrent_param_w", "rg_lru.recurrent_param"),
        ("w_input_gate_nkk", "rg_lru.input_gate_weight"),
        ("b_input_gate_nk", "rg_lru.input_gate_bias"),
        ("w_recurrent_gate_nkk", "rg_lru.recurrent_gate_weight"),
        ("b_recurrent_gate_nk", "rg_lru.recurrent_gate_bias"),
    ):
        getattr(block, ours)[...] = jnp.asarray(w[theirs])
    x = np.random.default_rng(3).normal(size=(2, 13, 40)).astype(np.float32)
    positions = np.stack([np.arange(13), np.concatenate([np.arange(6), np.arange(7)])])
    with torch.no_grad():  # the first row whole; the second's two documents apart (its convolution does not restart)
        theirs = ref(torch.tensor(x[:1]), torch.tensor(positions[:1]), None, use_cache=False)[0].numpy()
        first = ref(torch.tensor(x[1:, :6]), torch.arange(6)[None], None, use_cache=False)[0].numpy()
        second = ref(torch.tensor(x[1:, 6:]), torch.arange(7)[None], None, use_cache=False)[0].numpy()
    segments = np.stack([np.ones(13), np.concatenate([np.ones(6), 2 * np.ones(7)])]).astype(np.int32)
    ours = np.asarray(block(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segments), spec))
    np.testing.assert_allclose(ours[:1], theirs, atol=2e-5)
    np.testing.assert_allclose(ours[1:], np.concatenate([first, second], axis=1), atol=2e-5)
    assert np.abs(theirs).max() > 0.5
    state = rglru_initial_state(spec, ComputeConfig(), 1)
    cache = KVCache((), (), jnp.zeros((1, 0), bool), jnp.zeros((), jnp.int32), states=(state,))
    out, cache = block(jnp.asarray(x[:1, :5]), jnp.asarray(positions[:1, :5]), None, spec, cache)
    steps = [out]
    for n in range(5, 13):
        out, cache = block(jnp.asarray(x[:1, n : n + 1]), jnp.asarray(positions[:1, n : n + 1]), None, spec, cache)
        steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), ours[:1], atol=2e-5)


def test_lightning_attention_is_transformers_and_its_chunks_are_its_recurrence():
    """MiniMaxLightningAttention (layer 1 of 3, blocks of 4 positions, 11 tokens: a ragged
    block) against the engine's block on the same weights; then the chunked form against the
    per-token recurrence from a carried state, and a packed row's documents against each alone."""
    config = transformers.MiniMaxConfig(
        hidden_size=30,
        num_attention_heads=3,
        head_dim=7,
        num_hidden_layers=3,
        block_size=4,
        vocab_size=VOCAB,
        # (the softmax layers' RoPE must rotate an even width of the 7: 6; unused here)
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 6 / 7},
    )
    torch.manual_seed(4)
    module = transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention(config, layer_idx=1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(0.3 * torch.randn_like(p))
    module = module.float().eval()
    spec = LightningSpec(num_heads=3, head_dim=7, chunk_size=4, slope_factor=1 - 1 / (2 + 1e-5) + 1e-5)
    block = LightningAttention(spec, Build(30, ComputeConfig(dtype="float32")), rngs=nnx.Rngs(0))
    w = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    block.w_qkv_dnx[...] = jnp.asarray(w["qkv_proj.weight"].T.reshape(30, 3, 21))
    block.w_gate_dnh[...] = jnp.asarray(w["output_gate.weight"].T.reshape(30, 3, 7))
    block.norm_f[...] = jnp.asarray(w["norm.weight"])
    block.w_out_nhd[...] = jnp.asarray(w["out_proj.weight"].T.reshape(3, 7, 30))
    x = np.random.default_rng(5).normal(size=(2, 11, 30)).astype(np.float32)
    with torch.no_grad():
        theirs = module(torch.tensor(x), None, None)[0].numpy()
    ours = np.asarray(block(jnp.asarray(x), None, None, spec))
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    assert np.abs(theirs).max() > 0.5
    q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(2, 13, 3, 5)), jnp.float32) for i in (6, 7, 8))
    rates = lightning_decay_rates(spec)
    state = jnp.asarray(np.random.default_rng(9).normal(size=(2, 3, 5, 5)), jnp.float32)
    chunked, chunked_state = lightning_chunked(q, k, v, rates, chunk_size=4, state_bnhh=state)
    scanned, scanned_state = lightning_scan(q, k, v, rates, state)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(scanned), atol=1e-4)
    np.testing.assert_allclose(np.asarray(chunked_state), np.asarray(scanned_state), atol=1e-4)
    segments = jnp.asarray(np.repeat([[1] * 6 + [2] * 7], 2, axis=0))
    packed, _ = lightning_chunked(q, k, v, rates, chunk_size=4, segment_ids_bt=segments)
    first, _ = lightning_scan(q[:, :6], k[:, :6], v[:, :6], rates)
    second, _ = lightning_scan(q[:, 6:], k[:, 6:], v[:, 6:], rates)
    np.testing.assert_allclose(np.asarray(packed), np.concatenate([first, second], axis=1), atol=1e-4)


# --------------------------------------------------------------------------- configs and presets


def test_the_published_config_keys_are_read_as_transformers_reads_them():
    """LFM2-1.2B's config.json keys: block_ff_dim 12288 auto-adjusted to an MLP of 8192,
    full_attn_idxs for the attention layers, tie_embedding; what the engine lacks is refused."""
    published = {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": 65536,
        "hidden_size": 2048,
        "block_ff_dim": 12288,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
        "conv_L_cache": 3,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_embedding": True,
    }
    cfg, _ = model_config_from_hf(published)
    preset = ModelConfig.model_validate(resolve_model_preset({"model": "lfm2-1.2b"}, "lfm2-1.2b")["model"])
    assert cfg.model_copy(update={"init_std": preset.init_std}) == preset
    hf = transformers.Lfm2Config(**{k: v for k, v in published.items() if k != "architectures"})
    with torch.device("meta"):
        mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(hf)
    assert mlp.w1.out_features == cfg.mlp.dim == 8192
    # LFM2-8B-A1B's: its dense MLP's width is intermediate_size as it stands
    types = ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]
    moe = {**published, "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "num_hidden_layers": 24}
    moe.update(layer_types=types, intermediate_size=7168, num_experts=32, moe_intermediate_size=1792)
    cfg, _ = model_config_from_hf({k: v for k, v in moe.items() if not k.startswith("block_")})
    preset = ModelConfig.model_validate(resolve_model_preset({"model": "lfm2-8b-a1b"}, "lfm2-8b-a1b")["model"])
    assert cfg.model_copy(update={"init_std": preset.init_std}) == preset
    # LFM3-1.7B's: transformers' defaults
    lfm3 = {**transformers.Lfm3Config().to_dict(), "architectures": ["Lfm3ForCausalLM"]}
    preset = ModelConfig.model_validate(resolve_model_preset({"model": "lfm3-1.7b"}, "lfm3-1.7b")["model"])
    assert model_config_from_hf(lfm3)[0] == preset
    # recurrentgemma-2b's (its older _block_types, partial_rotary_factor and rope_theta keys)
    griffin = {
        "architectures": ["RecurrentGemmaForCausalLM"],
        "model_type": "recurrent_gemma",
        "_block_types": ["recurrent", "recurrent", "attention"],
        "attention_window_size": 2048,
        "conv1d_width": 4,
        "hidden_size": 2560,
        "intermediate_size": 15360,
        "logits_soft_cap": 30.0,
        "lru_width": 2560,
        "num_attention_heads": 10,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "vocab_size": 256000,
    }
    preset = ModelConfig.model_validate(resolve_model_preset({"model": "recurrentgemma-2b"}, "x")["model"])
    assert model_config_from_hf(griffin)[0] == preset
    with pytest.raises(ConfigError, match=r"layer_types must name 4 layers of conv, full_attention"):
        model_config_from_hf(
            {
                **LFM2,
                "architectures": ["Lfm2ForCausalLM"],
                "model_type": "lfm2",
                "layer_types": ["conv", "sliding_attention", "conv", "conv"],
            }
        )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_preset_is_transformers_model_of_its_published_size(name):
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": name}, name)["model"])
    hf_config = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == cfg.num_params()
    assert round(cfg.num_params() / 1e9, 2) == PRESETS[name]
