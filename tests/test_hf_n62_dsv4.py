"""Hugging Face parity of DeepSeek-V4 (DeepseekV4ForCausalLM, issue 62): sliding-window
attention beside CSA's and HCA's compressed entries (compressed_attention.py), the lightning
indexer's top-k over CSA's entries, n residual streams (hyper_connection.py), hash-routed
first layers (hash_routing.py) and sqrt(softplus) router scores with clamped SwiGLU experts.

The tiny model has odd sizes everywhere: 3 streams, 6 heads of 16 in 2 output groups, windows
of 3 (CSA) and 5 (HCA) positions, an indexer keeping 2 of them, a sliding window of 5, and
layers HCA (hash-routed), CSA, sliding. Each case gets the checks tests/test_hf_parity.py
makes of every family (greedy tokens and the KV-cache sampler equal transformers' generate,
config.json as transformers writes it, export -> convert bitwise); and here logits to 1e-4,
the export loading cleanly, the preset's parameter count, and a prompt's cache plus decoded
tokens equal to one forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_to_hf  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.kv_cache import KVCache  # noqa: E402
from engine.models.params import apply_model, graphdef_of, param_shardings  # noqa: E402
from engine.parallel.config import MeshConfig  # noqa: E402
from engine.parallel.mesh import make_mesh  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    Case,
    batch,
    engine_logits,
    hf_logits,
    random_causal_lm,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

VOCAB = 37
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    moe_intermediate_size=14,
    num_hidden_layers=3,
    num_attention_heads=6,
    head_dim=16,
    q_lora_rank=10,
    num_experts_per_tok=2,
    n_routed_experts=5,
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
    sliding_window=5,
    o_groups=2,
    o_lora_rank=7,
    index_n_heads=3,
    index_head_dim=10,
    index_topk=2,
    partial_rotary_factor=0.5,
    hc_mult=3,
    hc_sinkhorn_iters=3,
    swiglu_limit=1.5,
    rope_theta=500.0,
    compress_rope_theta=2000.0,
    max_position_embeddings=64,
    num_nextn_predict_layers=0,  # what transformers builds and saves (no multi-token-prediction module)
    bos_token_id=None,
    eos_token_id=None,
)
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}


def hf_config():
    return transformers.DeepseekV4Config(**SMALL)


def random_hf_model(seed: int = 0):
    """random_causal_lm's model with its buffers drawn too: the hash table (distinct experts
    per token) and the routers' choosing biases."""
    model = random_causal_lm(hf_config(), seed, **IMPLEMENTATIONS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(SMALL["n_routed_experts"], generator=generator)[:2] for _ in range(VOCAB)]
                buffer.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("deepseek_v4")
    model = random_hf_model()
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    compute = compute.model_copy(update={"indexer_ties": "torch_cpu"})
    return Case("deepseek_v4", model, root / "hf", root / "converted", cfg, compute, params)


