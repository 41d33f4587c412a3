"""Hugging Face parity of dense decoders that are Llama up to a setting or a layout: Helium
(RoPE on adjacent pairs), InternLM3, Seed-OSS (q/k/v and o_proj biases), Arcee AFM (an
ungated relu2 MLP, YaRN), ERNIE 4.5 (adjacent-pair RoPE, tied embeddings), EXAONE 3 (GPT-2
tensor and key names, Llama 3.1 RoPE scaling), Ministral (a window on some layers), Ministral
3 (YaRN and a query scale that grows with the position) and Hunyuan dense (QK norms after RoPE).

Each case is a tiny random model on odd shapes (6 query heads over 2 KV heads, head_dim 8
unlike hidden_size / heads, vocab 37) and gets the checks tests/test_hf_parity.py makes of every
family (collected here over this module's `case`): logits to 1e-4, greedy tokens and the
KV-cache sampler equal transformers', export loads cleanly with the same logits, config.json
as transformers writes it, export -> convert bitwise. The presets build as transformers models
of the same parameter count (on the meta device).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine import flat_keys  # noqa: E402
from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.inference.sample import Sampler  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.interop.hf.peft import adapter_to_peft  # noqa: E402
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig  # noqa: E402
from engine.models.lora import split_adapter  # noqa: E402
from engine.models.params import abstract_model_params  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    VOCAB,
    WINDOW,
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_loads_in_transformers_cleanly_with_the_same_logits,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

ROPE = {"rope_type": "default", "rope_theta": 500.0}
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(name: str):
    t = transformers
    return {
        # o_proj is (hidden, hidden): 6 heads of 6 make the model's 36
        "helium": lambda: t.HeliumConfig(**{**COMMON, "hidden_size": 36, "head_dim": 6}, rope_parameters=ROPE),
        "internlm3": lambda: t.AutoConfig.for_model("internlm3", **COMMON, rope_parameters=ROPE),
        # biases on q, k, v and o_proj
        "seed_oss": lambda: t.SeedOssConfig(**COMMON, attention_out_bias=True, rope_parameters=ROPE),
        "arcee": lambda: t.ArceeConfig(**COMMON, rope_parameters=YARN),
        "ernie4_5": lambda: t.Ernie4_5Config(**COMMON, rope_parameters=ROPE),
        "exaone": lambda: t.AutoConfig.for_model("exaone", **COMMON, rope_parameters=LLAMA3),
        # layer 0 global, the rest local (a pattern that does not repeat)
        "ministral": lambda: t.MinistralConfig(
            **COMMON,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=ROPE,
        ),
        # the query scale steps up at positions 16 and 32 (within the prompts and generation)
        "ministral3": lambda: t.Ministral3Config(
            **COMMON, sliding_window=WINDOW, rope_parameters={**YARN, "llama_4_scaling_beta": 0.5}
        ),
        # QK norms after RoPE; Hunyuan's fixed NTK alpha stretching the RoPE base
        "hunyuan_v1_dense": lambda: t.HunYuanDenseV1Config(
            **COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 50.0, "alpha": 10.0, "factor": 1.0}
        ),
    }[name]()


PUBLISHED_AS = {"exaone": "ExaoneForCausalLM", "internlm3": "InternLM3ForCausalLM"}
"""transformers 5 runs these as Llama and saves `LlamaForCausalLM`; the published files (and
the engine's export) name their own class."""


NAMES = ["helium", "internlm3", "seed_oss", "arcee", "ernie4_5", "exaone"]
NAMES += ["ministral", "ministral3", "hunyuan_v1_dense"]


@pytest.fixture(scope="module", params=NAMES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    config = hf_config(name)
    for key, value in NO_TOKENS.items():  # token ids inside the tiny vocabulary (or none)
        setattr(config, key, value)
    if name == "hunyuan_v1_dense":  # Hunyuan's end-of-document id, a tokenizer's (export writes null)
        config.eod_token_id = None
    model = random_causal_lm(config, attn_implementation="eager")
    model.save_pretrained(root / "hf")
    if name in PUBLISHED_AS:
        model.config.architectures = [PUBLISHED_AS[name]]
        written = json.loads((root / "hf" / "config.json").read_text())
        (root / "hf" / "config.json").write_text(json.dumps({**written, "architectures": [PUBLISHED_AS[name]]}))
    (root / "hf" / "tokenizer.json").write_text('{"stand-in": true}')  # carried over as a file
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return Case(name, model, root / "hf", root / "converted", cfg, compute, params)


def test_the_settings_that_differ_from_llama_are_read(case):
    expected = {
        "helium": {"rope_interleave": True, "d_model": 36, "head_dim": 6},
        "internlm3": {"rope_interleave": False},
        "seed_oss": {"qkv_bias": True, "attention_out_bias": True},
        "arcee": {"mlp_gated": False, "activation": "relu2"},
        "ernie4_5": {"rope_interleave": True, "tie_embeddings": True},
        "exaone": {"tie_embeddings": False},
        "ministral": {"attention_pattern": ["global", "local", "local"], "sliding_window": WINDOW},
        "ministral3": {"attention_pattern": ["local"], "query_position_scale": 0.5},
        "hunyuan_v1_dense": {"qk_norm": True, "qk_norm_after_rope": True, "rope_theta": 50.0 * 10.0 ** (8 / 6)},
    }[case.family]
    assert {key: flat_keys.value(case.cfg, key) for key in expected} == expected
    assert case.cfg.family == case.family and case.cfg.num_params() == sum(
        p.numel() for p in case.hf_model.parameters()
    )


DIFFERENCES = {
    "helium": {"rope_interleave": False},
    "ernie4_5": {"rope_interleave": False},
    "ministral3": {"query_position_scale": None},
    "hunyuan_v1_dense": {"qk_norm_after_rope": False},
}
"""The setting each of these families adds to Llama's math, undone."""


@pytest.mark.parametrize("case", sorted(DIFFERENCES), indirect=True)
def test_each_added_setting_shows_in_the_logits(case):
    """Without its setting the converted model's logits move well past the 1e-4 tolerance (so
    the parity above tests the setting): RoPE pairs, the query scale past position 16, the QK
    norms' place. (The other types are Llama's math under other names and keys, Seed-OSS's
    biases and Arcee's ungated MLP parameters of their own.)"""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    without = case.cfg.model_copy(update=DIFFERENCES[case.family])
    other = engine_logits(without, case.compute, case.params, tokens, mask)
    assert np.abs(ours - other)[valid].max() > 1e-2


def test_exported_config_json_is_what_transformers_writes(case, tmp_path):
    """As tests/test_hf_parity.py checks; Hunyuan's NTK alpha is written as the RoPE base it
    stretches to (export reloads with the same logits, bitwise: the test above), the rest of
    its file as transformers writes it."""
    if case.family == "hunyuan_v1_dense":
        source = json.loads((case.hf_dir / "config.json").read_text())
        rope = source["rope_parameters"]
        assert rope["rope_type"] == "dynamic" and rope["alpha"] == 10.0
        stretched = {"rope_type": "default", "rope_theta": rope["rope_theta"] * rope["alpha"] ** (8 / 6)}
        shutil.copytree(case.hf_dir, tmp_path / "stretched")
        (tmp_path / "stretched" / "config.json").write_text(json.dumps({**source, "rope_parameters": stretched}))
        case = dataclasses.replace(case, hf_dir=tmp_path / "stretched")
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_lora_adapters_are_named_and_shaped_as_peft_makes_them(case):
    """An adapter on every linear layer exports under PEFT's names on the transformers class:
    EXAONE's are Llama's (transformers 5 renames its checkpoint's modules on loading), Arcee's
    MLP has no gate_proj."""
    peft = need("peft")
    targets = LoraConfig(target_modules="all-linear").targets(case.cfg)
    assert ("gate_proj" in targets) == (case.family != "arcee")
    lora = LoraConfig(rank=2, target_modules=list(targets))
    shapes = split_adapter(abstract_model_params(case.cfg, ComputeConfig(), None, lora))[0]
    adapter = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    ours = adapter_to_peft(case.cfg, lora, adapter, scan_layers=True)
    hf = random_causal_lm(hf_config(case.family))
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=list(targets)))
    theirs = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(hf).items()}
    assert {k: v.shape for k, v in ours.items()} == theirs


