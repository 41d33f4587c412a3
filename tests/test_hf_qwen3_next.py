"""Hugging Face parity of the hybrid linear-attention families of issue 51: Qwen3-Next
(Qwen3NextForCausalLM: Gated DeltaNet layers with fused projections, gated attention with
partial RoPE, softmax experts with a sigmoid-gated shared expert, a dense layer among them),
Qwen3.5 (Qwen3_5ForCausalLM: split projections, gated MLP, tied embeddings) and Qwen3.5-MoE
(Qwen3_5MoeForCausalLM); and Qwen3.5 with multimodal RoPE sections other than the published
[11, 11, 10] (they change nothing for text, and are written back), Qwen3-Next and Qwen3.5-MoE
with a shared expert wider than the experts.

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the recurrent/KV-cache sampler
equal transformers', config.json as transformers writes it, export -> convert bitwise; and
here logits to 1e-4 with N(0, 0.2^2) weights (against transformers in float64) and to 1e-5
at transformers' initialisation (on 150 tokens, more than two of the chunked rule's 64-token
chunks, a row right-padded), export loading cleanly, a training step with transformers'
loss, LoRA where PEFT puts it, and Qwen3.5's multimodal checkpoints read for their text decoder.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.models.config import ComputeConfig, LoraConfig  # noqa: E402
from engine.models.params import abstract_model_params  # noqa: E402
from engine.train.checkpoint import load_params, read_meta, save_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    COMMON,
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_greedy_generation_of_16_tokens_is_identical,
)

# 5 layers: linear, linear, full, linear, linear (full_attention_interval 3); 2 key heads
# serving 4 value heads of odd widths; RoPE on half of each 8-wide attention head.
HYBRID = dict(
    **{**COMMON, "num_hidden_layers": 5},
    full_attention_interval=3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.5,
    rope_theta=500.0,
    bos_token_id=None,
    eos_token_id=None,
)
EXPERTS = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=14, shared_expert_intermediate_size=14)
WIDE_SHARED = {**EXPERTS, "shared_expert_intermediate_size": 22}
"""A shared expert of another width than the experts' (ModelConfig.moe.shared_dim)."""


def mrope(section: list[int]) -> dict:
    """HYBRID's RoPE with Qwen3.5's multimodal keys, as the published text_config has them."""
    return {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": HYBRID["rope_theta"],
            "partial_rotary_factor": HYBRID["partial_rotary_factor"],
            "mrope_section": section,
            "mrope_interleaved": True,
        }
    }


def hf_config(name: str):
    t = transformers
    no_mlp = {k: v for k, v in HYBRID.items() if k != "intermediate_size"}
    return {
        "qwen3_next": lambda: t.Qwen3NextConfig(**HYBRID, **WIDE_SHARED, norm_topk_prob=True, mlp_only_layers=[1]),
        "qwen3_5": lambda: t.Qwen3_5TextConfig(**HYBRID, tie_word_embeddings=True),
        "qwen3_5_moe": lambda: t.Qwen3_5MoeTextConfig(**no_mlp, **EXPERTS),
        # 2 rotary frequencies: a section of 4 (more than there are), and one of 2 split unlike the default
        "qwen3_5_mrope": lambda: t.Qwen3_5TextConfig(**HYBRID, **mrope([2, 1, 1])),
        "qwen3_5_moe_mrope": lambda: t.Qwen3_5MoeTextConfig(**no_mlp, **WIDE_SHARED, **mrope([1, 1, 0])),
    }[name]()


CASES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
MROPE_CASES = ["qwen3_5_mrope", "qwen3_5_moe_mrope"]
"""The layers of CASES' Qwen3.5 ones: these get the checks of the families' parity and export
(not again the initialisation-scale logits or the training step)."""
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""


def converted(model, root) -> tuple:
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return cfg, compute, params


def random_hf_model(name: str, seed: int = 0):
    model = random_causal_lm(hf_config(name), seed, **IMPLEMENTATIONS)
    with torch.no_grad():  # decay rates exp(A_log) of a few units, as transformers draws them
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(0.0, 1.5)
    return model


