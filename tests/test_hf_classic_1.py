"""Hugging Face parity of the GPT-era families: GPT-NeoX (parallel residual with two
LayerNorms, qkv grouped per head), Phi (one LayerNorm for both sublayers, biases, an LM-head
bias, QK LayerNorm), GPT-J and CodeGen (RoPE on adjacent pairs; CodeGen's qkv in 4 groups),
StableLM (per-head QK LayerNorm), StarCoder2 (window, biases), Falcon (three qkv layouts,
three residual forms), Cohere and Cohere 2 (logit scale, NoPE global layers), Nemotron
(LayerNorm1P, relu2).

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4 with N(0, 0.3^2) weights, greedy
tokens and the KV-cache sampler equal transformers' generate, the export loading cleanly in
transformers, config.json as transformers writes it, export -> convert bitwise. Tiny models
with odd widths; each preset's parameter count is transformers' (meta device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
peft = need("peft")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.mapping import fuse, model_config_from_hf, model_config_to_hf, unfuse  # noqa: E402
from engine.interop.hf.peft import adapter_from_peft, lora_config_from_peft  # noqa: E402
from engine.models.config import LoraConfig, ModelConfig  # noqa: E402
from engine.models.families import TensorSpec  # noqa: E402
from engine.models.lora import join, split_adapter  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    converted_case,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_loads_in_transformers_cleanly_with_the_same_logits,
    test_export_then_convert_is_bitwise_identical,
)

VOCAB = 37  # test_hf_parity's batches draw tokens below it
TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(name: str):
    t = transformers
    return {
        # 3 heads of 12, RoPE on 6 of their dims; the sequential residual and tied embeddings
        "gpt_neox": lambda: t.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=3,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            **TOKENS,
        ),
        "gpt_neox_sequential": lambda: t.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=40,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=5,
            max_position_embeddings=64,
            use_parallel_residual=False,
            tie_word_embeddings=True,
            hidden_act="gelu_new",
            **TOKENS,
        ),
        # 5 heads of 8 over one KV head, RoPE on a quarter of each; QK LayerNorm and tied embeddings
        "phi": lambda: t.PhiConfig(
            vocab_size=VOCAB,
            hidden_size=40,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
            **TOKENS,
        ),
        "phi_qk_layernorm": lambda: t.PhiConfig(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=3,
            max_position_embeddings=64,
            qk_layernorm=True,
            tie_word_embeddings=True,
            **TOKENS,
        ),
        # 3 heads of 12, adjacent pairs of the first 6 dims rotated, an MLP of 26 (not 4 x 36)
        "gptj": lambda: t.GPTJConfig(
            vocab_size=VOCAB, n_embd=36, n_layer=3, n_head=3, rotary_dim=6, n_inner=26, n_positions=64, **TOKENS
        ),
        # CodeGen's fused qkv in 4 groups: 4 heads of 10, all of each head rotated, tied embeddings
        "codegen": lambda: t.CodeGenConfig(
            vocab_size=VOCAB,
            n_embd=40,
            n_layer=2,
            n_head=4,
            rotary_dim=10,
            n_inner=22,
            n_positions=64,
            n_ctx=64,
            tie_word_embeddings=True,
            **TOKENS,
        ),
        # StableLM 2 1.6B's shape: q/k/v biases, 6 heads over 2 KV heads of 8, a quarter rotary
        "stablelm": lambda: t.StableLmConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_qkv_bias=True,
            **TOKENS,
        ),
        # StableLM 2 12B's: the parallel residual and a LayerNorm per head on queries and keys
        "stablelm_12b": lambda: t.StableLmConfig(
            vocab_size=VOCAB,
            hidden_size=40,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            max_position_embeddings=64,
            use_parallel_residual=True,
            qk_layernorm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
            **TOKENS,
        ),
        # 6 heads over 2 KV heads of 8 (head_dim != hidden / heads), a window of 5, biases
        "starcoder2": lambda: t.Starcoder2Config(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=5,
            rope_theta=500.0,
            **TOKENS,
        ),
        # no biases, no window, untied
        "starcoder2_plain": lambda: t.Starcoder2Config(
            vocab_size=VOCAB,
            hidden_size=36,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            max_position_embeddings=64,
            use_bias=False,
            tie_word_embeddings=False,
            **TOKENS,
        ),
        # Falcon 7B's shape: multi-query, one LayerNorm for attention and MLP side by side
        "falcon": lambda: t.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=40,
            num_hidden_layers=3,
            num_attention_heads=5,
            ffn_hidden_size=26,
            max_position_embeddings=64,
            rope_theta=500.0,
            **TOKENS,
        ),
        # Falcon 40B's: the new decoder architecture, 6 heads in 2 KV groups, two LayerNorms; biases, untied
        "falcon_40b": lambda: t.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_kv_heads=2,
            new_decoder_architecture=True,
            ffn_hidden_size=22,
            max_position_embeddings=64,
            bias=True,
            tie_word_embeddings=False,
            **TOKENS,
        ),
        # the older per-head layout (no multi-query), layers in sequence
        "falcon_sequential": lambda: t.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=3,
            multi_query=False,
            parallel_attn=False,
            ffn_hidden_size=22,
            max_position_embeddings=64,
            **TOKENS,
        ),
        # Command R+'s shape: 6 heads over 2 KV heads, a LayerNorm per head on queries and keys,
        # q/k/v/o biases, logits times 0.5
        "cohere": lambda: t.CohereConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_qk_norm=True,
            attention_bias=True,
            logit_scale=0.5,
            rope_theta=500.0,
            **TOKENS,
        ),
        # Command R7B's: three sliding (RoPE) layers of window 5, then a global one without RoPE
        "cohere2": lambda: t.Cohere2Config(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=22,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=5,
            logit_scale=0.25,
            tie_word_embeddings=False,
            **TOKENS,
        ),
        # 6 heads over 2 KV heads of 12 (not hidden / heads), half of each rotary; biases everywhere
        "nemotron": lambda: t.NemotronConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=26,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500.0,
            **TOKENS,
        ),
    }[name]()


CASES = [
    "gpt_neox",
    "gpt_neox_sequential",
    "phi",
    "phi_qk_layernorm",
    "gptj",
    "codegen",
    "stablelm",
    "stablelm_12b",
    "starcoder2",
    "starcoder2_plain",
    "falcon",
    "falcon_40b",
    "falcon_sequential",
    "cohere",
    "cohere2",
    "nemotron",
]


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, attn_implementation="eager")
    return converted_case(name, model, root, stand_in_tokenizer=True)


DECODED_ALIKE = {  # a second case of a type whose decoding path another case has taken (CI time)
    "gpt_neox_sequential": "stablelm",  # a sequential residual of LayerNorms
    "phi_qk_layernorm": "phi",
    "starcoder2_plain": "starcoder2",
    "falcon_sequential": "falcon",  # the same model code; its tensor layout is the logits test's
}


def test_greedy_generation_of_16_tokens_is_identical(case):
    """test_hf_parity's: greedy tokens and the KV-cache sampler's equal transformers' generate."""
    if case.family in DECODED_ALIKE:
        pytest.skip(f"decodes as the {DECODED_ALIKE[case.family]} case does")
    test_hf_parity.test_greedy_generation_of_16_tokens_is_identical(case)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path, monkeypatch):
    """test_hf_parity's check; export writes pad_token_id (null when unknown) also for CodeGen,
    whose config class does not declare it (transformers' generate reads it all the same)."""
    monkeypatch.setattr(test_hf_parity, "OLDER_KEYS", test_hf_parity.OLDER_KEYS | {"pad_token_id"})
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    if case.family.startswith("gpt_neox"):
        assert cfg.norm.kind == "layer" and cfg.norm.bias and cfg.mlp.bias and not cfg.mlp.gated
        assert cfg.block.residual == ("parallel" if case.family == "gpt_neox" else "sequential")
        assert cfg.rope.rotary_dim == (6 if case.family == "gpt_neox" else 2)  # 0.5 of 12, 0.25 of 8
        assert case.params["blocks"]["attn"]["bq_nh"].shape == (
            cfg.num_layers,
            cfg.attention.num_heads,
            cfg.attention.head_dim,
        )
    elif case.family in ("gptj", "codegen"):
        assert cfg.rope.interleave and cfg.block.residual == "parallel_shared_norm" and cfg.head.bias
        gptj = case.family == "gptj"
        assert (cfg.rope.rotary_dim, cfg.mlp.dim) == ((6, 26) if gptj else (10, 22))
    elif case.family.startswith("stablelm"):
        twelve = case.family == "stablelm_12b"
        assert cfg.attention.qk_norm == cfg.attention.qk_norm_per_head == twelve and cfg.attention.qkv_bias != twelve
        assert cfg.block.residual == ("parallel_shared_norm" if twelve else "sequential") and cfg.rope.rotary_dim == 2
        if twelve:  # each head's scale its own (HF: a tensor per head)
            assert case.params["blocks"]["attn"]["q_norm"]["scale"].shape == (2, 5, 8)
            assert case.params["blocks"]["attn"]["k_norm"]["scale"].shape == (2, 1, 8)
    elif case.family.startswith("starcoder2"):
        windowed = case.family == "starcoder2"
        assert cfg.mlp.bias == cfg.attention.qkv_bias == cfg.attention.out_bias == windowed and cfg.norm.bias
        assert cfg.attention.sliding_window == (5 if windowed else None) and cfg.tie_embeddings == windowed
    elif case.family.startswith("falcon"):
        residual, kv = {"falcon": ("parallel_shared_norm", 1), "falcon_40b": ("parallel", 2)}.get(
            case.family, ("sequential", 3)
        )
        assert (cfg.block.residual, cfg.attention.num_kv_heads, cfg.mlp.bias) == (
            residual,
            kv,
            case.family == "falcon_40b",
        )
    elif case.family == "cohere":
        assert (
            cfg.attention.qk_norm_per_head and cfg.rope.interleave and cfg.head.multiplier == 0.5 and not cfg.norm.bias
        )
        assert case.params["blocks"]["attn"]["k_norm"]["scale"].shape == (3, 2, 8) and cfg.attention.qkv_bias
    elif case.family == "cohere2":
        assert cfg.attention.pattern == ["local"] * 3 + ["global"] and cfg.rope.pattern == [True] * 3 + [False]
        assert cfg.head.multiplier == 0.25 and cfg.block.residual == "parallel_shared_norm"
    elif case.family == "nemotron":
        assert cfg.norm.zero_centered and cfg.norm.bias and cfg.mlp.activation == "relu2" and not cfg.mlp.gated
        assert cfg.rope.rotary_dim == 6 and cfg.attention.head_dim == 12 and cfg.mlp.bias and cfg.attention.qkv_bias
    elif case.family.startswith("phi"):
        assert (
            cfg.block.residual == "parallel_shared_norm" and cfg.head.bias and "mlp_norm" not in case.params["blocks"]
        )
        assert cfg.attention.qk_norm == (
            case.family == "phi_qk_layernorm"
        ) and cfg.attention.num_kv_heads == cfg.attention.num_heads // (5 if case.family == "phi" else 1)


