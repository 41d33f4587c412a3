"""Hash routing (DeepSeek-V4's first layers, arXiv 2512.24880 section 2.1): a token's experts
are a fixed table's row for its id (transformers' DeepseekV4HashRouter, `tid2eid`), not the
router's top-k; the router's scores still weight them.

A layer sees hidden states, not token ids: the decoder puts the ids of the tokens it runs here
(Transformer._forward) for the layers to read while they are traced.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp

_TOKENS: contextvars.ContextVar = contextvars.ContextVar("hash_routing_tokens", default=None)


def set_tokens(tokens_bt) -> contextvars.Token:
    """The token ids (b, t) the decoder is running; reset with `reset`."""
    return _TOKENS.set(tokens_bt)


def reset(token: contextvars.Token) -> None:
    _TOKENS.reset(token)


def running_tokens():
    """The token ids (b, t) the decoder is running (what n-gram embeddings hash, ngram_embedding.py)."""
    tokens_bt = _TOKENS.get()
    assert tokens_bt is not None, "the decoder sets its token ids before running the layers"
    return tokens_bt


def hashed_experts(table_vk, b: int, t: int):
    """(b * t, k) int32: each running token's row of the table (stored as floats, frozen)."""
    tokens_bt = _TOKENS.get()
    assert tokens_bt is not None and tokens_bt.shape == (b, t), "hash routing needs the decoder's token ids"
    table_vk = jax.lax.stop_gradient(table_vk)
    return jnp.round(table_vk[tokens_bt.reshape(-1)]).astype(jnp.int32)
