"""Hugging Face parity of GPT-era families: GPT-2 (Conv1D matrices, one c_attn), GPT-BigCode
(multi-query attention), OPT (learned positions offset by 2, ReLU, post-norm layers) and
OLMo 1 (a LayerNorm with neither scale nor bias, clipped q/k/v).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-4 with N(0, 0.3^2) weights, the export loading cleanly in transformers, and
each published preset of transformers' parameter count (meta device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import (  # noqa: E402
    fuse,
    fused_hf_shape,
    hf_shape,
    model_config_from_hf,
    model_config_to_hf,
    to_engine,
    to_hf,
    unfuse,
)
from engine.models.config import LoraConfig, ModelConfig  # noqa: E402
from engine.models.families import TensorSpec, get_family  # noqa: E402
from engine.models.params import apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    VOCAB,
    Case,
    batch,
    converted_case,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
GPT2 = dict(vocab_size=VOCAB, n_embd=30, n_layer=3, n_head=6, n_inner=26, n_positions=64)
"""Odd sizes: head_dim 5, an MLP of 26 (not 4 x 30), 64 positions."""
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_config(name: str):
    t = transformers
    return {
        "gpt2": lambda: t.GPT2Config(**GPT2, **NO_TOKENS, **NO_DROPOUT),
        # untied LM head; GPT-BigCode's tanh GELU under its own name
        "gpt_bigcode": lambda: t.GPTBigCodeConfig(**GPT2, **NO_TOKENS, **NO_DROPOUT, tie_word_embeddings=False),
        # head_dim 5, an MLP of 26; untied
        "opt": lambda: t.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            num_hidden_layers=3,
            num_attention_heads=6,
            ffn_dim=26,
            max_position_embeddings=64,
            word_embed_proj_dim=30,
            dropout=0.0,
            tie_word_embeddings=False,
            **NO_TOKENS,
        ),
        # 6 heads of 6 over 2 KV heads; q/k/v clipped at 1.0, which N(0, 0.3^2) weights pass often
        "olmo": lambda: t.OlmoConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=500.0,
            clip_qkv=1.0,
            **NO_TOKENS,
        ),
        # 6 heads of 8 over 2 KV heads (head_dim != hidden / heads), relu2 MLP of 26
        "jais2": lambda: t.Jais2Config(**COMMON, **NO_TOKENS, rope_theta=500.0, layer_norm_eps=1e-4),
        # 6 heads of 6 over 2 KV heads, q/k/v clipped at 1.0; 5 experts of 14, top 2 renormalised
        "dbrx": lambda: t.DbrxConfig(
            d_model=36,
            n_heads=6,
            n_layers=3,
            max_seq_len=64,
            vocab_size=VOCAB,
            attn_config={"clip_qkv": 1.0, "kv_n_heads": 2, "rope_theta": 500.0},
            ffn_config={"ffn_hidden_size": 14, "moe_num_experts": 5, "moe_top_k": 2},
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # 6 heads of 6 over 2 KV heads, biases; 5 experts of 14, SparseMixer's eps 0.05 (some
        # second experts' weights then mix several logits); untied with an LM-head bias
        "phimoe": lambda: t.PhimoeConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=14,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_local_experts=5,
            router_jitter_noise=0.05,
            attention_bias=True,
            lm_head_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # ALiBi over 6 heads (not a power of two), head_dim 5, q/k/v clipped at 1.0; tied
        "mpt": lambda: t.MptConfig(
            d_model=30,
            n_heads=6,
            n_layers=3,
            max_seq_len=64,
            vocab_size=VOCAB,
            attn_config={"clip_qkv": 1.0},
            **NO_TOKENS,
        ),
        # ALiBi over 6 heads of 5, q/k/v rows per head; untied
        "bloom": lambda: t.BloomConfig(
            vocab_size=VOCAB, hidden_size=30, n_layer=3, n_head=6, tie_word_embeddings=False, **NO_TOKENS
        ),
    }[name]()


CASES = ["gpt2", "gpt_bigcode", "opt", "olmo", "jais2", "dbrx", "phimoe", "mpt", "bloom"]


def implementations(name: str) -> dict:
    """transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""
    return {"attn_implementation": "eager", **({"experts_implementation": "eager"} if name == "phimoe" else {})}


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, **implementations(name))
    with torch.no_grad():  # routers x3: their logits spread, so no top-k is a near tie
        for param_name, p in model.named_parameters():
            if param_name.endswith(("router.layer.weight", "block_sparse_moe.gate.weight")):
                p.mul_(3.0)
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits(case):
    assert case.cfg.family == case.family
    tokens, mask = batch()
    valid = mask.astype(bool)
    # OPT counts a row's positions from its first real token (the others from its first slot)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) if case.family == "opt" else None
    graphdef = graphdef_of(case.cfg, case.compute)
    ours = np.asarray(apply_model(graphdef, case.params, jnp.asarray(tokens), positions, jnp.asarray(mask)))
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    if case.family == "olmo":  # no norm weights at all
        assert (cfg.norm.kind, cfg.norm.scale, cfg.norm.bias, cfg.attention.qkv_clip) == ("layer", False, False, 1.0)
        assert not any("norm" in name for name, _ in case.hf_model.named_parameters())
        return
    if case.family == "dbrx":
        assert (cfg.norm.kind, cfg.norm.bias, cfg.attention.qkv_clip, cfg.moe.router_renormalize) == (
            "layer",
            False,
            1.0,
            True,
        )
        assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe_mlp_dim, cfg.attention.num_kv_heads) == (
            5,
            2,
            14,
            2,
        )
        assert case.params["blocks"]["mlp"]["w_gate_edf"].shape == (3, 5, 36, 14)
        return
    if case.family == "phimoe":
        assert (cfg.moe.sparsemixer_eps, cfg.head.bias, cfg.attention.qkv_bias, cfg.norm.kind) == (
            0.05,
            True,
            True,
            "layer",
        )
        assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.norm.bias) == (5, 2, True)
        return
    if case.family == "mpt":
        assert (cfg.positions, cfg.norm.kind, cfg.norm.bias, cfg.attention.qkv_clip, cfg.mlp.dim) == (
            "alibi",
            "layer",
            False,
            1.0,
            120,
        )
        assert cfg.layer_specs()[0].attention.alibi and cfg.tie_embeddings and cfg.mlp.activation == "gelu"
        return
    if case.family == "bloom":
        assert (cfg.positions, cfg.embedding.norm, cfg.norm.bias, cfg.attention.qkv_bias, cfg.mlp.dim) == (
            "alibi",
            True,
            True,
            True,
            120,
        )
        assert case.params["embed_norm"]["bias"].shape == (30,) and not cfg.tie_embeddings
        return
    if case.family == "jais2":
        assert (cfg.norm.kind, cfg.norm.bias, cfg.norm.eps, cfg.mlp.activation) == ("layer", True, 1e-4, "relu2")
        assert (cfg.attention.qkv_bias, cfg.attention.out_bias, cfg.mlp.bias, cfg.mlp.gated) == (
            True,
            True,
            True,
            False,
        )
        assert (cfg.attention.num_kv_heads, cfg.attention.head_dim) == (2, 8)
        return
    if case.family == "opt":
        assert (cfg.embedding.position_offset, cfg.mlp.activation, cfg.tie_embeddings) == (2, "relu", False)
        assert case.params["pos_embed_pd"].shape == (64 + 2, 30)
        return
    assert (cfg.norm.kind, cfg.norm.bias, cfg.positions, cfg.mlp.gated) == ("layer", True, "learned", False)
    assert (cfg.attention.head_dim, cfg.mlp.dim, cfg.max_seq_len) == (5, 26, 64)
    assert cfg.attention.num_kv_heads == (1 if case.family == "gpt_bigcode" else 6)
    assert cfg.tie_embeddings == (case.family == "gpt2") and cfg.mlp.activation == "gelu_tanh"


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **implementations(case.family))


