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

import json

import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    Case,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_loads_in_transformers_cleanly_with_the_same_logits,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
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
    }[name]()


PUBLISHED_AS = {"exaone": "ExaoneForCausalLM", "internlm3": "InternLM3ForCausalLM"}
"""transformers 5 runs these as Llama and saves `LlamaForCausalLM`; the published files (and
the engine's export) name their own class."""


@pytest.fixture(scope="module", params=["helium", "internlm3", "seed_oss", "arcee", "ernie4_5", "exaone"])
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    config = hf_config(name)
    for key, value in NO_TOKENS.items():  # token ids inside the tiny vocabulary (or none)
        setattr(config, key, value)
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
    }[case.family]
    assert {key: getattr(case.cfg, key) for key in expected} == expected
    assert case.cfg.family == case.family and case.cfg.num_params() == sum(
        p.numel() for p in case.hf_model.parameters()
    )


# --------------------------------------------------------------------------- config.json forms


def test_the_published_and_transformers_5_forms_of_config_json_read_alike():
    """EXAONE's published keys (num_layers, layer_norm_epsilon, activation_function) and class
    (ExaoneForCausalLM) and transformers 5's (num_hidden_layers, ..., LlamaForCausalLM) are one
    model; InternLM3's likewise."""
    exaone = hf_config("exaone").to_dict()
    saved = {**exaone, "architectures": ["LlamaForCausalLM"]}
    published = {k: v for k, v in exaone.items() if k not in ("num_hidden_layers", "rms_norm_eps", "hidden_act")}
    published |= {"architectures": ["ExaoneForCausalLM"], "num_layers": 3, "layer_norm_epsilon": 1e-5}
    published |= {"activation_function": "silu"}
    assert model_config_from_hf(saved) == model_config_from_hf(published)
    internlm3 = hf_config("internlm3").to_dict()
    for architecture in ("LlamaForCausalLM", "InternLM3ForCausalLM"):
        cfg, _ = model_config_from_hf({**internlm3, "architectures": [architecture]})
        assert cfg.family == "internlm3"


@pytest.mark.parametrize(
    ("name", "key", "value", "message"),
    [
        ("internlm3", "qkv_bias", True, "qkv_bias=true is not supported"),
        ("internlm3", "rope_parameters", {"rope_type": "dynamic", "factor": 6.0}, "RoPE type 'dynamic'"),
        ("ernie4_5", "use_bias", True, "use_bias=true is not supported"),
        ("seed_oss", "mlp_bias", True, "mlp_bias=true is not supported"),
        ("arcee", "hidden_act", "silu", "hidden_act 'silu' is not supported"),
        ("helium", "hidden_size", 30, "must equal hidden_size"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_in_one_sentence(name, key, value, message):
    hf = {**hf_config(name).to_dict(), key: value}
    with pytest.raises(ConfigError, match=message) as refused:
        model_config_from_hf(hf)
    assert "\n" not in str(refused.value)


# --------------------------------------------------------------------------- presets

PRESETS = ["helium-1-preview-2b", "internlm3-8b", "seed-oss-36b", "afm-4.5b", "ernie-4.5-0.3b", "exaone-3.0-7.8b"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_presets_have_transformers_parameter_count(preset):
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
