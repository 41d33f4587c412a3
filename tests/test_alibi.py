"""ALiBi in the attention ops (engine/ops): the slopes as BLOOM and MPT compute them, and the
reference, blocked and decode paths against a plain masked softmax in numpy whose scores
get -slope * (i - j) (i, j positions inside each packed document)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError
from engine.ops.attention import choose_decode_implementation, choose_implementation
from engine.ops.attention_blocked import blocked_attention
from engine.ops.attention_reference import alibi_slopes, dot_product_attention, reference_attention


@pytest.mark.parametrize("heads", [8, 6, 12, 1])
def test_slopes_are_bloom_and_mpts(heads):
    """Powers of two: 2^(-8 i / n); else the largest power of two's, then every other of
    twice as many (BLOOM's build_alibi_tensor and MPT's build_mpt_alibi_tensor agree)."""
    torch = pytest.importorskip("torch")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, 3), heads, torch.float32)[:, 0, 1]  # slope * position 1
    mpt = -build_mpt_alibi_tensor(heads, 3)[:, 0, 0] / 2  # its bias (j - (s - 1)) * slope at j = 0, s = 3
    np.testing.assert_allclose(alibi_slopes(heads), bloom.numpy(), rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(heads), mpt.numpy(), rtol=1e-6)


def plain_attention(q, k, v, segments, slopes, scale):
    """numpy: softmax over q.k * scale - slope * (p_i - p_j), p a token's position in its
    document, masked to j <= i in the same non-zero segment."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, t, n, h))
    for row in range(b):
        seg = segments[row]
        position = np.zeros(t, int)
        for i in range(1, t):
            position[i] = position[i - 1] + 1 if seg[i] == seg[i - 1] else 0
        for head in range(n):
            scores = q[row, :, head] @ k[row, :, head // g].T * scale
            scores -= slopes[head] * (position[:, None] - position[None, :])
            visible = (np.arange(t)[:, None] >= np.arange(t)[None, :]) & (seg[:, None] == seg[None, :]) & (seg != 0)
            scores = np.where(visible, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            p = np.where(visible, np.exp(scores), 0.0)
            out[row, :, head] = (p / p.sum(axis=1, keepdims=True)) @ v[row, :, head // g]
    return out


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    b, t, n, kv, h = 2, 11, 6, 2, 8
    q, k, v = (rng.normal(size=(b, t, heads, h)).astype(np.float32) for heads in (n, kv, kv))
    segments = np.array([[1] * 11, [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]], np.int32)  # two documents packed in row 1
    slopes = alibi_slopes(n)
    return q, k, v, segments, slopes, plain_attention(q, k, v, segments, slopes, h**-0.5)


def test_reference_and_blocked_attention_add_alibi_per_document(operands):
    q, k, v, segments, slopes, expected = operands
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(segments))
    scale = q.shape[-1] ** -0.5
    reference = reference_attention(*args, scale=scale, alibi_slopes=tuple(slopes))
    np.testing.assert_allclose(np.asarray(reference), expected, atol=2e-6)
    blocked = blocked_attention(*args, scale=scale, block=4, alibi_slopes=tuple(slopes))  # 3 query blocks
    np.testing.assert_allclose(np.asarray(blocked), expected, atol=2e-6)
    without = np.asarray(blocked_attention(*args, scale=scale, block=4))
    assert np.abs(without - expected).max() > 0.05  # the bias matters here


def test_blocked_alibi_gradients_are_the_references(operands):
    q, k, v, segments, slopes, _ = operands
    scale, weights = q.shape[-1] ** -0.5, jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v, jnp.asarray(segments)) * weights)

    ref = jax.grad(loss(lambda *a: reference_attention(*a, scale=scale, alibi_slopes=tuple(slopes))), (0, 1, 2))
    blk = jax.grad(loss(lambda *a: blocked_attention(*a, scale=scale, block=4, alibi_slopes=tuple(slopes))), (0, 1, 2))
    for a, b in zip(ref(*map(jnp.asarray, (q, k, v))), blk(*map(jnp.asarray, (q, k, v))), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_a_decode_step_adds_alibi_by_its_distances(operands):
    """The last query of row 0 over its keys, as a decode step (t = 1) with distances
    given (a KV cache's slots), is the full attention's last row."""
    q, k, v, _, slopes, expected = operands
    t = q.shape[1]
    mask = jnp.ones((1, 1, t), bool)
    distance = (t - 1 - jnp.arange(t))[None, None, :]
    out = dot_product_attention(
        jnp.asarray(q[:1, -1:]), jnp.asarray(k[:1]), jnp.asarray(v[:1]), mask, alibi=(slopes, distance, None)
    )
    np.testing.assert_allclose(np.asarray(out)[0, 0], expected[0, -1], atol=2e-6)


def test_implementations_without_alibi_refuse_it_so_auto_falls_back():
    case = dict(platform="cpu", dtype=jnp.float32, head_dim=64, seq_len=128, alibi=True)
    assert choose_implementation("auto", **case) == "blocked"
    with pytest.raises(ConfigError, match="cpu_kernel takes no ALiBi bias"):
        choose_implementation("cpu_kernel", **case)
    assert choose_decode_implementation("auto", platform="cpu", alibi=True) == "reference"
    with pytest.raises(ConfigError, match="cpu_kernel takes no ALiBi bias"):
        choose_decode_implementation("cpu_kernel", platform="cpu", alibi=True)
