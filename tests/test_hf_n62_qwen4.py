"""Hugging Face parity of Qwen4-Exp's text decoder (Qwen4ExpForCausalLM, model_type
qwen4_exp_text, issue 62): Qwen3.5-MoE's Gated DeltaNet and gated-attention layers with the
attention made QSA sparse attention (a pooled-block indexer choosing each query's key blocks,
engine/models/qsa.py), the residual made gated hyper-connection streams (each sublayer
reading a gated mean of hc_count streams through its own norm, the model ending with one more
mix instead of a final norm, engine/models/gated_residual.py), and hashed n-gram embeddings
added to the streams of some linear layers (engine/models/ngram_embedding.py).

The case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): greedy tokens and the recurrent-state/KV-cache
sampler (n-gram states included) equal transformers' generate, config.json as transformers
writes it, export -> convert bitwise, the export loading cleanly (the hash's int64 buffers
written back) with the same logits; and here logits to 1e-4 with N(0, 0.3^2) weights on 20
tokens (a right- and a left-padded row, eos inside a row) whose queries see 2 of up to 9
complete blocks of 2, the selection changing transformers' logits; the parameter count equal
to transformers'; the published multimodal layout (n-gram tables in pieces) converting to the
same model; packed documents kept apart; prefill + decode equal to one pass; a training step
with transformers' loss; a sigmoid linear gate refused in one sentence.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
safetensors_torch = need("safetensors.torch")

from engine.config import ConfigError  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.models.params import apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    batch,
    converted_case,
    hf_logits,
    prefill_then_decode,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}
"""transformers' plain loops: its grouped-matmul experts need 16-byte strides (odd sizes have not)."""


def hf_config(**changes):
    """Layers linear, indexed, linear; 6 query heads over 2 KV heads 8 wide, RoPE on
    half of each at base 500; an indexer of 5 heads 10 wide keeping 2 blocks of 2 keys (budget
    4); 3 streams mixed through rank 7; 2 key heads serving 4 value heads (6 and 5 wide); 5
    experts 14 wide (2 per token) beside a shared expert 22 wide; n-gram embeddings in both
    linear layers, 12 wide (3 heads per 2- and 3-gram, tables of primes from 41 on, stored
    in 5 pieces), a 3-tap convolution, eos 3."""
    return transformers.Qwen4ExpTextConfig(
        **{
            "vocab_size": 37,
            "hidden_size": 30,
            "num_hidden_layers": 3,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "layer_types": ["linear_attention", "indexed_attention", "linear_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            "indexer_n_heads": 5,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 10,
            "indexer_budget": 4,
            "indexer_compress_ratio": 2,
            "hc_count": 3,
            "hc_lowrank": 7,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 6,
            "linear_value_head_dim": 5,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 14,
            "shared_expert_intermediate_size": 22,
            "ple_layer_ids": [1, 3],
            "ple_embed_dim": 12,
            "heads_per_ngram": 3,
            "ngram_vocab_size_base": 40,
            "make_ngram_vocab_size_divisible_by": 16,
            "split_ngram_parts": 5,
            "ple_conv_kernel_size": 3,
            "eos_token_id": 3,
            **changes,
        }
    )


def random_model(config):
    model = random_causal_lm(config, 0, **IMPLEMENTATIONS)
    with torch.no_grad():  # decay rates exp(A_log) of a few units, as transformers draws them
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(0.0, 1.5)
    return model


def jitted_logits(cfg, compute):
    """tests/test_hf_parity.py's engine_logits compiled whole (run op by op, it compiles each
    of the n-gram hash's many small integer steps on its own: 4x slower)."""
    return jax.jit(functools.partial(apply_model, graphdef_of(cfg, compute)))


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    model = random_model(hf_config())
    return converted_case("qwen4_exp_text", model, tmp_path_factory.mktemp("qwen4"), stand_in_tokenizer=True)


def test_converted_model_matches_transformers_logits(case):
    """Logits to 1e-4; transformers' own logits with every block selected (the indexer's
    budget lifted) are far from these, so the selection is what is matched."""
    tokens, mask = batch()
    tokens[0, [5, 11]] = 3  # eos: the n-grams after it start again
    valid = mask.astype(bool)
    ours = np.asarray(jitted_logits(case.cfg, case.compute)(case.params, tokens, None, mask))
    ref = hf_logits(case.hf_model, tokens, mask)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family}: max |delta logit| = {delta:.2e} (logits up to {np.abs(ref[valid]).max():.1f})")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    indexers = [layer.self_attn.indexer for layer in case.hf_model.model.layers if hasattr(layer, "self_attn")]
    try:
        for indexer in indexers:
            indexer.block_topk = indexer.token_budget = 64
        dense = hf_logits(case.hf_model, tokens, mask)
    finally:
        for indexer in indexers:
            indexer.token_budget, indexer.block_topk = 4, 2
    assert float(np.abs(dense - ref)[valid].max()) > 1e-2


