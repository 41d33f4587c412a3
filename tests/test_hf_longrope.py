"""LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): the phi3 family's `rope_type: longrope`
against transformers 5.25 on odd shapes.

Two tiny Phi-3 configs: Phi-3.5's shape (every dimension of a head rotated, no window) and
Phi-4-mini's (RoPE on 3/4 of each head, GQA 5:1, a window), both with an original context of
12 positions in a 48-position model, so a 20-token batch runs on the long factors and its
first 10 tokens on the short ones, as transformers switches (max(position) + 1 > 12). Logits
to 1e-5 at transformers' initialisation and 1e-4 with N(0, 0.3^2) weights on both sides of
the switch; export loads in transformers with its logits, config.json as transformers
writes it, export -> convert bitwise; greedy and the KV-cache sampler on either side.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.inference.sample import Sampler  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
)

ORIGINAL = 12


def factors(pairs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "short_factor": [round(float(x), 4) for x in 1 + 0.3 * rng.random(pairs)],
        "long_factor": [round(float(x), 4) for x in np.sort(1 + 6 * rng.random(pairs))],
    }


def hf_config(name: str):
    shared = dict(
        vocab_size=VOCAB,
        intermediate_size=26,
        num_hidden_layers=3,
        max_position_embeddings=48,
        original_max_position_embeddings=ORIGINAL,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if name == "phi3.5":  # 3 heads of 10: 5 rotated pairs
        rope = {"rope_type": "longrope", "rope_theta": 500.0, **factors(5, 0)}
        return transformers.Phi3Config(
            **shared, hidden_size=30, num_attention_heads=3, num_key_value_heads=3, rope_parameters=rope
        )
    # Phi-4-mini's shape: 5 heads of 8 over 1 kv head, RoPE on 6 dims (3 pairs), a window
    rope = {"rope_type": "longrope", "rope_theta": 500.0, "partial_rotary_factor": 0.75, **factors(3, 1)}
    return transformers.Phi3Config(
        **shared,
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=1,
        sliding_window=5,
        rope_parameters=rope,
    )


def _convert(model, root) -> Case:
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return Case("phi3", model, root / "hf", root / "converted", cfg, compute, params)


@pytest.fixture(scope="module", params=["phi3.5", "phi4-mini"])
def case(request, tmp_path_factory) -> Case:
    """N(0, 0.3^2) weights, so the rotation's small differences move the logits."""
    model = random_causal_lm(hf_config(request.param), 0, attn_implementation="eager")
    return _convert(model, tmp_path_factory.mktemp(request.param))


def _delta(case, tokens, mask) -> float:
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 0.5
    return float(np.abs(ours - ref)[valid].max())


def test_longrope_converts_to_its_factors(case):
    hf = case.hf_model.config
    scaling = case.cfg.rope.scaling
    assert scaling.kind == "longrope" and scaling.original_max_position == ORIGINAL
    assert list(scaling.short_factor) == hf.rope_parameters["short_factor"]
    assert list(scaling.long_factor) == hf.rope_parameters["long_factor"]
    assert scaling.yarn_attention_factor() == case.hf_model.model.rotary_emb.attention_scaling
    assert scaling.yarn_attention_factor() == math.sqrt(1 + math.log(4) / math.log(ORIGINAL))


def test_logits_match_transformers_on_both_sides_of_the_switch(case):
    tokens, mask = batch()  # 20 tokens: long factors
    short_tokens, short_mask = tokens[:, :10], np.ones_like(tokens[:, :10])  # 10 <= 12: short
    short_mask[1, 7:] = 0
    long_delta, short_delta = _delta(case, tokens, mask), _delta(case, short_tokens, short_mask)
    print(f"\n{case.hf_model.config.hidden_size}: max |delta logit| long {long_delta:.2e}, short {short_delta:.2e}")
    assert long_delta <= 1e-4 and short_delta <= 1e-4
    # transformers did switch: the first 10 positions' logits differ between the two calls
    first = hf_logits(case.hf_model, tokens, np.ones_like(tokens))[:, :10]
    assert np.abs(first - hf_logits(case.hf_model, short_tokens, np.ones_like(short_tokens))).max() > 1e-2