@pytest.fixture(scope="module", params=CASES + MROPE_CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_hf_model(name)
    cfg, compute, params = converted(model, root)
    return Case(name, model, root / "hf", root / "converted", cfg, compute, params)


SCALED_SEED = {"qwen3_next": 5}
"""Qwen3-Next's draws put some expert choices near their margin: at seeds 0 to 5 transformers'
own float32 run ends 1.6e-4, 3.7e-4, 4.0e-4, 1.4e-3, 8.7e-5 and 1.1e-5 from its float64 one
(ours, at seed 2, 5.2e-4 away)."""


@pytest.mark.parametrize("name", CASES + MROPE_CASES)
def test_converted_model_with_scaled_weights_matches_transformers(name, tmp_path):
    """Logits to 1e-4 with N(0, 0.2^2) weights and norm weights moved by as much (gates, decays
    and routing all far from their initial values; a right- and a left-padded row among
    three), against transformers run in float64: at this scale transformers' own float32 run
    is itself about 1e-4 away from it (the chunked delta rule's triangular solve rounds), so
    the float32 reference would measure its rounding as much as ours."""
    torch.manual_seed(SCALED_SEED.get(name, 0))
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), **IMPLEMENTATIONS).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if not key.endswith("A_log"):  # decay rates as transformers draws them, up to 16
                p.add_(0.2 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.2)
    cfg, compute, params = converted(model, tmp_path)
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(cfg, compute, params, tokens, mask)
    ref32 = hf_logits(model, tokens, mask)
    ref = np.zeros(ours.shape)  # float64, each row's tokens alone at their positions (a padded
    model = model.double()  # float64 row turns its masked softmax rows into NaN, which spread)
    with torch.no_grad():
        for row, keep in enumerate(valid):
            at = torch.tensor(np.nonzero(keep)[0][None])
            ref[row, keep] = model(torch.tensor(tokens[row, keep][None]), position_ids=at).logits[0].numpy()
    delta, theirs = (float(np.abs(x - ref)[valid].max()) for x in (ours, ref32))
    print(
        f"\n{name}: max |delta logit| vs float64 {delta:.2e} (transformers float32: {theirs:.2e}; logits up to "
        f"{np.abs(ref[valid]).max():.1f})"
    )
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


@pytest.mark.parametrize("name", CASES)
def test_converted_model_at_initialisation_scale_matches_transformers_to_1e5(name, tmp_path):
    """transformers' own initialisation, 150 tokens (two full chunks and a part), a row right-padded."""
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), **IMPLEMENTATIONS).float().eval()
    cfg, compute, params = converted(model, tmp_path)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 150))
    mask = np.ones_like(tokens)
    mask[1, 131:] = 0
    valid = mask.astype(bool)
    ours = engine_logits(cfg, compute, params, tokens, mask)
    ref = hf_logits(model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{name} at init scale: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.3f})")
    assert delta <= 1e-5 and np.abs(ref[valid]).max() > 1e-3


def test_the_family_reads_what_the_config_says(case):
    cfg, layers = case.cfg, case.cfg.layer_pattern()
    assert cfg.rope.mrope_section == {"qwen3_5_mrope": [2, 1, 1], "qwen3_5_moe_mrope": [1, 1, 0]}.get(case.family)
    assert cfg.moe.shared_dim == (22 if case.family in ("qwen3_next", "qwen3_5_moe_mrope") else None)
    assert [x.mixer for x in layers] == ["gated_delta", "gated_delta", "attention", "gated_delta", "gated_delta"]
    assert cfg.rope.rotary_dim == 4 and cfg.attention.output_gate and cfg.norm.zero_centered and cfg.attention.qk_norm
    assert cfg.gated_delta.fused_projections == (cfg.family == "qwen3_next")
    assert case.params["blocks"]["attn"]["wq_dnh"].shape[-1] == 16  # each head's query and gate
    linear = case.params["gated_delta_blocks"]["attn"]
    assert linear["conv_c1k"].shape[1:] == (2 * 2 * 6 + 4 * 5, 1, 4) and linear["a_log_v"].shape[1:] == (4,)
    if cfg.family == "qwen3_next":  # layer 1 is dense (mlp_only_layers): a stack of its own
        assert [name for name, _ in cfg.layer_stacks()] == ["gated_delta_blocks", "gated_delta_dense_blocks", "blocks"]
        assert cfg.moe.num_shared_experts == 1 and cfg.moe.shared_gate and cfg.moe.router_renormalize
    elif cfg.family == "qwen3_5":
        assert cfg.tie_embeddings == (case.family == "qwen3_5") and not cfg.is_moe
    else:
        assert cfg.is_moe and cfg.moe.router_renormalize and cfg.moe.shared_gate


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_exported_config_json_is_what_transformers_writes(case, tmp_path, monkeypatch):
    """test_hf_parity's check; the export also writes the published top-level partial_rotary_factor."""
    monkeypatch.setattr(test_hf_parity, "OLDER_KEYS", test_hf_parity.OLDER_KEYS | {"partial_rotary_factor"})
    test_hf_parity.test_exported_config_json_is_what_transformers_writes(case, tmp_path)


def test_a_training_step_has_transformers_loss_and_moves_every_parameter(case):
    """The training loss (its router losses apart) is transformers' loss on the same rows;
    every parameter gets a finite, non-zero gradient, and one SGD step lowers the loss."""
    if case.family in MROPE_CASES:
        pytest.skip("the layers of the qwen3_5 and qwen3_5_moe cases")
    test_hf_parity.assert_training_step_matches(case, 1e-3)