@pytest.mark.parametrize("case", ["ministral3"], indirect=True)
def test_the_multimodal_ministral3_checkpoint_converts_to_the_text_model(case, tmp_path):
    """Ministral 3 as published (Mistral3ForConditionalGeneration: a vision tower, a projector
    and the same text decoder, saved by transformers) converts to exactly the text model's
    params; exported back beside the source's vision tower, transformers loads every tensor
    bitwise. A Mistral3ForConditionalGeneration around a Mistral decoder stays refused."""
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    config = transformers.Mistral3Config(
        text_config=case.hf_model.config.to_dict(),
        vision_config={**vision, "image_size": 28, "patch_size": 14},
        tie_word_embeddings=False,  # as the text model (Mistral3Config's default ties them)
    )
    multimodal = transformers.Mistral3ForConditionalGeneration(config)
    text = {k.removeprefix("model."): v for k, v in case.hf_model.state_dict().items() if k.startswith("model.")}
    missing, unexpected = multimodal.model.language_model.load_state_dict(text, strict=False)
    assert not missing and not unexpected
    multimodal.lm_head.load_state_dict(case.hf_model.lm_head.state_dict())
    multimodal.save_pretrained(tmp_path / "mm")
    summary = convert_hf(tmp_path / "mm", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg and summary["architecture"] == "Ministral3ForCausalLM" and summary["skipped_tensors"] > 0
    flat_a, tree_a = jax.tree.flatten(case.params)
    flat_b, tree_b = jax.tree.flatten(params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    result = export_hf(tmp_path / "converted" / "checkpoint", tmp_path / "back", multimodal_source=tmp_path / "mm")
    assert result["architecture"] == "Mistral3ForConditionalGeneration"
    reloaded, info = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        tmp_path / "back", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs, ours = multimodal.state_dict(), reloaded.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
    mistral = {**config.to_dict(), "text_config": {**config.text_config.to_dict(), "model_type": "mistral"}}
    with pytest.raises(ConfigError, match="unsupported architecture 'Mistral3ForConditionalGeneration'"):
        model_config_from_hf(mistral)


# --------------------------------------------------------------------------- dynamic NTK RoPE


def test_dynamic_ntk_rope_matches_transformers_past_the_original_context(tmp_path):
    """InternLM3's published RoPE (`dynamic`, factor 6), here with a 16-position original
    context: the 20-token rows' logits (base stretched for length 20) within 1e-4 of
    transformers', and the KV-cache sampler's tokens equal to transformers' generate while a
    7-token prompt grows past 16 (each step's keys rotated at that step's base, as transformers
    does). Without the stretch the logits move by more than 1e-2."""
    config = hf_config("internlm3")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 6.0}
    config.max_position_embeddings = 16
    for key, value in NO_TOKENS.items():
        setattr(config, key, value)
    model = random_causal_lm(config, attn_implementation="eager")
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    assert cfg.rope.scaling.kind == "dynamic" and cfg.rope.scaling.original_max_position == 16
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours, ref = engine_logits(cfg, compute, params, tokens, mask), hf_logits(model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\ninternlm3 dynamic NTK: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4
    unscaled = engine_logits(cfg.model_copy(update={"rope_scaling": None}), compute, params, tokens, mask)
    assert np.abs(ours - unscaled)[valid].max() > 1e-2
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
    sampled = Sampler(cfg, compute)(
        params, prompt.astype(np.int32), np.ones_like(prompt), max_new_tokens=16, num_generations=1, temperature=0.0
    )
    np.testing.assert_array_equal(sampled.tokens, out[:, 7:].numpy())
    hf = model_config_to_hf(cfg)
    assert hf["rope_parameters"] == {"rope_type": "dynamic", "factor": 6.0, "rope_theta": 500.0}
    assert hf["max_position_embeddings"] == 16


# --------------------------------------------------------------------------- config.json forms


def test_the_published_and_transformers_5_forms_of_config_json_read_alike():
    """EXAONE's published keys (num_layers, layer_norm_epsilon, activation_function) and class
    (ExaoneForCausalLM) and transformers 5's (num_hidden_layers, ..., LlamaForCausalLM) are one
    model; InternLM3's likewise; a Ministral 3 file without rope_parameters is its class's default."""
    exaone = hf_config("exaone").to_dict()
    saved = {**exaone, "architectures": ["LlamaForCausalLM"]}
    published = {k: v for k, v in exaone.items() if k not in ("num_hidden_layers", "rms_norm_eps", "hidden_act")}
    published |= {"architectures": ["ExaoneForCausalLM"], "num_layers": 3, "layer_norm_epsilon": 1e-5}
    published |= {"activation_function": "silu"}
    assert model_config_from_hf(saved) == model_config_from_hf(published)
    # Ministral 3 without rope_parameters: its class's default YaRN and query scale
    ministral3 = {k: v for k, v in hf_config("ministral3").to_dict().items() if k != "rope_parameters"}
    cfg, _ = model_config_from_hf(ministral3)
    assert (cfg.rope.theta, cfg.rope.scaling.factor, cfg.rope.scaling.original_max_position) == (1e6, 16, 16384)
    assert cfg.attention.query_position_scale == 0.1
    internlm3 = hf_config("internlm3").to_dict()
    for architecture in ("LlamaForCausalLM", "InternLM3ForCausalLM"):
        cfg, _ = model_config_from_hf({**internlm3, "architectures": [architecture]})
        assert cfg.family == "internlm3"


@pytest.mark.parametrize(
    ("name", "key", "value", "message"),
    [
        ("internlm3", "qkv_bias", True, "qkv_bias=true is not supported"),
        ("internlm3", "rope_parameters", {"rope_type": "longrope", "factor": 6.0}, "RoPE type 'longrope'"),
        ("ernie4_5", "use_bias", True, "use_bias=true is not supported"),
        ("seed_oss", "mlp_bias", True, "mlp_bias=true is not supported"),
        ("arcee", "hidden_act", "silu", "hidden_act 'silu' is not supported"),
        ("helium", "hidden_size", 30, "must equal hidden_size"),
        ("ministral3", "rope_parameters", YARN, "needs llama_4_scaling_beta"),
        ("hunyuan_v1_dense", "use_cla", True, "use_cla=true"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_in_one_sentence(name, key, value, message):
    hf = {**hf_config(name).to_dict(), key: value}
    with pytest.raises(ConfigError, match=message) as refused:
        model_config_from_hf(hf)
    assert "\n" not in str(refused.value)


# --------------------------------------------------------------------------- presets

PRESETS = ["helium-1-preview-2b", "internlm3-8b", "seed-oss-36b", "afm-4.5b", "ernie-4.5-0.3b", "exaone-3.0-7.8b"]
PRESETS += ["ministral-8b", "ministral-3-8b", "hunyuan-7b"]


PUBLISHED = {
    # internlm/internlm3-8b-instruct
    "internlm3-8b": {
        "architectures": ["InternLM3ForCausalLM"],
        "model_type": "internlm3",
        "bias": False,
        "qkv_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 10240,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 6.0, "rope_type": "dynamic"},
        "rope_theta": 50000000,
        "tie_word_embeddings": False,
        "vocab_size": 128512,
    },
    # LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct
    "exaone-3.0-7.8b": {
        "architectures": ["ExaoneForCausalLM"],
        "model_type": "exaone",
        "activation_function": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "layer_norm_epsilon": 1e-05,
        "max_position_embeddings": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_layers": 32,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 102400,
    },
    # kyutai/helium-1-preview-2b
    "helium-1-preview-2b": {
        "architectures": ["HeliumForCausalLM"],
        "model_type": "helium",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "intermediate_size": 7040,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "num_attention_heads": 20,
        "num_hidden_layers": 24,
        "num_key_value_heads": 20,
        "rms_norm_eps": 1e-08,
        "rope_theta": 100000.0,
        "tie_word_embeddings": False,
        "vocab_size": 48000,
    },
    # ByteDance-Seed/Seed-OSS-36B-Instruct
    "seed-oss-36b": {
        "architectures": ["SeedOssForCausalLM"],
        "model_type": "seed_oss",
        "attention_bias": True,
        "attention_out_bias": False,
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "max_position_embeddings": 524288,
        "num_attention_heads": 80,
        "num_hidden_layers": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": False,
        "vocab_size": 155136,
    },
    # arcee-ai/AFM-4.5B
    "afm-4.5b": {
        "architectures": ["ArceeForCausalLM"],
        "model_type": "arcee",
        "head_dim": 128,
        "hidden_act": "relu2",
        "hidden_size": 2560,
        "intermediate_size": 18432,
        "max_position_embeddings": 65536,
        "num_attention_heads": 20,
        "num_hidden_layers": 36,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 4096},
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128004,
    },
    # baidu/ERNIE-4.5-0.3B-PT, first release (remote code's class name)
    "ernie-4.5-0.3b": {
        "architectures": ["Ernie4_5_ForCausalLM"],
        "model_type": "ernie4_5",
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 131072,
        "num_attention_heads": 16,
        "num_hidden_layers": 18,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000,
        "tie_word_embeddings": True,
        "use_bias": False,
        "vocab_size": 103424,
    },
    # tencent/Hunyuan-7B-Instruct
    "hunyuan-7b": {
        "architectures": ["HunYuanDenseV1ForCausalLM"],
        "model_type": "hunyuan_v1_dense",
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "dynamic", "alpha": 1000, "factor": 1},
        "rope_theta": 10000,
        "tie_word_embeddings": True,
        "use_cla": False,
        "use_qk_norm": True,
        "vocab_size": 128167,
    },
}
"""Published config.json files (their architecture keys)."""


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_published_config_json_reads_as_the_preset(preset):
    cfg, _ = model_config_from_hf(PUBLISHED[preset])
    assert cfg == ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])


@pytest.mark.parametrize("preset", PRESETS)
def test_the_presets_have_transformers_parameter_count(preset):
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
