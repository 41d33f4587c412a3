"""Hugging Face parity of the newest architectures of transformers 5.25, group A: MiMo-V2-Flash
(sliding layers with twice the key/value heads and sinks, values narrower than queries and
scaled, partial RoPE with a base per layer type, DeepSeek-V3's router without shared experts).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', config.json as transformers writes it, export -> convert bitwise; and here
logits to 1e-4 with N(0, 0.3^2) weights and a random choosing bias, the export loading
cleanly, and the presets' parameter counts equal to transformers' (meta device).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_fam_moe_2 import IMPLEMENTATIONS, randomise_routing_bias  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

TINY = dict(vocab_size=37, hidden_size=30, intermediate_size=26, max_position_embeddings=64)


def hf_config(name: str):
    t = transformers
    return {
        # a sliding layer (dense MLP), a full one, a sliding one: three stacks; 6 query heads over
        # 1 key/value head on the full layer, 2 on the sliding ones; keys 14 wide (4 rotary),
        # values 9; 6 experts in 2 groups, each token's 2 from its best group, scaled by 1.5
        "mimo_v2_flash": lambda: t.MiMoV2FlashConfig(
            **TINY,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=14,
            v_head_dim=9,
            attention_value_scale=0.8,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.334},
            },
            moe_intermediate_size=13,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            bos_token_id=None,
        ),
        # Gemma 4's dense layers: global heads 12 wide with one KV head whose values are its keys,
        # the last two layers reusing the keys and values of the last earlier layer of their
        # type (KV sharing) with a double-wide MLP; a soft-cap, proportional RoPE on global layers
        "gemma4_unified_text": lambda: t.Gemma4UnifiedTextConfig(
            **TINY,
            num_hidden_layers=5,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            sliding_window=5,
            final_logit_softcapping=8.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 800.0},
            },
            global_head_dim=12,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
        ),
        # a dense layer, then two block-sparse ones: blocks of 3 keys, each KV group's queries
        # seeing the best 2 blocks by its indexer head plus their own; 5 experts (2 per token,
        # scaled by 1.3) and a shared one of its own width; the clamped SwiGLU everywhere, its
        # limit low enough to clamp; half of each head rotary
        "minimax_m3_vl_text": lambda: t.MiniMaxM3VLTextConfig(
            **{**TINY, "intermediate_size": 13},
            dense_intermediate_size=26,
            shared_intermediate_size=11,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            rotary_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            num_local_experts=5,
            num_experts_per_tok=2,
            routed_scaling_factor=1.3,
            swiglu_limit=1.5,
            index_n_heads=2,
            index_head_dim=6,
            index_block_size=3,
            index_topk_blocks=2,
            index_local_blocks=1,
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            bos_token_id=None,
            eos_token_id=None,
        ),
    }[name]()


CASES = ["mimo_v2_flash", "gemma4_unified_text", "minimax_m3_vl_text"]


def random_hf_model(name: str, seed: int = 0):
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    randomise_routing_bias(model, seed)
    with torch.no_grad():  # Gemma 4's layer_scalar, a buffer random_causal_lm leaves at 1
        for key, buffer in model.named_buffers():
            if key.endswith("layer_scalar"):
                buffer.add_(0.3 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(len(key))))
    return model


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits(case):
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    if case.family == "mimo_v2_flash":
        layers = cfg.layer_pattern()
        assert [x.stack for x in layers] == ["dense_blocks", "global_blocks", "blocks"]
        specs = cfg.layer_specs()
        assert [s.mixer.num_kv_heads for s in specs] == [2, 1, 2] and [s.mixer.sinks for s in specs] == [1, 0, 1]
        assert {(s.mixer.value_head_dim, s.mixer.value_scale, s.mixer.rope.rotary_dim) for s in specs} == {(9, 0.8, 4)}
        assert [s.mixer.rope.theta for s in specs] == [50.0, 500.0, 50.0]
        assert case.params["blocks"]["attn"]["wv_dkh"].shape == (1, 30, 2, 9)
    elif case.family == "gemma4_unified_text":
        layers = cfg.layer_pattern()
        assert [x.kv_sharing for x in layers] == [None, "store", "store", "reuse", "reuse"]
        assert (
            cfg.attention.global_head_dim,
            cfg.attention.global_num_kv_heads,
            cfg.attention.global_values_from_keys,
        ) == (12, 1, True)
        assert cfg.mlp.kv_shared_wide and cfg.embedding.per_layer_input_dim is None and not cfg.is_moe
    elif case.family == "minimax_m3_vl_text":
        assert [x.stack for x in cfg.layer_pattern()] == ["dense_blocks", *["block_sparse_blocks"] * 2]
        specs = cfg.layer_specs()
        assert specs[0].mixer.block_indexer is None and specs[1].mixer.block_indexer.topk_blocks == 2
        assert specs[0].ffn.swiglu_limit == specs[1].ffn.swiglu_limit == 1.5 and specs[1].ffn.shared_dim == 11
        assert (cfg.rope.rotary_dim, cfg.mlp.dim, cfg.moe_mlp_dim, cfg.moe.router_scale) == (4, 26, 13, 1.3)
        # the selection matters: attending to every block moves the logits
        tokens, mask = batch()
        indexers = [m for m in case.hf_model.modules() if type(m).__name__ == "MiniMaxM3VLIndexer"]
        sparse = hf_logits(case.hf_model, tokens, mask)
        try:
            for indexer in indexers:
                indexer.topk_blocks = 100
            dense = hf_logits(case.hf_model, tokens, mask)
        finally:
            for indexer in indexers:
                indexer.topk_blocks = 2
        assert len(indexers) == 2 and np.abs(dense - sparse)[mask.astype(bool)].max() > 0.1


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    mimo = {**hf_config("mimo_v2_flash").to_dict(), "architectures": ["MiMoV2FlashForCausalLM"]}
    with pytest.raises(ConfigError, match=r"v_head_dim wider than head_dim \(14\) is not supported"):
        model_config_from_hf({**mimo, "v_head_dim": 16})
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
    with pytest.raises(ConfigError, match=r"rope_parameters.full_attention: only the default RoPE is supported"):
        model_config_from_hf({**mimo, "rope_parameters": {**mimo["rope_parameters"], "full_attention": linear}})
    # the published key: the window past the query
    cfg, _ = model_config_from_hf({**mimo, "sliding_window_size": 8})
    assert cfg.attention.sliding_window == 9


PUBLISHED = {  # preset: the model card's total (billions) and how closely ModelConfig.num_params meets it
    "mimo-v2-flash": (309, 0.01),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (meta device)
    and of the size its model card gives."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)


def test_the_unified_multimodal_checkpoint_converts_to_its_text_decoder(tmp_path):
    """Gemma4UnifiedForConditionalGeneration: conversion reads its text decoder
    (model.language_model.*) and says what it skipped; a text prompt's logits are the
    multimodal model's."""
    config = transformers.Gemma4UnifiedConfig(text_config=hf_config("gemma4_unified_text").to_dict())
    torch.manual_seed(0)
    model = transformers.Gemma4UnifiedForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "hf")
    lines: list[str] = []
    convert_hf(tmp_path / "hf", tmp_path / "converted", log=lines.append)
    assert any("Gemma4UnifiedForConditionalGeneration" in line for line in lines), lines
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    assert cfg.family == "gemma4_unified_text"
    tokens, mask = batch()
    valid = mask.astype(bool)
    ref = hf_logits(model, tokens, mask)
    assert np.abs(engine_logits(cfg, compute, params, tokens, mask) - ref)[valid].max() <= 1e-4