def test_converted_model_matches_transformers_logits(case):
    """Full, right-padded, left-padded and reversed rows. The left-padded one counts positions
    from its first token, and transformers reads it without its padding: transformers'
    compressors pool a padded row's windows by slot, padding included, where the engine keeps
    padding out of every entry (test_packed_and_padded_documents_...)."""
    tokens, mask = batch(VOCAB)
    tokens = np.concatenate([tokens, tokens[:1, ::-1]], axis=0)  # and a row read backwards
    mask = np.concatenate([mask, np.ones_like(mask[:1])], axis=0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    graphdef = graphdef_of(case.cfg, case.compute)
    ours = np.asarray(apply_model(graphdef, case.params, *map(jnp.asarray, (tokens, positions, mask))))
    ref = hf_logits(case.hf_model, tokens, mask)
    pads = int((mask[2] == 0).sum())
    ref[2, pads:] = hf_logits(case.hf_model, tokens[2:3, pads:], mask[2:3, pads:])[0]
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\ndeepseek_v4: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


def test_the_family_reads_what_the_config_says(case):
    cfg = case.cfg
    assert [name for name, _ in cfg.layer_stacks()] == [
        "heavily_compressed_attention_hash_blocks",
        "compressed_sparse_attention_blocks",
        "sliding_attention_blocks",
    ]
    specs = cfg.layer_specs()
    assert [s.mixer.compress_ratio for s in specs] == [5, 3, 0] and specs[0].ffn.hash_vocab == VOCAB
    assert specs[0].hyper.streams == 3 and cfg.moe.router_score == "sqrtsoftplus"
    hashed = np.asarray(case.params["heavily_compressed_attention_hash_blocks"]["mlp"]["hash_experts_vk"][0])
    np.testing.assert_array_equal(hashed, case.hf_model.model.layers[0].mlp.gate.tid2eid.numpy())


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_export_then_convert_is_bitwise_identical(case, tmp_path):
    """test_hf_parity's check, against the compute settings conversion stored (the case's
    take transformers' CPU top-k ties)."""
    stored = stored_configs(case.out_dir / "checkpoint")[1]
    test_hf_parity.test_export_then_convert_is_bitwise_identical(dataclasses.replace(case, compute=stored), tmp_path)


def test_the_flash_preset_has_the_parameters_of_transformers_model():
    """configs/models/deepseek-v4-flash.yaml, built by transformers on the meta device: the
    same count (284B; the hash tables and choosing biases are buffers there, not counted)."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "deepseek-v4-flash"}, "preset")["model"])
    hf_config = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    assert hf_config.to_dict()["layer_types"] == transformers.DeepseekV4Config().layer_types
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == 284_325_869_015


def test_a_prompts_cache_and_decoded_tokens_give_the_full_forwards_logits(case):
    """The training form (blocks of the window, every window pooled at once) against the
    decoding one (the cache's keys and the compressor's projections, pooled again each step):
    a prompt of 8 then 7 tokens one at a time, past two CSA and HCA windows and the sliding one.
    The indexer's ties the earliest entries' (torch_cpu: torch's order over the row as long as
    what each call has seen, which transformers' own full and decoding runs differ by)."""
    compute = case.compute.model_copy(update={"indexer_ties": "first"})
    model = nnx.merge(graphdef_of(case.cfg, compute), case.params)
    tokens = np.random.default_rng(7).integers(0, VOCAB, (1, 15)).astype(np.int32)
    full = np.asarray(model(jnp.asarray(tokens)))
    cache = KVCache.init(case.cfg, compute, 1, 16)
    step = nnx.jit(lambda m, x, p, c: m(x, p, jnp.ones_like(x), cache=c))
    logits, cache = step(model, jnp.asarray(tokens[:, :8]), jnp.arange(8)[None], cache)
    pieces = [np.asarray(logits)]
    for i in range(8, 15):
        logits, cache = step(model, jnp.asarray(tokens[:, i : i + 1]), jnp.full((1, 1), i), cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=2e-5)


def test_packed_and_padded_documents_give_each_the_logits_it_has_alone(case):
    """Two documents of 11 and 13 tokens packed in one row (the boundary inside a CSA window
    of 3 and an HCA window of 5, positions restarting), one behind 11 pads and one before 13:
    each gets the logits it has alone, in every layer kind (compressed entries pool only their
    document's tokens, windows restarting at its start; the indexer and the sliding window see
    only its own)."""
    compute = case.compute.model_copy(update={"indexer_ties": "first"})
    model = nnx.merge(graphdef_of(case.cfg, compute), case.params)
    forward = nnx.jit(lambda m, *rows: m(*rows))
    rng = np.random.default_rng(11)
    a, b = rng.integers(0, VOCAB, 11), rng.integers(0, VOCAB, 13)
    pads, count = np.zeros(13, np.int64), np.arange(13)
    tokens = np.stack([np.r_[a, b], np.r_[pads[:11], b], np.r_[a, pads]])
    segments = np.stack([np.repeat([1, 2], [11, 13]), np.repeat([0, 1], [11, 13]), np.repeat([1, 0], [11, 13])])
    positions = np.stack([np.r_[count[:11], count], np.r_[0 * count[:11], count], np.r_[count[:11], 0 * count]])
    rows = np.asarray(forward(model, *map(jnp.asarray, (tokens, positions, segments))))
    alone_a, alone_b = (np.asarray(forward(model, jnp.asarray(doc[None])))[0] for doc in (a, b))
    pieces = {"packed a": (rows[0, :11], alone_a), "packed b": (rows[0, 11:], alone_b),
              "left-padded b": (rows[1, 11:], alone_b), "right-padded a": (rows[2, :11], alone_a)}  # fmt: skip
    deltas = {name: float(np.abs(ours - alone).max()) for name, (ours, alone) in pieces.items()}
    print(f"\ndeepseek_v4 packed/padded: max |delta logit| {deltas}")
    assert max(deltas.values()) <= 2e-5 and np.abs(alone_b).max() > 0.5


def test_a_sequence_shorter_than_a_window_gives_transformers_logits(case):
    """Two tokens, fewer than either compressor's window (CSA 3, HCA 5): no compressed entry
    yet, only the sliding window (a GRPO completion's forward or a short prompt is this short;
    gathering zero windows raised ZeroDivisionError)."""
    tokens = np.random.default_rng(5).integers(0, VOCAB, (1, 2))
    model = nnx.merge(graphdef_of(case.cfg, case.compute), case.params)
    ours = np.asarray(model(jnp.asarray(tokens)))
    ref = hf_logits(case.hf_model, tokens, np.ones_like(tokens))
    delta = float(np.abs(ours - ref).max())
    print(f"\ndeepseek_v4, 2 tokens: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref).max() > 0.5


def test_every_weight_matrix_is_split_over_fsdp():
    """On an fsdp mesh each weight matrix of the tiny preset is split over `fsdp`: the query
    latent's projections (wq_b, the indexer's wi_q) and the grouped output's per-group one
    (wo_a) too, which had no dimension named for it and sat whole on every device (11.4 of
    DeepSeek-V4-Flash's 21.5 GiB of float32 parameters per chip on a v5p-256, `expert: 16`).
    Left whole: the windows' position biases, the hash-routing table (not weights) and the
    hyper-connections' mixes (w_mix: 24 numbers per stream position, 1.5 MiB a layer at 4,096)."""
    model = ModelConfig.model_validate(resolve_model_preset({"model": "tiny-deepseek-v4"}, "test")["model"])
    shapes, shardings = param_shardings(model, ComputeConfig(), make_mesh(MeshConfig(data=4, fsdp=2)))
    whole = []
    for (path, shape), sharding in zip(
        jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(shardings), strict=True
    ):
        name = str(path[-1].key)
        per_layer = shape.shape[1:] if "blocks" in jax.tree_util.keystr(path) else shape.shape
        kept_whole = name.startswith(("b_pos", "hash_", "w_mix"))  # small: position biases, hash table, stream mixes
        if len(per_layer) >= 2 and not kept_whole and "fsdp" not in str(sharding.spec):
            whole.append(jax.tree_util.keystr(path))
    assert not whole, whole