def test_the_family_reads_what_the_config_says(case):
    specs = case.cfg.layer_specs()
    assert [s.stack for s in specs] == ["ngram_0_gated_delta_blocks", "qsa_blocks", "ngram_1_gated_delta_blocks"]
    ngrams = [specs[0].ngram_embedding, specs[2].ngram_embedding]
    assert [(e.primes, e.rows) for e in ngrams] == [((41, 43, 47, 53, 59, 61), 304), ((67, 71, 73, 79, 83, 89), 464)]
    indexer = specs[1].mixer.qsa_indexer
    assert (indexer.heads, indexer.head_dim, indexer.budget, indexer.block) == (5, 10, 4, 2)
    assert {(s.gated_residual.streams, s.gated_residual.rank, s.pre_norms) for s in specs} == {(3, 7, False)}
    assert specs[1].mixer.rope.rotary_dim == 4 and specs[1].mixer.output_gate
    assert case.cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    """No missing tensor: the hash's int64 buffers are written back, as transformers computes them."""
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_the_published_multimodal_checkpoint_converts_to_the_same_model(case, tmp_path):
    """Qwen4ExpForConditionalGeneration's layout: the text config under text_config, the
    decoder under model.language_model. (experts one tensor each, n-gram tables in pieces,
    the hash's constant buffers), beside a vision tower and an mtp layer (skipped)."""
    config = json.loads((case.hf_dir / "config.json").read_text())
    root = tmp_path / "mm"
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen4ExpForConditionalGeneration"],
                "model_type": "qwen4_exp",
                "text_config": config,
                "vision_config": {"model_type": "qwen4_exp_vision", "depth": 1},
                "tie_word_embeddings": False,
            }
        )
    )
    tensors = {
        (name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name): p.contiguous()
        for name, p in case.hf_model.state_dict().items()
    }
    experts = {}  # one tensor per expert, as the published files store them
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        gate_up, down = tensors.pop(name), tensors.pop(name.replace("gate_up_proj", "down_proj"))
        for j in range(gate_up.shape[0]):
            gate, up = gate_up[j].chunk(2, dim=0)
            base = name.replace("gate_up_proj", f"{j}.")
            experts |= {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
            experts[base + "down_proj.weight"] = down[j]
    for name in [n for n in tensors if n.endswith("ngram_embedding.weight")]:  # split_ngram_parts pieces
        for k, piece in enumerate(torch.chunk(tensors.pop(name), 5)):
            tensors[name.replace(".weight", f".shard_{k}.weight")] = piece.contiguous()
    extra = {"model.visual.patch_embed.proj.weight": torch.zeros(2, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    safetensors_torch.save_file({**tensors, **experts, **extra}, root / "model.safetensors")
    convert_hf(root, tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    assert cfg == case.cfg
    flat, tree = jax.tree.flatten(params)
    assert tree == jax.tree.structure(case.params)
    for a, b in zip(flat, jax.tree.leaves(case.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_sigmoid_linear_gate_is_refused_in_one_sentence():
    hf = {**hf_config().to_dict(), "output_gate_type": "sigmoid"}
    with pytest.raises(ConfigError, match="output_gate_type 'sigmoid' is not supported"):
        model_config_from_hf(hf)


def test_packed_and_padded_documents_give_each_the_logits_it_has_alone(case):
    """Two documents packed in a row (positions restarting, segments 1 and 2) and right padding:
    each gets its own logits, so QSA's blocks, the n-gram context and the n-gram convolution
    all start again at a document's start."""
    rng = np.random.default_rng(3)
    first, second = rng.integers(0, 37, 9), rng.integers(0, 37, 8)
    pad = np.zeros(20, int)
    tokens = np.stack([np.concatenate([first, second, pad[:3]]), np.concatenate([first, pad[:11]])])
    tokens = np.concatenate([tokens, np.concatenate([second, pad[:12]])[None]])  # packed, then each alone
    segments = np.array([[1] * 9 + [2] * 8 + [0] * 3, [1] * 9 + [0] * 11, [1] * 8 + [0] * 12])
    positions = np.array([[*range(9), *range(8), 0, 0, 0], [*range(9), *[0] * 11], [*range(8), *[0] * 12]])
    logits = np.asarray(jitted_logits(case.cfg, case.compute)(case.params, tokens, positions, segments))
    np.testing.assert_allclose(logits[0, :9], logits[1, :9], atol=1e-5)
    np.testing.assert_allclose(logits[0, 9:17], logits[2, :8], atol=1e-5)


def test_the_state_after_a_prompt_and_decoded_tokens_is_a_full_forwards(case):
    """Prefill 9 tokens (one row left-padded by 3), decode 6 one at a time: each linear
    layer's state (the n-gram tokens and convolution window beside the delta rule's) and the
    QSA layers' cached indexer keys (of the real tokens) equal those of one pass over all 15,
    as do the last logits."""
    logits, cache, full_logits, full = prefill_then_decode(case)
    stateful = [i for i, state in enumerate(cache.states) if state is not None]
    assert stateful == [0, 2]
    for a, b in zip(jax.tree.leaves(cache.states), jax.tree.leaves(full.states), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    valid = np.asarray(cache.valid_bs)
    assert [k.shape[-1] for k in cache.index_k] == [0, 10, 0]
    for a, b in zip(cache.index_k, full.index_k, strict=True):
        np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(b)[valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(full_logits[:, -1]), atol=1e-4)


def test_a_training_step_has_transformers_loss_and_moves_every_trained_parameter(case):
    """The training loss (router losses apart) is transformers' loss on the same rows; every
    parameter but the QSA indexers' (the selection has no gradient) gets a finite, non-zero
    gradient, and one SGD step lowers the loss."""
    test_hf_parity.assert_training_step_matches(case, 1e-3, no_gradient="indexer")