def test_lora_targets_the_attention_layers_as_peft_names_them():
    """PEFT's q_proj, k_proj, v_proj, o_proj match only the full-attention layers' self_attn
    (the linear layers' projections have other names), its gate/up/down_proj every dense MLP:
    the adapters sit exactly there, each in the shape of PEFT's (q_proj's B covers the query
    and its gate, as HF's q_proj does). The linear layers' projections are refused by name."""
    cfg, _ = model_config_from_hf({**hf_config("qwen3_5").to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
    lora = LoraConfig(target_modules="all-linear", rank=3)
    assert lora.targets(cfg) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    shapes = abstract_model_params(cfg, ComputeConfig(), None, lora)
    attention, linear = shapes["blocks"]["attn"], shapes["gated_delta_blocks"]["attn"]
    assert attention["wq_dnh_lora_b"].shape == (1, 3, 6, 16) and attention["wo_nhd_lora_a"].shape == (1, 6, 8, 3)
    assert not [key for key in linear if "lora" in key]
    assert "w_gate_df_lora_a" in shapes["gated_delta_blocks"]["mlp"] and "w_down_fd_lora_b" in shapes["blocks"]["mlp"]
    with pytest.raises(ValueError, match=r"^family 'qwen3_5' stores in_proj_qkv in a layout LoRA does not adapt"):
        LoraConfig(target_modules=["in_proj_qkv"]).targets(cfg)


def test_the_multimodal_checkpoint_converts_to_the_text_model(case, tmp_path):
    """Qwen3.5 is published as Qwen3_5(Moe)ForConditionalGeneration (vision tower, the same
    text decoder under model.language_model.): saved by transformers, it converts to exactly
    the text model's params, the vision tower skipped with a message."""
    if case.cfg.family == "qwen3_next":
        pytest.skip("Qwen3-Next is published text-only")
    moe = case.cfg.family == "qwen3_5_moe"
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=30, patch_size=4)
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    )
    text = case.hf_model.config.to_dict()
    multimodal = model_class(config_class(text_config=text, vision_config=vision))
    missing, unexpected = multimodal.model.language_model.load_state_dict(
        case.hf_model.model.state_dict(), strict=False
    )
    assert not missing and not unexpected
    with torch.no_grad():
        multimodal.lm_head.weight.copy_(case.hf_model.lm_head.weight)
    multimodal.save_pretrained(tmp_path / "mm")
    messages: list[str] = []
    summary = convert_hf(tmp_path / "mm", tmp_path / "converted", log=messages.append)
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg and summary["architecture"] == case.hf_model.config.architectures[0]
    flat_a, tree_a = jax.tree.flatten(case.params)
    flat_b, tree_b = jax.tree.flatten(params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("\n" + "\n".join(messages))
    assert sum("outside the text decoder" in m for m in messages) == 1
    # ... and the decoder goes back into that layout beside the source's vision tower, trained:
    # transformers loads it as the same class, the vision tower bitwise the source's, the text
    # decoder the trained params' (bitwise through a second conversion).
    trained = jax.tree.map(lambda x: np.asarray(x) + np.asarray(0.25, x.dtype), params)
    save_params(tmp_path / "trained" / "checkpoint", 1, trained, read_meta(tmp_path / "converted" / "checkpoint")[1])
    result = export_hf(tmp_path / "trained" / "checkpoint", tmp_path / "back", multimodal_source=tmp_path / "mm")
    assert result["architecture"] == model_class.__name__
    written = json.loads((tmp_path / "back" / "config.json").read_text())["text_config"]["rope_parameters"]
    assert written.get("mrope_section") == text["rope_parameters"].get("mrope_section")  # the vision positions'
    reloaded, info = model_class.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs, ours = multimodal.state_dict(), reloaded.state_dict()
    assert theirs.keys() == ours.keys()
    text = [name for name in theirs if name.startswith("model.language_model.") or name == "lm_head.weight"]
    assert text and len(text) < len(theirs)
    for name, tensor in theirs.items():
        if name not in text:
            assert torch.equal(tensor, ours[name]), name
        else:
            assert not torch.equal(tensor, ours[name]), name
    convert_hf(tmp_path / "back", tmp_path / "again")
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(load_params(tmp_path / "again" / "checkpoint")[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    base = {**hf_config("qwen3_next").to_dict(), "architectures": ["Qwen3NextForCausalLM"]}
    for changes, message in (
        ({"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act 'gelu_pytorch_tanh' is not supported \(qwen3_next: silu\)"),
        ({"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size 0 \(no shared expert\)"),
        ({"layer_types": ["linear_attention"] * 4 + ["sliding_attention"]}, r"layer type 'sliding_attention'"),
        ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ):
        with pytest.raises(ConfigError, match=message):
            model_config_from_hf({**base, **changes})
    # the published file's keys: partial_rotary_factor at the top level, no rope_parameters
    published = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    cfg, _ = model_config_from_hf({**published, "partial_rotary_factor": 0.25, "rope_theta": 1e7})
    assert (
        cfg.rope.rotary_dim == 2 and cfg.rope.theta == 1e7 and cfg.mixer_pattern == ["gated_delta"] * 3 + ["attention"]
    )
    # Qwen3.5's multimodal RoPE: the published section is transformers' default (not stored, not
    # written back, as transformers' text class writes none); a malformed one is refused.
    text = {**hf_config("qwen3_5_mrope").to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    published = {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [11, 11, 10]}}
    assert model_config_from_hf(published)[0].rope.mrope_section is None
    with pytest.raises(ConfigError, match=r"mrope_section \[2, 2\] must be three non-negative integers"):
        model_config_from_hf({**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 2]}})
