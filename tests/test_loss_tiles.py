"""TrainConfig.loss_tiles: the LM head and the loss over pieces of each row (engine/train/lm_head.py)
give the whole-sequence loss and gradients, and the step holds one piece's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config, load_preset
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import graphdef_of
from engine.train.config import TrainConfig
from engine.train.step import lm_loss_fn
from tests.test_moe import random_params

SEQ = 21  # three tiles of 7


def odd_model(**head) -> ModelConfig:
    return ModelConfig(**{**load_preset("tiny", "test"), "vocab_size": 61, "d_model": 24, "num_layers": 1, **head})


# The head's post-processing steps all at once on an untied head; a tied head plainly.
HEADS = {
    "untied, every post-processing step": dict(
        tie_embeddings=False,
        lm_head_bias=True,
        logits_multiplier=0.7,
        logits_scaling=1.3,
        final_logit_softcap=3.0,
    ),
    "tied": dict(tie_embeddings=True),
}


def batch(vocab: int, rows: int = 2) -> dict:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, (rows, SEQ + 1)).astype(np.int32)
    segments = np.ones((rows, SEQ), np.int32)
    segments[1, 15:] = 0  # padding: masked out of the loss
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (rows, SEQ)),
        "segment_ids": segments,
        "loss_mask": (segments > 0).astype(np.float32),
    }


@pytest.mark.parametrize("head", HEADS)
def test_tiled_loss_and_gradients_equal_the_whole_sequence(head):
    cfg = odd_model(**HEADS[head])
    params = random_params(cfg, ComputeConfig())
    if cfg.head.bias:  # zeros at init: make the bias matter
        params["lm_head_bias_v"] = jnp.linspace(-1.0, 1.0, cfg.vocab_size)
    data = batch(cfg.vocab_size)
    normaliser = jnp.sum(data["loss_mask"])

    def loss_and_grads(tiles, compute):
        fn = lm_loss_fn(graphdef_of(cfg, compute), z_loss=1e-2, loss_tiles=tiles)
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(params, data, normaliser)

    for backward in ("autodiff", "cpu"):  # the accelerators' matmul backward, and the CPU's
        compute = ComputeConfig(matmul_backward=backward)
        (whole, whole_aux), whole_grads = loss_and_grads(1, compute)
        (tiled, tiled_aux), tiled_grads = loss_and_grads(3, compute)
        np.testing.assert_allclose(tiled, whole, rtol=1e-6)
        np.testing.assert_allclose(tiled_aux["nll_sum"], whole_aux["nll_sum"], rtol=1e-6)
        worst = max(
            float(jnp.max(jnp.abs(t - w)) / jnp.max(jnp.abs(w)))
            for t, w in zip(jax.tree.leaves(tiled_grads), jax.tree.leaves(whole_grads), strict=True)
        )
        print(f"\n{head}, matmul_backward {compute.matmul_backward}: largest gradient difference {worst:.1e}")
        assert worst < 1e-5


def test_tiles_keep_one_pieces_logits_in_the_compiled_step():
    """The compiled step's temporaries shrink by about the logits the tiles leave out."""
    cfg = odd_model(vocab_size=4099, tie_embeddings=True)
    compute = ComputeConfig()
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), random_params(cfg, compute, 0.1))
    rows, seq = 4, 64
    data = {k: jax.ShapeDtypeStruct((rows, seq), v.dtype) for k, v in batch(cfg.vocab_size).items()}

    def temporaries(tiles):
        fn = jax.grad(lm_loss_fn(graphdef_of(cfg, compute), loss_tiles=tiles), has_aux=True)
        compiled = jax.jit(fn).lower(params, data, 1.0).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits = rows * seq * cfg.vocab_size * 4  # float32 on CPU
    whole, tiled = temporaries(1), temporaries(4)
    print(f"\ntemporaries: whole {whole / 2**20:.2f} MiB, 4 tiles {tiled / 2**20:.2f} MiB, logits {logits / 2**20:.2f}")
    assert whole - tiled > logits / 2


def test_loss_tiles_that_do_not_fit_are_one_sentence():
    tree = {"model": {"preset": "tiny"}, "data": {"seq_len": 100, "batch_size": 2}, "loss_tiles": 3}
    with pytest.raises(ConfigError, match=r"loss_tiles \(3\) must divide data.seq_len \(100\)"):
        load_config(tree=tree, schema=TrainConfig)
    mtp = {**tree, "loss_tiles": 4, "compute": {"mtp_loss": 0.3}}
    mtp["model"] = {"preset": "tiny-deepseek-v3", "mtp_layers": 1}
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        load_config(tree=mtp, schema=TrainConfig)
