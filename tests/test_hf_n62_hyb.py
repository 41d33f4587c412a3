"""Hugging Face parity of the newer hybrids: OLMo Hybrid (Gated DeltaNet layers, pre-norm, among
OLMo 3's post-norm attention layers) and Ling 3 (bailing_hybrid: Kimi Delta Attention with
full-rank, bounded gates among gated latent attention layers, DeepSeek-V3's experts).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4 with N(0, 0.3^2) weights, greedy tokens
and the recurrent sampler equal transformers' generate, the export loading cleanly in
transformers, config.json as transformers writes it, export -> convert bitwise. Plus: the state
after a prompt and decoded tokens against one forward's, the chunked delta rule against its
recurrence at OLMo Hybrid's write strengths (up to 2), the checkpoints' layouts, and the presets'
parameter counts against transformers' (meta device). Tiny models with odd widths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.interop.hf.safetensors_io import SafetensorsFile  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.ops.gated_delta import gated_delta_chunked, gated_delta_scan  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    converted_case,
    prefill_then_decode,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(name: str):
    t = transformers
    return {
        # layers L L A L: attention of 6
        # heads of 6 over 2 KV heads (head_dim is hidden_size / heads), base 500; Gated DeltaNet
        # of 3 heads, keys of 6, values of 10, 3 taps, write strength 2 sigmoid(b); an MLP of 26
        "olmo_hybrid": lambda: t.OlmoHybridConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=26,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=6,
            linear_value_head_dim=10,
            linear_conv_kernel_dim=3,
            max_position_embeddings=64,
            layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **TOKENS,
        ),
        # layers K K A: Kimi delta attention of 3 heads of 8, 3 taps (full-rank gates, the forget
        # gate bounded by -5); latent attention of 3 heads of 8 + 4 rotary (base 500, interleaved),
        # latent 10, values of 6, a gate per head; a dense MLP of 26 in layer 0, then 4 experts of
        # 14 (top 2 in 2 groups, the best group) and a shared expert of 14
        "bailing_hybrid": lambda: t.BailingHybridConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=26,
            moe_intermediate_size=14,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=8,
            kv_lora_rank=10,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
            n_group=2,
            topk_group=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            short_conv_kernel_size=3,
            layer_group_size=3,
            num_mtp_layers=0,
            max_position_embeddings=64,
            rope_theta=500.0,  # as the published config.json gives it (rope_parameters follows)
            **TOKENS,
        ),
    }[name]()


CASES = ["olmo_hybrid", "bailing_hybrid"]
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
    if case.family == "olmo_hybrid":
        # The published layout (OLMo-core's q, k, v convolutions, 18, 18 and 30 channels);
        # transformers' save_pretrained, which the case converted, chunks them in equal thirds.
        with SafetensorsFile(tmp_path / "export" / "model.safetensors") as ours:
            shapes = [tuple(ours.shape(f"model.layers.0.linear_attn.{x}_conv1d.weight")) for x in "qkv"]
        with SafetensorsFile(case.hf_dir / "model.safetensors") as theirs:
            saved = [tuple(theirs.shape(f"model.layers.0.linear_attn.{x}_conv1d.weight")) for x in "qkv"]
        assert shapes == [(18, 1, 3), (18, 1, 3), (30, 1, 3)] and saved == [(22, 1, 3)] * 3


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    assert cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())
    if case.family == "olmo_hybrid":
        assert [layer.mixer for layer in cfg.layer_pattern()] == ["gated_delta"] * 2 + ["attention", "gated_delta"]
        assert dict(cfg.layer_stacks()) == {"gated_delta_blocks": (0, 1, 3), "blocks": (2,)}
        specs = cfg.layer_specs()
        assert [(s.pre_norms, s.post_norms) for s in specs] == [(True, False)] * 2 + [(False, True), (True, False)]
        gd = specs[0].mixer
        assert (gd.beta_scale, gd.norm_eps, gd.key_head_dim, gd.value_head_dim) == (2.0, 1e-5, 6, 10)
        assert specs[2].mixer.head_dim == 6 and specs[2].mixer.rope.theta == 500.0
    if case.family == "bailing_hybrid":
        assert [(x.mixer, x.ffn) for x in cfg.layer_pattern()] == [
            ("kimi_delta", "mlp"),
            ("kimi_delta", "moe"),
            ("mla", "moe"),
        ]
        kda, mla = cfg.layer_specs()[0].mixer, cfg.layer_specs()[2].mixer
        assert (kda.full_rank_gates, kda.gate_lower_bound, kda.head_dim, kda.conv_kernel) == (True, -5.0, 8, 3)
        assert mla.head_gate and mla.rope.interleave and (mla.head_dim, mla.rope_head_dim) == (12, 4)
        moe = cfg.layer_specs()[1].ffn
        assert (moe.router_groups, moe.router_group_top, moe.router_scale) == (2, 1, 2.5)


def test_the_state_after_a_prompt_and_decoded_tokens_is_a_full_forwards(case):
    """Prefill 9 tokens (one row left-padded by 3), decode 6 one at a time: every recurrent
    layer's convolution window and state equal those of one forward over all 15, and so do the
    last logits. One case (CI time): Ling 3's cached decoding is checked against transformers'
    generate by the greedy test's sampler."""
    if case.family != "olmo_hybrid":
        pytest.skip("one case per delta rule's state (CI time)")
    logits, cache, full_logits, full = prefill_then_decode(case)
    recurrent = [(ours, theirs) for ours, theirs in zip(cache.states, full.states, strict=True) if ours is not None]
    assert len(recurrent) == sum(layer.mixer not in ("attention", "mla") for layer in case.cfg.layer_pattern())
    for ours, theirs in recurrent:
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        assert np.abs(np.asarray(ours[1])).max() > 0.1
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(full_logits[:, -1]), atol=1e-4)