def test_sparsemixer_routes_as_transformers_does():
    """engine/models/moe.py's sparsemixer against transformers' (inference): the same experts
    and weights, with logits near ties (within eps) so several gates mix."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    from engine.models.moe import route, sparsemixer

    logits = np.random.default_rng(0).normal(size=(256, 5)).astype(np.float32)
    logits[:64, 1] = logits[:64, 0] * 1.01  # near ties
    ref_weights, ref_experts = hf_sparsemixer(torch.tensor(logits), jitter_eps=0.05, training=False, top_k=2)
    weights, experts = sparsemixer(jnp.asarray(logits), 2, 0.05)
    np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), rtol=1e-6, atol=1e-7)
    softmax_weights, _ = route(jnp.asarray(logits), None, 2, "softmax", True)
    assert np.abs(np.asarray(softmax_weights) - ref_weights.numpy()).max() > 0.1  # not the usual top-k


def test_phimoe_longrope_with_one_mscale_reads_as_its_attention_factor():
    hf = {**hf_config("phimoe").to_dict(), "architectures": ["PhimoeForCausalLM"]}
    pairs = 3  # head_dim 6
    rope = {
        "rope_type": "longrope",
        "rope_theta": 500.0,
        "short_factor": [1.0, 1.5, 2.0][:pairs],
        "long_factor": [2.0, 3.0, 4.0][:pairs],
        "short_mscale": 1.25,
        "long_mscale": 1.25,
        "original_max_position_embeddings": 16,
    }
    cfg, _ = model_config_from_hf({**hf, "rope_parameters": rope})
    assert cfg.rope.scaling.kind == "longrope" and cfg.rope.scaling.attention_factor == 1.25
    assert model_config_to_hf(cfg)["rope_parameters"] == rope
    assert "differ" in refused("phimoe", rope_parameters={**rope, "long_mscale": 1.5})


def refused(name: str, **changes) -> str:
    hf = {**hf_config(name).to_dict(), "architectures": [get_family(name).architecture], **changes}
    with pytest.raises(ConfigError) as error:
        model_config_from_hf(hf)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    assert "scale_attn_by_inverse_layer_idx=true is not supported" in refused(
        "gpt2", scale_attn_by_inverse_layer_idx=True
    )
    assert "add_cross_attention=true is not supported" in refused("gpt2", add_cross_attention=True)
    assert "activation_function 'tanh' is not supported" in refused("gpt2", activation_function="tanh")
    assert "do_layer_norm_before=false" in refused("opt", do_layer_norm_before=False)
    assert "word_embed_proj_dim 16 is not supported" in refused("opt", word_embed_proj_dim=16)
    assert "_remove_final_layer_norm=true is not supported" in refused("opt", _remove_final_layer_norm=True)
    assert "attention_bias=true is not supported" in refused("olmo", attention_bias=True)
    assert "attn_config.alibi_bias_max=16 is not supported" in refused("mpt", attn_config={"alibi_bias_max": 16})
    assert "attn_config.qk_ln=True is not supported" in refused("mpt", attn_config={"qk_ln": True})
    assert "logit_scale=2.0 is not supported" in refused("mpt", logit_scale=2.0)
    post = refused("bloom", apply_residual_connection_post_layernorm=True)
    assert "apply_residual_connection_post_layernorm=true is not supported" in post
    ffn = {"ffn_hidden_size": 14, "moe_num_experts": 5, "moe_top_k": 2}
    normalized = refused("dbrx", ffn_config={**ffn, "moe_normalize_expert_weights": 2.0})
    assert "moe_normalize_expert_weights=2.0 is not supported" in normalized
    assert "ffn_act_fn 'relu' is not supported" in refused("dbrx", ffn_config={**ffn, "ffn_act_fn": {"name": "relu"}})


DBRX_BASE = {  # databricks/dbrx-base's config.json (transformers 4 keys: RoPE base in attn_config)
    "architectures": ["DbrxForCausalLM"],
    "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "model_type": "", "rope_theta": 500000},
    "d_model": 6144,
    "emb_pdrop": 0.0,
    "ffn_config": {
        "ffn_hidden_size": 10752,
        "model_type": "",
        "moe_loss_weight": 0.05,
        "moe_num_experts": 16,
        "moe_top_k": 4,
    },
    "initializer_range": 0.02,
    "max_seq_len": 32768,
    "model_type": "dbrx",
    "n_heads": 48,
    "n_layers": 40,
    "output_router_logits": False,
    "resid_pdrop": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 100352,
}


def test_the_published_dbrx_config_json_reads_as_its_preset():
    tree = dict(resolve_model_preset({"model": "dbrx"}, "dbrx")["model"])
    tree.pop("compute", None)
    cfg, _ = model_config_from_hf(DBRX_BASE)
    assert cfg == ModelConfig.model_validate(tree) and cfg.rope.theta == 500000.0


def test_gpt_bigcode_without_multi_query_reads_its_per_head_rows(tmp_path):
    """multi_query false: c_attn's rows are each head's q, k, v together (fused_groups)."""
    config = transformers.GPTBigCodeConfig(**{**hf_config("gpt_bigcode").to_dict(), "multi_query": False})
    model = random_causal_lm(config, 0, attn_implementation="eager")
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    assert cfg.attention.num_kv_heads == cfg.attention.num_heads == 6
    tokens, mask = batch()
    ours = np.asarray(apply_model(graphdef_of(cfg, compute), params, jnp.asarray(tokens), None, jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(ours - hf_logits(model, tokens, mask))[valid].max() <= 1e-4
    assert model_config_to_hf(cfg)["multi_query"] is False


def test_gpt2_without_scaled_scores_reads_as_a_unit_score_scale():
    cfg, _ = model_config_from_hf({**hf_config("gpt2").to_dict(), "scale_attn_weights": False})
    assert cfg.attention.scale == 1.0
    assert model_config_to_hf(cfg)["scale_attn_weights"] is False


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode", "opt", "bloom", "mpt"])
def test_lora_all_linear_adapts_the_modules_peft_finds(family):
    """Every Linear (GPT-2's Conv1D) but the LM head, by its own name (c_attn, query_key_value,
    Wqkv: a fused q/k/v as one module); Llama's names are refused in one sentence naming them."""
    peft = need("peft")
    cfg, _ = model_config_from_hf({**hf_config(family).to_dict(), "architectures": [get_family(family).architecture]})
    model = random_causal_lm(hf_config(family), 0, **implementations(family))
    expanded = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear")).peft_config["default"]
    ours = LoraConfig(target_modules="all-linear").targets(cfg)
    assert set(ours) == {name.rsplit(".", 1)[-1] for name in expanded.target_modules}
    if family != "opt":  # (OPT's q/k/v are PEFT's Llama names)
        with pytest.raises(
            ValueError, match=f"family '{family}' has no module q_proj to adapt; it can adapt: {ours[0]}"
        ):
            LoraConfig(target_modules=["q_proj", "o_proj"]).targets(cfg)


