"""Hugging Face parity of Cohere 2 MoE (Cohere2MoeForCausalLM): Cohere 2's parallel layer
with a mixture of experts, shared experts averaged or summed with the routed ones, dense
prefix layers that rotate even when global; and JetMoE (JetMoeForCausalLM): a mixture of
attention heads (engine/models/moa.py) and a mixture of experts with output biases.

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4 with N(0, 0.3^2) weights, greedy
tokens and the KV-cache sampler equal transformers' generate, the export loading cleanly in
transformers, config.json as transformers writes it, export -> convert bitwise. Tiny models
with odd widths; the preset's parameter count is transformers' (meta device).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import LoraConfig, ModelConfig  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    converted_case,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
)

VOCAB = 37  # test_hf_parity's batches draw tokens below it
TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(name: str):
    t = transformers
    return {
        # a dense first layer (global, rotated: prefix pattern 1) of 22, then three sliding layers
        # and a global unrotated one, each with 2 of 5 experts of 14 and 2 shared ones averaged in;
        # LayerNorms, softmax router
        "cohere2_moe": lambda: t.Cohere2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=14,
            prefix_dense_intermediate_size=22,
            first_k_dense_replace=1,
            num_hidden_layers=5,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=5,
            logit_scale=0.25,
            num_experts=5,
            num_experts_per_tok=2,
            num_shared_experts=2,
            tie_word_embeddings=False,
            **TOKENS,
        ),
        # RMSNorms, a sigmoid router renormalised, one shared expert summed, every other layer global
        "cohere2_moe_sigmoid": lambda: t.Cohere2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=10,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=10,
            max_position_embeddings=64,
            sliding_window=6,
            sliding_window_pattern=2,
            rms_norm_eps=1e-6,
            num_experts=3,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="sum",
            expert_selection_fn="sigmoid",
            logit_scale=1.0,
            **TOKENS,
        ),
        # 4 attention experts of 3 KV heads of 6, 2 a token (6 query heads), 5 MLP experts of 13,
        # untied head
        "jetmoe": lambda: t.JetMoeConfig(
            vocab_size=VOCAB,
            hidden_size=34,
            num_hidden_layers=3,
            num_key_value_heads=3,
            kv_channels=6,
            intermediate_size=13,
            num_local_experts=5,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            rms_norm_eps=1e-5,  # the final norm's only: the layers' keep 1e-6
            **TOKENS,
        ),
    }[name]()


CASES = ["cohere2_moe", "cohere2_moe_sigmoid", "jetmoe"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, **IMPLEMENTATIONS)
    return converted_case(name, model, root, stand_in_tokenizer=True)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


DECODED_ALIKE = {"cohere2_moe_sigmoid": "cohere2_moe"}  # a second case of a decoding path taken (CI time)


def test_greedy_generation_of_16_tokens_is_identical(case):
    """test_hf_parity's: greedy tokens and the KV-cache sampler's equal transformers' generate."""
    if case.family in DECODED_ALIKE:
        pytest.skip(f"decodes as the {DECODED_ALIKE[case.family]} case does")
    test_hf_parity.test_greedy_generation_of_16_tokens_is_identical(case)


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    if case.family == "cohere2_moe":
        assert cfg.moe.first_dense_layers == 1 and (cfg.mlp.dim, cfg.moe_mlp_dim, cfg.shared_mlp_dim) == (22, 14, 28)
        assert cfg.layer_is_local() == [False, True, True, True, False]
        assert [layer.rope for layer in cfg.layer_pattern()] == [True] * 4 + [False]  # the dense global layer rotates
        assert (cfg.moe.router_scale, cfg.moe.shared_scale, cfg.norm.kind) == (0.5, 0.5, "layer")
        assert case.params["blocks"]["mlp"]["w_gate_edf"].shape == (4, 5, 30, 14)
        assert case.params["dense_blocks"]["mlp"]["w_gate_df"].shape == (1, 30, 22)
    elif case.family == "jetmoe":
        assert (cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim, cfg.attention.experts) == (
            6,
            3,
            6,
            5,
        )
        assert case.params["blocks"]["attn"]["wq_edq"].shape == (3, 5, 34, 18) and cfg.moe.output_bias
        assert (cfg.norm.eps, cfg.head.norm_eps) == (1e-6, 1e-5)
    else:
        assert (cfg.moe.router_score, cfg.moe.router_renormalize, cfg.norm.kind) == ("sigmoid", True, "rms")
        assert (cfg.moe.router_scale, cfg.moe.shared_scale, cfg.moe.first_dense_layers) == (1.0, 1.0, 0)
        assert cfg.attention.pattern == ["local", "global"] and cfg.rope.pattern == [True, False]


def test_what_the_family_does_not_run_is_refused_in_one_sentence():
    def hf(**keys) -> dict:
        return {**hf_config("cohere2_moe").to_dict(), "architectures": ["Cohere2MoeForCausalLM"], **keys}

    for config, message in (
        (hf(mlp_layer_types=["sparse", "dense", "sparse", "sparse", "sparse"]), r"some 'dense' layers, then"),
        (hf(expert_selection_fn="relu"), r"expert_selection_fn must be softmax or sigmoid, got 'relu'"),
        (hf(shared_expert_combination_strategy="max"), r"must be sum or average, got 'max'"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            model_config_from_hf(config)
        assert "\n" not in str(refused.value) and str(refused.value).startswith("config.json (")


PRESETS = ["command-a-plus", "jetmoe-8b"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device), and its config.json reads back as itself."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    again, _ = model_config_from_hf({**hf.to_dict(), "architectures": [hf.architectures[0]]})
    assert again == cfg


def test_unrolled_mixture_of_attention_layers_match_the_scanned_stack(case):
    """scan_layers: false runs JetMoE's mixture-of-attention layers as the scan does."""
    if case.family != "jetmoe":
        pytest.skip("the new mixer kind's check")
    unrolled = case.compute.model_copy(update={"scan_layers": False})
    params = dict(case.params)
    params["blocks"] = {i: jax.tree.map(lambda x: x[i], case.params["blocks"]) for i in range(case.cfg.num_layers)}  # noqa: B023
    tokens, mask = test_hf_parity.batch()
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        test_hf_parity.engine_logits(case.cfg, unrolled, params, tokens, mask)[valid],
        test_hf_parity.engine_logits(case.cfg, case.compute, case.params, tokens, mask)[valid],
        atol=1e-4,  # float32 reassociation (1.1e-5 seen on logits of magnitude ~4)
    )


def test_lora_adapts_jetmoe_kv_proj_and_refuses_its_expert_attention():
    """JetMoE's queries and outputs are expert tensors (input_linear, output_linear), its keys
    and values one kv_proj: LoRA adapts that (one A, a B each for k and v), as PEFT's all-linear."""
    cfg, _ = model_config_from_hf({**hf_config("jetmoe").to_dict(), "architectures": ["JetMoeForCausalLM"]})
    assert LoraConfig(target_modules="all-linear").targets(cfg) == ("kv_proj",)
    assert LoraConfig(target_modules=["kv_proj"]).weights(cfg) == {"wk_dkh": "wk_dkh", "wv_dkh": "wk_dkh"}
    with pytest.raises(ValueError, match=r"family 'jetmoe' has no module q_proj to adapt; it can adapt: kv_proj$"):
        LoraConfig(target_modules=["q_proj", "o_proj"]).targets(cfg)
