"""Hugging Face parity of Gemma 3n's text decoder (Gemma3nForCausalLM, issue 62): AltUp's
streams (altup.py), LAuReL beside the attention (laurel.py), the first layers' Gaussian top-k
on the MLP gate (MLPSpec.gate_sparsity), per-layer embeddings from a table of fewer rows than
the vocabulary, KV sharing over the last layers, sliding and global layers.

The tiny model has odd sizes everywhere: 3 streams with the active one not the first, 6 heads
of 10 over 2 KV heads on a width of 36, LAuReL of rank 5, per-layer inputs of 7 from 31 rows
(tokens 31..36 read row 0), layers sliding, sliding, global twice, the last two attending with
the keys and values of layers 3 (sliding) and 2 (global), a window of 4, gate sparsity 0.9 and
0.6 in the first two layers. The case gets the checks tests/test_hf_parity.py makes of every
family (greedy tokens, by full recomputation and by the KV-cache sampler, equal transformers'
generate; config.json as transformers writes it; export -> convert bitwise), and here logits to
1e-4, the export loading cleanly and the multimodal checkpoint's decoder. The published sizes'
presets (gemma3n-e2b, gemma3n-e4b) are counted against transformers' model by
tests/test_hf_convert.py's every-preset check.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

VOCAB, LAYERS = 37, 6
SMALL = dict(
    vocab_size=VOCAB,
    vocab_size_per_layer_input=31,
    hidden_size=36,
    intermediate_size=22,
    num_hidden_layers=LAYERS,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=10,
    hidden_size_per_layer_input=7,
    laurel_rank=5,
    altup_num_inputs=3,
    altup_active_idx=1,
    num_kv_shared_layers=2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    sliding_window=4,
    activation_sparsity_pattern=[0.9, 0.6] + [0.0] * (LAYERS - 2),
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
    final_logit_softcapping=20.0,
    max_position_embeddings=64,
)


def hf_config():
    return transformers.Gemma3nTextConfig(**SMALL)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("gemma3n")
    model = random_causal_lm(hf_config(), 0, attn_implementation="eager")
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    return Case("gemma3n", model, root / "hf", root / "converted", cfg, compute, params)


def test_converted_model_matches_transformers_logits(case):
    tokens, mask = batch(VOCAB)
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\ngemma3n: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_family_reads_what_the_config_says(case):
    cfg, specs = case.cfg, case.cfg.layer_specs()
    assert [s.altup.streams for s in specs] == [3] * LAYERS and specs[0].altup.active == 1
    assert [s.ffn.gate_sparsity for s in specs] == [0.9, 0.6, 0.0, 0.0, 0.0, 0.0]
    assert [s.kv_sharing for s in specs] == [None, None, "store", "store", "reuse", "reuse"]
    assert specs[0].laurel.rank == 5 and cfg.embedding.per_layer_vocab_size == 31
    assert case.params["per_layer_embed_vx"].shape == (31, LAYERS * 7)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", attn_implementation="eager")


def test_the_multimodal_checkpoints_decoder_converts_to_the_same_params(case, tmp_path):
    """A Gemma3nForConditionalGeneration checkpoint as Google publishes it: the decoder under
    model.language_model., towers beside it (skipped), and the KV-sharing layers' k/v
    projections and k norm, which transformers never runs (skipped too)."""
    weights = load_file(case.hf_dir / "model.safetensors")
    stored = {"model.language_model." + k[len("model.") :]: v for k, v in weights.items() if k.startswith("model.")}
    stored["model.vision_tower.stand_in.weight"] = np.ones((3, 2), np.float32)
    stored["model.audio_tower.stand_in.weight"] = np.ones((2,), np.float32)
    for i in (4, 5):  # what the published files keep in the sharing layers
        prefix = f"model.language_model.layers.{i}.self_attn."
        stored[prefix + "k_proj.weight"] = np.ones((20, 36), np.float32)
        stored[prefix + "v_proj.weight"] = np.ones((20, 36), np.float32)
        stored[prefix + "k_norm.weight"] = np.ones((10,), np.float32)
    (tmp_path / "mm").mkdir()
    save_file(stored, tmp_path / "mm" / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((case.hf_dir / "config.json").read_text())
    config = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n", "text_config": text}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))
    convert_hf(tmp_path / "mm", tmp_path / "out")
    cfg, params, _ = load_params(tmp_path / "out" / "checkpoint")
    assert cfg == case.cfg
    flat_a = {str(k): v for k, v in nnx.traversals.flatten_mapping(case.params).items()}
    flat_b = {str(k): v for k, v in nnx.traversals.flatten_mapping(params).items()}
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_a[key]), np.asarray(flat_b[key]))
