"""Hugging Face parity of Dots3 Note's text decoder (Dots3NoteForCausalLM, model_type
dots3_note_text, issue 62): latent attention in two shapes (indexed layers with GLM-5's
lightning indexer, sliding-window layers with heads, head widths and latent ranks of their
own, each kind at its own RoPE base), every layer's shared rotary key RMS-normed before RoPE,
its latents scaled by sqrt(hidden / rank) and a sigmoid gate per head; DeepSeek-V3's grouped
sigmoid router beside two shared experts.

The case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the KV-cache sampler equal
transformers' generate, config.json as transformers writes it, export -> convert bitwise; and
here logits to 1e-4 with N(0, 0.3^2) weights (every expert used, a 5% change of the routers
moving some choices), each of the key norm, the head gate and the latent scaling changing
transformers' logits, the export loading cleanly, the published layout (a multimodal
checkpoint with the text config's older keys at the top level) converting to the same model,
and the preset's parameter count equal to transformers' (meta device).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
safetensors_torch = need("safetensors.torch")

from engine.config import ConfigError, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.params import abstract_model_params, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_fam_moe_2 import (  # noqa: E402
    IMPLEMENTATIONS,
    assert_routing_is_near_its_margins,
    randomise_routing_bias,
    router_weights,
)
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

LEGACY = dict(  # the released checkpoints' keys for the sliding layers, their RoPE base and the first dense layer
    swa_num_attention_heads=5,
    swa_num_key_value_heads=5,
    swa_q_lora_rank=9,
    swa_kv_lora_rank=11,
    swa_head_dim=10,
    swa_qk_nope_head_dim=8,
    swa_qk_rope_head_dim=2,
    swa_v_head_dim=5,
    rope_theta=500.0,
    swa_rope_theta=50.0,
    first_k_dense_replace=1,
)
"""The sliding layers: 5 heads, keys 8 + 2 rotary wide, values 5, latents 9 (query) and 11 (key-value)."""


def hf_config():
    """Layers sliding, indexed, sliding, indexed (the first dense); indexed layers of 6 heads,
    keys 6 + 4 rotary wide (config.json's head_dim 16: a quarter rotary), values 7, latents 14
    and 10, at RoPE base 500, an indexer of 7 heads 8 wide keeping 5 keys; sliding ones as
    LEGACY says over a window of 5 at base 50; 6 experts 13 wide in 3 groups (2 groups per
    token, 2 experts, scaled by 1.3), two shared experts 11 wide each."""
    return transformers.Dots3NoteTextConfig(
        vocab_size=37,
        hidden_size=30,
        intermediate_size=26,
        max_position_embeddings=64,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=14,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=7,
        head_dim=16,
        sliding_window=5,
        n_routed_experts=6,
        n_group=3,
        topk_group=2,
        num_experts_per_tok=2,
        routed_scaling_factor=1.3,
        moe_intermediate_size=13,
        shared_experts_intermediate_size=11,
        n_shared_experts=2,
        index_topk=5,
        index_head_dim=8,
        index_n_heads=7,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **LEGACY,
    )


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    model = random_causal_lm(hf_config(), 0, **IMPLEMENTATIONS)
    randomise_routing_bias(model, 0)
    return converted_case("dots3_note_text", model, tmp_path_factory.mktemp("dots3"))


def test_converted_model_matches_transformers_logits(case):
    """Logits to 1e-4, with weights large enough that routing matters: every expert is used,
    unevenly, and a 5% change of the routers moves some choices."""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    routers = router_weights(case.hf_model)
    assert_routing_is_near_its_margins(case.hf_model, tokens, mask, case.cfg.moe.num_experts, routers)


def test_the_family_reads_what_the_config_says(case):
    specs = case.cfg.layer_specs()
    assert [s.stack for s in specs] == ["local_dense_blocks", "blocks", "local_blocks", "blocks"]
    assert [(s.mixer.num_heads, s.mixer.head_dim, s.mixer.rope_head_dim, s.mixer.value_head_dim) for s in specs] == [
        (5, 10, 2, 5),
        (6, 10, 4, 7),
    ] * 2
    assert [(s.mixer.q_lora_rank, s.mixer.kv_lora_rank, s.mixer.window, s.mixer.rope.theta) for s in specs] == [
        (9, 11, 5, 50.0),
        (14, 10, None, 500.0),
    ] * 2
    assert [s.mixer.indexer is not None for s in specs] == [False, True] * 2 and specs[1].mixer.indexer.topk == 5
    assert {(s.mixer.head_gate, s.mixer.lora_scale, s.mixer.key_norm_eps, s.mixer.latent_norm_eps) for s in specs} == {
        (True, True, 1e-5, 1e-5)
    }
    moe = specs[1].ffn
    assert (moe.router_groups, moe.router_group_top, moe.router_scale, moe.shared_dim) == (3, 2, 1.3, 22)
    assert specs[0].ffn.kind == "mlp" and specs[0].ffn.dim == 26


def _open_gate(module) -> torch.nn.Linear:
    """A g_proj whose sigmoid is 1 for every input: no gate."""
    gate = torch.nn.Linear(module.hidden_size, module.num_heads)
    torch.nn.init.zeros_(gate.weight)
    torch.nn.init.constant_(gate.bias, 40.0)
    return gate


def test_the_key_norm_the_head_gate_and_the_latent_scaling_each_change_the_logits(case):
    """Each mechanism matters on this model: transformers' logits move without it."""
    tokens, mask = batch()
    valid = mask.astype(bool)
    ref = hf_logits(case.hf_model, tokens, mask)
    attentions = [m for m in case.hf_model.modules() if type(m).__name__ == "Dots3NoteTextAttention"]

    def moved(values) -> float:
        """The largest logit change with the attributes values(module) set on every attention."""
        saved = [(m, {k: getattr(m, k) for k in values(m)}) for m in attentions]
        try:
            for m in attentions:
                for key, value in values(m).items():
                    setattr(m, key, value)
            return float(np.abs(hf_logits(case.hf_model, tokens, mask) - ref)[valid].max())
        finally:
            for m, old in saved:
                for key, value in old.items():
                    setattr(m, key, value)

    changes = [
        moved(lambda m: {"k_rope_only_layernorm": torch.nn.Identity()}),
        moved(lambda m: {"g_proj": _open_gate(m)}),
        moved(lambda m: {"q_lora_scale": 1.0, "kv_lora_scale": 1.0}),
    ]
    print(f"\nlogit changes without the key norm, the head gate, the latent scaling: {changes}")
    assert min(changes) > 0.1, changes
    np.testing.assert_array_equal(hf_logits(case.hf_model, tokens, mask), ref)  # (restored)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_the_released_configs_older_keys_read_as_transformers_reads_them():
    """A config.json in the released checkpoints' keys (the layer kinds from use_sliding_window
    and use_dsa, the sliding layers' sizes and RoPE base from swa_*, the dense layers from
    first_k_dense_replace) reads as the same model as the one transformers normalises it to."""
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    shared += ("q_lora_rank", "kv_lora_rank")
    shared += ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_group")
    shared += ("topk_group", "num_experts_per_tok", "moe_intermediate_size", "index_topk", "index_n_heads")
    legacy = {
        **{key: value for key, value in hf_config().to_dict().items() if key in shared},
        "index_head_dim": 8,
        "moe_shared_expert_intermediate_size": 11,
        "n_shared_experts": 2,
        "num_hidden_layers": 6,
        "sliding_window_size": 5,
        "use_dsa": True,
        "use_sliding_window": True,
        **LEGACY,
        "model_type": "dots3_note_text",
        "architectures": ["Dots3NoteForCausalLM"],
    }
    ours, _ = model_config_from_hf(legacy)
    normalised = transformers.Dots3NoteTextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    theirs, _ = model_config_from_hf({**normalised.to_dict(), "architectures": ["Dots3NoteForCausalLM"]})
    assert ours == theirs
    assert ours.layer_is_local() == [False, False, True, True, True, False]
    assert (ours.attention.sliding_window, ours.rope.local_theta, ours.mla.local.kv_lora_rank) == (5, 50.0, 11)


def test_the_published_multimodal_layout_converts_to_the_text_model(case, tmp_path):
    """Dots3NoteForConditionalGeneration's checkpoint: the text config's keys at the top level
    beside the towers' configs, the decoder's tensors under its own names beside the vision and
    audio towers' and the multi-token-prediction layer's, which conversion skips."""
    source = tmp_path / "published"
    source.mkdir()
    text = json.loads((case.hf_dir / "config.json").read_text())
    published = {
        **text,
        "model_type": "dots3_note",
        "architectures": ["Dots3NoteForConditionalGeneration"],
        "vision_config": {"model_type": "dots3_note_vision_encoder", "hidden_size": 8},
        "audio_config": {"model_type": "dots3_note_audio_encoder", "hidden_size": 8},
        "image_token_id": 151660,
    }
    (source / "config.json").write_text(json.dumps(published))
    tensors = safetensors_torch.load_file(case.hf_dir / "model.safetensors")
    towers = ("vision_encoder.blocks.0.attn.qkv.weight", "audio_encoder.layers.0.fc1.weight", "audio_adapter.fc.weight")
    extra = [*towers, "model.mtp.0.eh_proj.weight", "model.layers.4.self_attn.q_a_proj.weight"]
    safetensors_torch.save_file({**tensors, **{name: torch.ones(2, 3) for name in extra}}, source / "model.safetensors")
    convert_hf(source, tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg
    leaves = jax.tree_util.tree_leaves_with_path
    for (path, a), (_, b) in zip(leaves(case.params), leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_what_the_family_does_not_run_is_refused_in_one_sentence(case):
    hf = json.loads((case.hf_dir / "config.json").read_text())
    types = hf["layer_types"]
    with pytest.raises(ConfigError, match=r"layer_types mixes indexed_attention and full_attention layers$"):
        model_config_from_hf({**hf, "layer_types": ["full_attention", *types[1:]]})
    with pytest.raises(ConfigError, match=r"the sliding_attention layers must all have the same sizes"):
        model_config_from_hf({**hf, "per_layer_config": {"0": {**hf["per_layer_config"]["0"], "v_head_dim": 3}}})
    with pytest.raises(ConfigError, match=r"per_layer_config\[0\] sets intermediate_size; only the latent"):
        model_config_from_hf({**hf, "per_layer_config": {**hf["per_layer_config"], "0": {"intermediate_size": 9}}})
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0}
    with pytest.raises(ConfigError, match=r"rope_parameters.sliding_attention: only the default RoPE"):
        model_config_from_hf({**hf, "rope_parameters": {**hf["rope_parameters"], "sliding_attention": linear}})
    with pytest.raises(ConfigError, match=r"n_shared_experts must be at least 1"):
        model_config_from_hf({**hf, "n_shared_experts": 0})


def test_the_preset_has_the_parameters_of_transformers_model(tmp_path):
    """dots3-note-prev (Dots3NoteTextConfig's defaults; no total is published) builds as the
    transformers model of the same trainable parameter count (meta device; the choosing biases
    are buffers there, not counted), and its config.json is what transformers writes for them
    (the sliding layers' per_layer_config entries only the sizes that differ)."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "dots3-note-prev"}, "dots3-note-prev")["model"])
    hf = model_config_to_hf(cfg)
    assert model_config_from_hf(hf)[0] == cfg
    transformers.Dots3NoteTextConfig().save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert model_config_from_hf({**written, "architectures": ["Dots3NoteForCausalLM"]})[0] == cfg
    about_the_file = {"transformers_version", "dtype", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert {k: v for k, v in written.items() if hf.get(k) != v}.keys() <= about_the_file
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == cfg.num_params() == 279_551_718_016


def test_a_training_step_with_the_indexer_loss_takes_the_indexed_layers_kl_and_every_routers_stats():
    """The indexer's KL of the indexed layers joins the loss beside the routers' statistics of
    every expert layer (the sliding layers have no indexer), and every weight has a gradient
    (traced, not compiled: the step's structure)."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "tiny-dots3-note-text"}, "tiny")["model"])
    compute = ComputeConfig(indexer_loss="sparse")
    params = abstract_model_params(cfg, compute, None)
    data = {
        "tokens": np.zeros((2, 12), np.int32),
        "positions": np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12)),
        "segment_ids": np.ones((2, 12), np.int32),
        "targets": np.zeros((2, 12), np.int32),
        "loss_mask": np.ones((2, 12), np.float32),
    }
    step = jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True)
    (_, aux), grads = jax.eval_shape(step, params, data, 24.0)
    assert {"indexer_loss", "moe_balance_loss", "moe_router_z_loss"} <= set(aux)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