def test_a_qkv_projection_grouped_per_head_splits_and_fuses_back():
    """fused_groups: GPT-NeoX's rows (heads, 3, head_dim) are each head's q, k, v in turn."""
    heads, h, d = 3, 2, 5
    spec = TensorSpec(("q",), "qkv.weight", 1, fused_with=(("k",), ("v",)), fused_groups=heads)
    hf = np.arange(heads * 3 * h * d).reshape(heads * 3 * h, d)
    q, k, v = unfuse(spec, hf, [(d, heads, h)] * 3)
    by_head = hf.reshape(heads, 3, h, d)
    np.testing.assert_array_equal(q, by_head[:, 0].reshape(-1, d))
    np.testing.assert_array_equal(v, by_head[:, 2].reshape(-1, d))
    np.testing.assert_array_equal(fuse(spec, [q, k, v]), hf)
    # Falcon's per-KV-group layout: 2 groups of (2 queries, a key, a value)
    spec = TensorSpec(("q",), "qkv.weight", 1, fused_with=(("k",), ("v",)), fused_groups=2)
    hf = np.arange(2 * 4 * h * d).reshape(-1, d)
    q, k, v = unfuse(spec, hf, [(d, 4, h), (d, 2, h), (d, 2, h)])
    groups = hf.reshape(2, 4, h, d)
    np.testing.assert_array_equal(q, groups[:, :2].reshape(-1, d))
    np.testing.assert_array_equal(k, groups[:, 2].reshape(-1, d))
    np.testing.assert_array_equal(fuse(spec, [q, k, v]), hf)