def test_the_chunked_delta_rule_is_the_recurrence_at_write_strengths_up_to_2():
    """OLMo Hybrid's beta = 2 sigmoid(b): the chunked form (chunks of 8 over 19 tokens, two
    packed documents, a carried-in state) equals the token-by-token recurrence."""
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 2, 19, 3, 6, 10
    q, k = (jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = jnp.asarray(-np.exp(rng.normal(size=(b, t, h))) * 0.2, jnp.float32)
    beta = 2.0 * jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)) * 2, jnp.float32))
    assert float(beta.max()) > 1.5
    segments = jnp.asarray([[1] * 7 + [2] * 12, [1] * 19], jnp.int32)
    state = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    kw = {"state_bhkv": state, "segment_ids_bt": segments}
    out, final = jax.jit(lambda *x: gated_delta_chunked(*x, chunk_size=8, **kw))(q, k, v, g, beta)
    ref, ref_final = jax.jit(lambda *x: gated_delta_scan(*x, **kw))(q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(final), np.asarray(ref_final), rtol=1e-4, atol=1e-4)


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    olmo = {**hf_config("olmo_hybrid").to_dict(), "architectures": ["OlmoHybridForCausalLM"]}
    ling = {**hf_config("bailing_hybrid").to_dict(), "architectures": ["BailingHybridForCausalLM"]}
    for config, message in (
        (
            {**ling, "expert_swiglu_limit_list": [0, 7.0, 7.0]},
            r"expert_swiglu_limit_list \[0, 7.0, 7.0\] is not supported \(SwiGLU clipping: zeros only\)",
        ),
        ({**olmo, "linear_num_value_heads": 6}, r"linear_num_key_heads 3 must equal linear_num_value_heads 6"),
        ({**olmo, "layer_types": ["linear_attention"] * 3}, r"layer_types must be 4 entries of linear_attention"),
        ({**olmo, "hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(silu\)"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            model_config_from_hf(config)
        assert "\n" not in str(refused.value)
    # Without negative eigenvalues the write strength is sigmoid(b), and it is written back so
    cfg, _ = model_config_from_hf({**olmo, "linear_allow_neg_eigval": False})
    assert cfg.gated_delta.beta_scale == 1.0 and model_config_to_hf(cfg)["linear_allow_neg_eigval"] is False


PRESETS = {  # preset -> its published parameter count, in billions
    "olmo-hybrid-7b": 7.43,
    "ling-3.0-flash": 124.41,  # transformers' BailingHybridConfig defaults
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device), the published one, and its config.json reads back as itself."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert round(cfg.num_params() / 1e9, 2) == PRESETS[preset]
    again, _ = model_config_from_hf({**hf.to_dict(), "architectures": [hf.architectures[0]]})
    assert again == cfg


def test_convolution_parts_that_do_not_fill_the_convolution_are_refused(tmp_path):
    """OLMo Hybrid's q/k/v_conv1d are read at any bounds that together fill the convolution's
    channels (published or transformers' thirds); two channels short, refused in one sentence."""
    model = random_causal_lm(hf_config("olmo_hybrid"), 1)
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.0.linear_attn.v_conv1d.weight"
    tensors[name] = tensors[name][:-2]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"together 64 along axis 0, but config.json \(OlmoHybridForCausalLM\) implies 66"
    ):
        convert_hf(tmp_path / "hf", tmp_path / "converted")