def test_logits_at_transformers_initialisation_are_within_1e5(tmp_path):
    torch.manual_seed(0)
    for name in ("phi3.5", "phi4-mini"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager")
        converted = _convert(model.float().eval(), tmp_path / name)
        tokens, mask = batch()
        for t in (20, 10):  # long, then short factors
            ours = engine_logits(converted.cfg, converted.compute, converted.params, tokens[:, :t], mask[:, :t])
            ref = hf_logits(converted.hf_model, tokens[:, :t], mask[:, :t])
            delta = float(np.abs(ours - ref)[mask[:, :t].astype(bool)].max())
            print(f"\n{name} at init, {t} tokens: max |delta logit| = {delta:.2e}")
            assert delta <= 1e-5


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", attn_implementation="eager")


def test_exported_config_json_is_what_transformers_writes(case, tmp_path, monkeypatch):
    """test_hf_parity's check, with partial_rotary_factor at the top level too, where
    transformers' Phi3Config and the published checkpoints have it."""
    monkeypatch.setattr(test_hf_parity, "OLDER_KEYS", test_hf_parity.OLDER_KEYS | {"partial_rotary_factor"})
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def _greedy(case, prompt, steps: int):
    case.hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = case.hf_model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones_like(torch.tensor(prompt)),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    ref = out[:, prompt.shape[1] :].numpy()
    sampled = Sampler(case.cfg, case.compute)(
        case.params, prompt.astype(np.int32), np.ones_like(prompt), max_new_tokens=steps, temperature=0.0
    )
    return ref, sampled.tokens


@pytest.mark.parametrize("prompt_length", [4, 14])
def test_kv_cache_greedy_equals_transformers_on_either_side(case, prompt_length):
    """4 + 7 tokens stay within the 12 short positions; a 14-token prompt is on the long
    factors from its prefill on."""
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, prompt_length))
    ref, ours = _greedy(case, prompt, 7)
    np.testing.assert_array_equal(ours, ref)


def test_kv_cache_greedy_across_the_switch_keeps_the_cached_keys(case):
    """An 8-token prompt and 10 new tokens cross 12 positions at the 6th token. transformers
    then drops its cache and recomputes every key with the long factors; the KV-cache sampler
    keeps the keys it cached with the short ones (as vLLM's LongRoPE does), so the tokens are
    transformers' up to the switch."""
    prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 8))
    ref, ours = _greedy(case, prompt, 10)
    np.testing.assert_array_equal(ours[:, :5], ref[:, :5])


def test_bad_factors_are_refused_in_one_sentence():
    hf = {**hf_config("phi4-mini").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    hf["rope_parameters"] = {**hf["rope_parameters"], "short_factor": [1.0] * 4}
    with pytest.raises(ConfigError, match=r"rope_parameters.short_factor must list 3 numbers"):
        model_config_from_hf(hf)
    with pytest.raises(ValueError, match="longrope needs short_factor and long_factor of one length"):
        ModelConfig(
            vocab_size=17, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=8,
            rope_scaling={"kind": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0]},
        )  # fmt: skip


@pytest.mark.parametrize(("preset", "hf_name"), [("phi3.5-mini", "phi3.5"), ("phi4-mini", "phi4-mini")])
def test_presets_carry_longrope(preset, hf_name):
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, "x")["model"])
    scaling = cfg.rope.scaling
    assert scaling.kind == "longrope" and scaling.original_max_position == 4096 and cfg.max_seq_len == 131072
    assert len(scaling.long_factor) == (cfg.rope.rotary_dim or cfg.attention.head_dim) // 2 == 48
    assert scaling.factor == 32.0