ARCHITECTURES = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
    "gptj": "GPTJForCausalLM",
    "codegen": "CodeGenForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "falcon": "FalconForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "nemotron": "NemotronForCausalLM",
}


def peft_all_linear(model) -> set[str]:
    """The module names PEFT's all-linear expands to on `model` (it may save full paths)."""
    expanded = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear")).peft_config["default"]
    return {name.rsplit(".", 1)[-1] for name in expanded.target_modules}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_lora_all_linear_adapts_the_projections_peft_finds(name):
    """Every Linear of the transformers model but the LM head, by its own name: fused ones
    (GPT-NeoX's query_key_value, CodeGen's qkv_proj) as one module, as PEFT adapts them."""
    cfg, _ = model_config_from_hf({**hf_config(name).to_dict(), "architectures": [ARCHITECTURES[name]]})
    ours = LoraConfig(target_modules="all-linear").targets(cfg)
    assert set(ours) == peft_all_linear(random_causal_lm(hf_config(name), 0)) and len(ours) == len(set(ours))


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    def hf(name: str, **keys) -> dict:
        return {**hf_config(name).to_dict(), "architectures": [ARCHITECTURES[name]], **keys}

    for config, message in (
        (hf("falcon", alibi=True), r"alibi=true \(Falcon-RW's ALiBi positions\) is not supported yet"),
        (hf("gptj", rotary_dim=None), r"rotary_dim must be set"),
        (hf("phi", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.2}), r"rotates 1 of 8 dims"),
        (hf("nemotron", hidden_act="swish"), r"hidden_act 'swish' is not supported"),
        (hf("starcoder2", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), r"RoPE type 'dynamic'"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            model_config_from_hf(config)
        assert "\n" not in str(refused.value) and str(refused.value).startswith("config.json (")


@pytest.mark.parametrize(
    ("name", "targets"), [("phi", ["q_proj", "k_proj", "v_proj"]), ("cohere", "all-linear")], ids=["phi", "cohere"]
)
def test_a_peft_adapter_gives_peft_logits(name, targets, tmp_path):
    """A PEFT adapter on what LoRA adapts (Phi's biased q/k/v under its shared LayerNorm;
    every projection of Cohere's, per-head QK norms and logit scale included) reads into the
    engine with PEFT's logits."""
    base = random_causal_lm(hf_config(name), 0, attn_implementation="eager")
    base.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    _, compute = stored_configs(tmp_path / "converted" / "checkpoint")
    model = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=5.0, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_" in key:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    lora = lora_config_from_peft(tmp_path / "adapter")
    shapes = split_adapter(abstract_model_params(cfg, compute, None, lora))[0]
    adapter = adapter_from_peft(tmp_path / "adapter", cfg, lora, shapes, scan_layers=compute.scan_layers)
    tokens, mask = test_hf_parity.batch()
    graphdef = graphdef_of(cfg, compute, lora)
    apply = jax.jit(lambda p, t, m: apply_model(graphdef, p, t, None, m))
    ours = np.asarray(apply(join(adapter, params), jnp.asarray(tokens), jnp.asarray(mask)))
    with torch.no_grad():
        ref = test_hf_parity.hf_logits(model.eval(), tokens, mask)
        with model.disable_adapter():
            base_ref = test_hf_parity.hf_logits(model, tokens, mask)
    valid = mask.astype(bool)
    assert float(np.abs(ours - ref)[valid].max()) <= 1e-4 and np.abs(ref - base_ref)[valid].max() > 1e-2


def test_lora_targets_are_the_family_s_module_names_and_others_are_refused():
    neox, _ = model_config_from_hf({**hf_config("gpt_neox").to_dict(), "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(
        ValueError, match=r"family 'gpt_neox' has no module o_proj to adapt; it can adapt: query_key_value"
    ):
        LoraConfig(target_modules=["o_proj"]).targets(neox)
    assert LoraConfig(target_modules=["query_key_value"]).weights(neox) == {
        "wq_dnh": "wq_dnh",  # one A (q's) for the fused module, a B for each part
        "wk_dkh": "wq_dnh",
        "wv_dkh": "wq_dnh",
    }
    # Llama's attention names, the MLP's otherwise
    starcoder2, _ = model_config_from_hf(
        {**hf_config("starcoder2").to_dict(), "architectures": ["Starcoder2ForCausalLM"]}
    )
    with pytest.raises(
        ValueError, match=r"has no module up_proj to adapt; it can adapt: q_proj, k_proj, v_proj, o_proj, c_fc, c_proj$"
    ):
        LoraConfig(target_modules=["up_proj"]).targets(starcoder2)


PUBLISHED = {  # the model cards' sizes (billions) and how closely ModelConfig.num_params meets them
    "pythia-1b": (1.01, 0.01),
    "gpt-neox-20b": (20.6, 0.01),
    "phi-2": (2.7, 0.04),
    "phi-1.5": (1.4, 0.02),
    "gpt-j-6b": (6.05, 0.01),
    "codegen-2b": (2.78, 0.01),
    "stablelm-2-1.6b": (1.64, 0.01),
    "stablelm-2-12b": (12.1, 0.01),
    "starcoder2-3b": (3.03, 0.01),
    "starcoder2-7b": (7.17, 0.01),
    "falcon-7b": (6.92, 0.01),
    "falcon-40b": (41.8, 0.01),
    "command-r": (35.0, 0.01),
    "command-r7b": (8.03, 0.01),  # "7B" without its 1.05B embedding
    "minitron-8b": (8.27, 0.01),
    "minitron-4b": (4.19, 0.01),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device), of the size its model card gives, and its config.json reads back as itself."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    billions, tolerance = PUBLISHED[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=tolerance)
