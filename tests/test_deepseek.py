"""DeepSeek-V3 (family deepseek_v3): multi-head latent attention (engine/models/mla.py), its
compressed KV cache, dense first layers as a stack of their own, group-limited sigmoid
routing with a choice-only bias, shared experts.

One tiny random transformers DeepseekV3ForCausalLM, converted once for the module: odd
sizes (3 heads of 9 = 5 + 4 rotary, values 5 wide, latent 7, query rank 11), 6 experts in 3
groups with top-2 from 2 groups, the first layer dense, interleaved RoPE with DeepSeek's YaRN
(mscale, mscale_all_dim) over an original context shorter than the rows, weights N(0, 0.3^2)
and a routing bias of the same size so the routing sits near its margins (checked), padding.
Logits to 1e-4 with scan_layers on and off, 16 greedy tokens through the compressed cache,
export -> transformers and back bitwise, and the real-size preset against the published
config.json.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, resolve_model_preset
from engine.inference.sample import Sampler
from engine.interop.hf.convert import convert_hf
from engine.interop.hf.mapping import model_config_from_hf
from engine.models.config import ModelConfig
from engine.models.kv_cache import KVCache
from engine.models.params import apply_model, graphdef_of
from engine.train.checkpoint import load_params, stored_configs
from tests.deps import need
from tests.test_hf_parity import batch, hf_logits
from tests.test_moe import export_loads_cleanly

torch = need("torch")
transformers = need("transformers")

VOCAB = 37
HF_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    intermediate_size=26,
    moe_intermediate_size=10,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_group=3,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=7,
    q_lora_rank=11,
    qk_rope_head_dim=4,
    qk_nope_head_dim=5,
    v_head_dim=5,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_interleave=True,
    num_mtp_layers=0,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16,
    },
)

# deepseek-ai/DeepSeek-V3's config.json (its quantization and remote-code keys left out)
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**HF_TINY), attn_implementation="eager", experts_implementation="eager"
    ).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, not a parameter
                buffer.normal_(0.0, 0.3)
    model.eval().save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return dict(model=model, hf_dir=root / "hf", out=root / "converted", cfg=cfg, compute=compute, params=params)


def padded_batch():
    """Three rows of 20 tokens: full, right-padded, left-padded (test_hf_parity's batch)."""
    return batch(VOCAB)


def unstacked(params: dict) -> dict:
    """The scan_layers=False layout of stacked params: each stack a dict of layers."""
    out = dict(params)
    for stack in ("dense_blocks", "blocks"):
        layers = jax.tree.leaves(params[stack])[0].shape[0]
        out[stack] = {i: jax.tree.map(lambda a, i=i: a[i], params[stack]) for i in range(layers)}
    return out


def routed_experts(model, tokens, mask) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts (sorted), as transformers' router chooses them."""
    chosen = []
    hooks = [
        m.register_forward_hook(lambda _m, _in, out: chosen.append(out[2].sort(-1).values))
        for n, m in model.named_modules()
        if n.endswith("mlp.gate")
    ]
    try:
        hf_logits(model, tokens, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


def test_converted_deepseek_matches_transformers_with_and_without_layer_scan(case):
    cfg = case["cfg"]
    assert (
        cfg.family == "deepseek_v3"
        and cfg.moe.first_dense_layers == 1
        and cfg.layer_stacks() == [("dense_blocks", (0,)), ("blocks", (1, 2))]
    )
    assert (
        cfg.mla.kv_lora_rank,
        cfg.mla.q_lora_rank,
        cfg.attention.head_dim,
        cfg.mla.rope_head_dim,
        cfg.value_head_dim,
    ) == (7, 11, 9, 4, 5)
    assert (
        cfg.moe.router_groups == 3
        and cfg.moe.router_group_top == 2
        and cfg.moe.router_scale == 2.5
        and cfg.rope.interleave
    )
    tokens, mask = padded_batch()
    ref = hf_logits(case["model"], tokens, mask)
    valid = mask.astype(bool)
    for scan in (True, False):
        compute = case["compute"].model_copy(update={"scan_layers": scan})
        params = case["params"] if scan else unstacked(case["params"])
        forward = jax.jit(functools.partial(apply_model, graphdef_of(cfg, compute)))
        ours = np.asarray(forward(params, jnp.asarray(tokens), None, jnp.asarray(mask)))
        delta = float(np.abs(ours - ref)[valid].max())
        print(f"\ndeepseek_v3 scan_layers={scan}: max |delta logit| = {delta:.2e}")
        assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_direct_queries_and_half_split_rope_match_transformers(tmp_path):
    """The other attention variants (q_lora_rank null, as DeepSeek-V2-Lite; rope_interleave
    false) in a model whose layers are all dense (first_k_dense_replace >= layers: no
    experts' stack at all)."""
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(
        **{**HF_TINY, "q_lora_rank": None, "rope_interleave": False, "num_hidden_layers": 2, "first_k_dense_replace": 2}
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
    model.eval().save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg.mla.q_lora_rank is None and not cfg.rope.interleave and cfg.layer_stacks() == [("dense_blocks", (0, 1))]
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    tokens, mask = padded_batch()
    ours = np.asarray(
        jax.jit(functools.partial(apply_model, graphdef_of(cfg, compute)))(
            params, jnp.asarray(tokens), None, jnp.asarray(mask)
        )
    )
    ref = hf_logits(model, tokens, mask)
    valid = mask.astype(bool)
    assert float(np.abs(ours - ref)[valid].max()) <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_routing_is_uneven_group_limited_and_near_its_margins(case):
    """Every expert used, unevenly; the group limit and the bias change choices (so matching
    logits means matching them); a 5% change of the router moves some choices."""
    model = case["model"]
    tokens, mask = padded_batch()
    chosen = routed_experts(model, tokens, mask)
    loads = torch.bincount(torch.cat(chosen).flatten(), minlength=6)
    assert loads.min() > 0 and loads.max() > loads.min()
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        hidden = []  # the router's input, to route it without groups and without the bias
        hooks = [g.register_forward_hook(lambda _m, args, _out: hidden.append(args[0].reshape(-1, 30))) for g in gates]
        hf_logits(model, tokens, mask)
        for hook in hooks:
            hook.remove()
        scores = [torch.sigmoid(h @ g.weight.T) for h, g in zip(hidden, gates)]
        ungrouped = [
            torch.topk(s + g.e_score_correction_bias, 2).indices.sort(-1).values for s, g in zip(scores, gates)
        ]
        unbiased = [torch.topk(s, 2).indices.sort(-1).values for s in scores]
        assert any(bool((u != c).any()) for u, c in zip(ungrouped, chosen))
        assert any(bool((u != c).any()) for u, c in zip(unbiased, chosen))
        saved = [g.weight.clone() for g in gates]
        for g in gates:
            g.weight.mul_(1 + 0.05 * torch.randn_like(g.weight))
        moved = routed_experts(model, tokens, mask)
        for g, w in zip(gates, saved):
            g.weight.copy_(w)
    assert sum(int((m != c).any(-1).sum()) for m, c in zip(moved, chosen)) > 0


def test_greedy_generation_through_the_compressed_cache_is_identical(case):
    """The engine's sampler (prefill and decode steps over the compressed cache, the absorbed
    form) picks transformers' 16 tokens, with the log-probabilities of its logits to 1e-4."""
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    case["model"].generation_config.eos_token_id = None
    with torch.no_grad():
        out = case["model"].generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref = out.sequences[:, prompt.shape[1] :].numpy()
    ref_logprobs = np.take_along_axis(torch.log_softmax(torch.stack(out.logits, 1), -1).numpy(), ref[..., None], -1)
    ours = Sampler(case["cfg"], case["compute"])(
        case["params"], prompt, np.ones_like(prompt), max_new_tokens=16, temperature=0.0
    )
    assert ref.shape == (2, 16)
    np.testing.assert_array_equal(ours.tokens, ref)
    np.testing.assert_allclose(ours.logprobs, ref_logprobs[..., 0], atol=1e-4)


def test_the_cache_holds_the_latent_and_the_rotary_key_not_keys_and_values(case):
    """Per layer and position, kv_lora_rank + rope_head_dim numbers (7 + 4), where full keys
    and values would be heads * (head_dim + v_head_dim) (3 * (9 + 5))."""
    cfg = case["cfg"]
    cache = KVCache.init(cfg, case["compute"], batch=2, max_len=12)
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert cache.k[0].shape == (2, 1, 7, 12) and cache.v[0].shape == (2, 1, 12, 4)  # keys slot-minor
    # the same heads as grouped-query attention (learned positions: its odd head_dim takes no RoPE)
    gqa = cfg.model_copy(update={"kv_lora_rank": None, "q_lora_rank": None, "v_head_dim": None, "positions": "learned"})
    full = KVCache.init(gqa, case["compute"], batch=2, max_len=12)
    assert full.k[0].shape == (2, 3, 9, 12)  # what grouped-query attention of these heads would cache
    assert cache.k[0].size + cache.v[0].size < (full.k[0].size + full.v[0].size) / 3


def test_export_loads_cleanly_in_transformers_and_converts_back_bitwise(case, tmp_path):
    reloaded = export_loads_cleanly(case, tmp_path / "export")
    tokens, mask = padded_batch()
    valid = mask.astype(bool)
    np.testing.assert_array_equal(
        hf_logits(reloaded.eval(), tokens, mask)[valid], hf_logits(case["model"], tokens, mask)[valid]
    )
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


def test_the_preset_is_the_published_model_at_real_size():
    preset = ModelConfig.model_validate(resolve_model_preset({"model": "deepseek-v3"}, "deepseek-v3")["model"])
    published, _ = model_config_from_hf(PUBLISHED)
    assert published.mtp_layers == 1  # its multi-token-prediction layer, which the preset leaves out
    assert preset == published.model_copy(update={"mtp_layers": 0})
    assert round(preset.num_params() / 1e9) == 671  # without the multi-token-prediction layer
    tiny = ModelConfig.model_validate(resolve_model_preset({"model": "tiny-deepseek-v3"}, "tiny")["model"])
    assert tiny.family == "deepseek_v3" and tiny.moe.first_dense_layers == 1 and tiny.is_mla


def test_what_deepseek_does_not_implement_or_allow_is_refused():
    with pytest.raises(ConfigError, match=r"attention_bias=true is not supported"):
        model_config_from_hf({**PUBLISHED, "attention_bias": True})
    with pytest.raises(ConfigError, match=r"num_experts \(256\) must be router_groups \(7\) groups"):
        model_config_from_hf({**PUBLISHED, "n_group": 7})
    with pytest.raises(ValueError, match=r"rope_head_dim \(3\) must be even"):
        ModelConfig(
            family="deepseek_v3",
            vocab_size=17,
            d_model=12,
            num_layers=2,
            num_heads=2,
            num_kv_heads=2,
            head_dim=9,
            mlp_dim=8,
            num_experts=4,
            kv_lora_rank=5,
            rope_head_dim=3,
        )
    # no query compression (DeepSeek-V2-Lite): q_lora_rank null is kept, not defaulted
    assert model_config_from_hf({**PUBLISHED, "q_lora_rank": None})[0].mla.q_lora_rank is None
