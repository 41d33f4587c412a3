"""Hugging Face parity of the newest architectures of transformers 5.25 (group B): CWM (Llama
with sliding windows on three layers of four), Youtu-LLM (DeepSeek-V3's latent attention over a
dense MLP), Hy3 (QK-norm attention over DeepSeek-V3's sigmoid router, under its own tensor
names), MiniCPM 5 MoE (a sigmoid output gate from the query projection, DeepSeek-V3's router),
Sarvam MLA / Sarvam MoE / Param-2 MoE (DeepSeek-V3 and GLM-4.5 under their published keys and
names) and Apertus 1.5 (Apertus whose LM head predicts only the first output_vocab_size tokens).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers', export -> convert bitwise; and here logits to 1e-4 with N(0, 0.3^2) weights
(and a random choosing bias where the router has one), the export loading cleanly in
transformers, config.json as transformers writes it, and each published preset's parameter
count equal to transformers' (meta device).
"""

from __future__ import annotations

import jax
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
from tests.test_hf_fam_moe_2 import (  # noqa: E402
    assert_routing_is_near_its_margins,
    randomise_routing_bias,
)
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    WINDOW,
    Case,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""The classes' default token ids lie past the tiny vocabulary."""


def llama3_rope(theta: float = 500.0) -> dict:
    """Llama 3 scaling with an original context short enough to matter here (a new dict each
    time: transformers adds keys to the one it is given)."""
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }


def hf_config(name: str):
    t = transformers
    return {
        # 5 layers: full, sliding x3, full (CwmConfig's default pattern), Llama 3 scaling
        "cwm": lambda: t.CwmConfig(
            **{**COMMON, "num_hidden_layers": 5},
            sliding_window=WINDOW,
            rope_parameters=llama3_rope(),
            eos_token_id=None,
            bos_token_id=1,
        ),
        # latent attention (compressed queries, odd widths), YaRN with DeepSeek's softmax mscale
        "youtu": lambda: t.YoutuConfig(
            # latent attention: as many key-value heads as heads; head_dim is the rotary width
            **{**COMMON, "num_key_value_heads": 6, "head_dim": 4},
            kv_lora_rank=10,
            q_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=6,
            v_head_dim=7,
            rope_parameters=yarn_rope(),
            tie_word_embeddings=False,
            **NO_TOKENS,
        ),
        # a dense first layer, then 5 experts (2 per token, scaled by 1.7) and 2 shared; QK norm
        "hy_v3": lambda: t.HYV3Config(
            **COMMON,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=13,
            num_shared_experts=2,
            router_scaling_factor=1.7,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        # the output-gated attention; dense, sparse, dense (not a prefix: ffn_pattern), 6 experts in 2
        # groups, each token's 2 from its best group, 2 shared, scaled by 1.3
        "minicpm5_moe": lambda: t.MiniCPM5MoeConfig(
            **COMMON,
            n_routed_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=13,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.3,
            mlp_layer_types=["dense", "sparse", "dense"],
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # latent attention with uncompressed queries (DeepSeek-V3's class), YaRN in the published
        # legacy form; a dense first layer, 6 experts, 3 per token, 2 shared
        "sarvam_mla": lambda: t.SarvamMLAConfig(
            **{**COMMON, "num_key_value_heads": 6, "head_dim": 4},
            kv_lora_rank=10,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=6,
            v_head_dim=7,
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=13,
            n_shared_experts=2,
            rope_scaling={**yarn_rope(), "type": "deepseek_yarn"},
            **NO_TOKENS,
        ),
        # GLM-4.5's layers under Ling's names (fused query_key_value), QK norm, 6 experts in 3
        # groups, each token's 2 from its 2 best
        "sarvam_moe": lambda: t.SarvamMoEConfig(
            **COMMON,
            n_routed_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=13,
            n_shared_experts=2,
            n_group=3,
            topk_group=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # the same with q/k/v biases (in the fused tensor) and tied embeddings (its default)
        "param2moe": lambda: t.Param2MoeConfig(
            **COMMON,
            n_routed_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=13,
            n_shared_experts=1,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **NO_TOKENS,
        ),
        # Apertus with the head pruned to the first 29 of the 37 tokens, Llama 3 scaling
        "apertus1p5_text": lambda: t.Apertus1p5TextConfig(
            **COMMON, output_vocab_size=29, rope_parameters=llama3_rope(), **NO_TOKENS
        ),
    }[name]()


def yarn_rope() -> dict:
    """YaRN x4 over an original context of 16 with DeepSeek's mscale on the softmax scale."""
    return {
        "rope_type": "yarn",
        "rope_theta": 500.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


CASES = ["cwm", "youtu", "hy_v3", "minicpm5_moe", "sarvam_mla", "sarvam_moe", "param2moe", "apertus1p5_text"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""


def random_hf_model(name: str, seed: int = 0):
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    randomise_routing_bias(model, seed)
    return model


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    return converted_case(name, model, root)


def test_converted_model_matches_transformers_logits(case):
    """Logits to 1e-4; in a mixture of experts with weights large enough that routing matters:
    every expert is used, unevenly, and a 5% change of the routers moves some choices (so
    matching logits means matching routing)."""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    if not case.cfg.moe.num_experts:
        return
    assert_routing_is_near_its_margins(case.hf_model, tokens, mask, case.cfg.moe.num_experts)


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    assert cfg.family == case.hf_model.config.model_type
    layers = cfg.layer_pattern()
    if case.family == "cwm":
        assert [x.local for x in layers] == [False, True, True, True, False] and cfg.attention.sliding_window == WINDOW
        assert cfg.rope.scaling.kind == "llama3"
    elif case.family == "youtu":
        assert [x.mixer for x in layers] == ["mla"] * 3 and [x.ffn for x in layers] == ["mlp"] * 3
        assert (
            cfg.mla.kv_lora_rank,
            cfg.mla.q_lora_rank,
            cfg.mla.rope_head_dim,
            cfg.attention.head_dim,
            cfg.value_head_dim,
        ) == (
            10,
            12,
            4,
            10,
            7,
        )
        assert cfg.rope.interleave and cfg.rope.scaling.kind == "yarn"
    elif case.family == "hy_v3":
        assert [x.ffn for x in layers] == ["mlp", "moe", "moe"] and cfg.attention.qk_norm and cfg.moe.router_bias
        assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.num_shared_experts, cfg.moe.router_scale) == (
            5,
            2,
            2,
            1.7,
        )
    elif case.family == "minicpm5_moe":
        assert (
            [x.ffn for x in layers] == ["mlp", "moe", "mlp"] and cfg.attention.output_gate and not cfg.attention.qk_norm
        )
        assert (cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale) == (2, 1, 1.3)
        assert case.params["blocks"]["attn"]["wq_dnh"].shape == (1, 30, 6, 16)  # each head's query and gate
    elif case.family == "sarvam_mla":
        assert [x.mixer for x in layers] == ["mla"] * 3 and [x.ffn for x in layers] == ["mlp", "moe", "moe"]
        assert cfg.mla.q_lora_rank is None and cfg.rope.scaling.kind == "yarn" and cfg.moe.num_shared_experts == 2
    elif case.family in ("sarvam_moe", "param2moe"):
        assert (
            [x.ffn for x in layers] == ["mlp", "moe", "moe"] and cfg.attention.qk_norm and cfg.rope.rotary_dim is None
        )
        assert cfg.attention.qkv_bias == (case.family == "param2moe") and cfg.tie_embeddings == (
            case.family == "param2moe"
        )
    elif case.family == "apertus1p5_text":
        assert (cfg.vocab_size, cfg.head.vocab_size, cfg.mlp.activation) == (37, 29, "xielu")
        assert case.params["lm_head_dv"].shape == (30, 29) and case.params["embed_vd"].shape == (37, 30)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


PUBLISHED = {  # preset: the model card's total (billions) and how closely ModelConfig.num_params meets it
    "cwm-32b": (32, 0.03),
    "youtu-llm-2b": (1.96, 0.01),
    "hy3-preview": (295, 0.01),
    "minicpm5-15b-a2.5b": (15, 0.01),
    "sarvam-105b": (105, 0.01),
    "sarvam-30b": (32.2, 0.01),  # named 30B
    "param2-17b-a2.4b": (17, 0.01),
    "apertus-1.5-8b": (8.6, 0.01),  # Apertus 8B's decoder over the larger embedding
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same trainable parameter count (on
    the meta device) and of the size its model card gives."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)


def hf_dict(name: str) -> dict:
    """config.json of the case `name` as transformers writes it."""
    config = hf_config(name)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    return {**config.to_dict(), "architectures": [model_class.__name__]}


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"mlp_bias=true is not supported"):
        model_config_from_hf({**hf_dict("cwm"), "mlp_bias": True})
    with pytest.raises(ConfigError, match=r"use_gated_attention=false is not supported"):
        model_config_from_hf({**hf_dict("minicpm5_moe"), "use_gated_attention": False})
    with pytest.raises(ConfigError, match=r"output_vocab_size must be at most vocab_size, with untied embeddings"):
        model_config_from_hf({**hf_dict("apertus1p5_text"), "tie_word_embeddings": True})


def test_a_published_sarvam_mla_config_reads_as_transformers_reads_it():
    """sarvam-105b's config.json in DeepSeek's own keys (q_head_dim, a head_dim of the whole
    query head, rope_scaling type deepseek_yarn): the model transformers' SarvamMLAConfig makes
    of it, which is the model of its re-saved form."""
    modern = hf_dict("sarvam_mla")
    legacy = {k: v for k, v in modern.items() if k not in ("rope_parameters", "qk_head_dim")}
    legacy |= {
        "architectures": ["SarvamMLAForCausalLM"],
        "rope_theta": 500.0,
        "rope_scaling": {k: v for k, v in yarn_rope().items() if k != "rope_theta"} | {"type": "deepseek_yarn"},
        "q_head_dim": 10,
        "head_dim": 10,
    }
    assert model_config_from_hf(legacy) == model_config_from_hf(modern)
    theirs = transformers.SarvamMLAConfig(**{k: v for k, v in legacy.items() if k != "architectures"})
    assert theirs.rope_parameters == {**yarn_rope(), "rope_type": "yarn"} == modern["rope_parameters"]


def test_apertus_1p5_published_with_its_tokenizers_converts_as_its_text_decoder(tmp_path):
    """Apertus1p5ForConditionalGeneration (as the released checkpoints are): conversion reads
    the decoder under model.language_model. and the pruned head, skips the vision and audio
    tokenizers, and the model's logits are transformers' for text."""
    text = {**hf_config("apertus1p5_text").to_dict(), "model_type": "apertus1p5_text"}
    vision = dict(codebook_size=4, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1])
    vision |= dict(num_res_blocks=1, attn_resolutions=[], resolution=16)
    audio = dict(model_type="wavtokenizer_encoder", codebook_size=4, hidden_size=32, codebook_dim=32, num_filters=4)
    config = transformers.Apertus1p5Config(
        text_config=text,
        vision_config=vision,
        audio_config={**audio, "num_lstm_layers": 1},
        image_token_offset=29,  # the 4 image then 4 audio tokens: the rows the head leaves out
        audio_token_offset=33,
        image_token_id=27,
        audio_token_id=28,
    )
    torch.manual_seed(0)
    model = transformers.Apertus1p5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("model.language_model.", "lm_head.")):
                p.copy_(0.3 * torch.randn_like(p) + (p if p.ndim == 1 else 0))
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    assert cfg.family == "apertus1p5_text" and cfg.head.vocab_size == 29
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(cfg, compute, params, tokens, mask)
    ref = hf_logits(model, tokens, mask)
    assert ours.shape == ref.shape == (3, 20, 29)
    assert float(np.abs(ours - ref)[valid].max()) <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_hy3s_multi_token_prediction_layer_is_skipped(tmp_path):
    """Hy3's checkpoints carry a layer after the last (`model.layers.{num_hidden_layers}.`,
    which transformers skips): conversion skips it too, and the model it writes is the one
    without it."""
    from safetensors.numpy import load_file, save_file

    model = random_hf_model("hy_v3")
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "plain")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.ones((30, 60), np.float32)
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((13, 30), np.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    plain_cfg, plain, _ = load_params(tmp_path / "plain" / "checkpoint")
    assert cfg == plain_cfg and cfg.mtp_layers == 0
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lora_targets_what_sarvam_moe_checkpoints_hold_apart_under_transformers_module_names():
    """q, k and v are one tensor in Sarvam MoE's checkpoints: LoRA refuses them in one sentence
    (all-linear leaves them out); o_proj, stored as attention.dense, is adapted under the name
    of transformers' module (what PEFT loads onto)."""
    from engine.interop.hf.peft import _adapted_specs, _modules
    from engine.models.config import LoraConfig

    cfg, _ = model_config_from_hf(hf_dict("sarvam_moe"))
    assert LoraConfig(target_modules="all-linear").targets(cfg) == ("o_proj",)
    with pytest.raises(ValueError, match=r"family 'sarvam_moe' has no module q_proj to adapt; it can adapt: o_proj$"):
        LoraConfig(target_modules=["q_proj"]).targets(cfg)
    with pytest.raises(ValueError, match=r"cannot adapt query_key_value as PEFT would \(the checkpoints fuse it"):
        LoraConfig(target_modules=["query_key_value"]).targets(cfg)
    names = [
        name
        for _, spec, layers in _adapted_specs(cfg, LoraConfig(target_modules=["o_proj"]))
        for _, name in _modules(cfg, spec, layers)
    ]
    assert names == [f"base_model.model.model.layers.{i}.self_attn.o_proj" for i in (0, 1, 2)]