PUBLISHED = {  # the model cards' totals (billions) and how closely ModelConfig.num_params meets them
    "gpt2": (0.124, 0.01),
    "gpt2-xl": (1.5, 0.05),  # 1.558B counted
    "starcoder": (15.5, 0.01),
    "opt-125m": (0.125, 0.01),
    "opt-6.7b": (6.7, 0.01),
    "olmo-1b": (1.18, 0.01),
    "olmo-1.7-7b": (6.89, 0.01),
    "jais-2-8b": (8.09, 0.01),
    "dbrx": (132, 0.01),
    "phi-3.5-moe": (41.9, 0.01),
    "mpt-7b": (6.65, 0.01),
    "bloom-560m": (0.559, 0.01),
    "bloom-7b1": (7.07, 0.01),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device) and of the size its model card gives."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)


def test_a_conv1d_tensor_is_the_engine_matrix_in_hf_in_out_order():
    """TensorSpec.in_out (GPT-2's Conv1D): HF's (in, out) is the engine's (d, heads, head_dim)
    reshaped, and a fused one's parts follow each other along HF's columns."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(4, 3, 2)), rng.normal(size=(4, 1, 2))  # (d, n, h), (d, kv, h)
    spec = TensorSpec(("attn", "wq_dnh"), "c_attn.weight", 1, fused_with=(("attn", "wk_dkh"),), in_out=True)
    fused = fuse(spec, [to_hf(spec, q), to_hf(spec, k)])
    np.testing.assert_array_equal(fused, np.concatenate([q.reshape(4, 6), k.reshape(4, 2)], axis=1))
    assert fused_hf_shape(spec, [q.shape, k.shape]) == fused.shape == (4, 8)
    back = unfuse(spec, fused, [q.shape, k.shape])
    np.testing.assert_array_equal(to_engine(spec, np.ascontiguousarray(back[0]), q.shape), q)
    np.testing.assert_array_equal(to_engine(spec, np.ascontiguousarray(back[1]), k.shape), k)
    out = TensorSpec(("attn", "wo_nhd"), "c_proj.weight", 2, in_out=True)  # (n, h, d): in (n*h), out d
    o = rng.normal(size=(3, 2, 4))
    assert hf_shape(out, o.shape) == (6, 4)
    np.testing.assert_array_equal(to_hf(out, o), o.reshape(6, 4))


def test_gpt2_and_bloom_read_checkpoints_saved_from_their_base_models(case, tmp_path):
    """openai-community/gpt2's and bigscience/bloom's layout: the base model's names (`h.0.`,
    `wte.`, `word_embeddings.`), no LM head, and GPT-2's old causal-mask buffers (attn.bias,
    attn.masked_bias), which conversion skips."""
    if case.family not in ("gpt2", "bloom"):
        pytest.skip("GPT-2's and BLOOM's published layout")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((case.hf_dir / "config.json").read_text())
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(case.hf_dir / "model.safetensors").items()}
    if case.cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    for i in range(case.cfg.num_layers if case.family == "gpt2" else 0):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg
    for a, b in zip(jax.tree.leaves(case.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
