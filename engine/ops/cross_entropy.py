"""Cross entropy's two per-token terms, log Z and the target's logit, with a backward pass that
is one fused pass over the logits.

Next-token loss is log Z - logit[target] per token, and the logits are the largest tensor of
a small model's step (batch x seq x vocab: at the benchmark shape 4096 x 8192, 134 MB in
float32). `jax.nn.logsumexp` guards infinite maxima with extra passes that XLA:CPU does not
fuse, and autodiff's backward adds a scatter of the target's gradient into a zero tensor of
that size and a separate rounding. Here the forward is one max and one exp-sum pass, and
the backward computes g_z * softmax + g_target * onehot(target) in one pass, emitted in
the logits' dtype (on CPU, at the benchmark shape: 30 ms against 70 ms for the forward
reduction; docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def log_z_and_target(logits_btv, targets_bt):
    """(log sum exp of the logits over the last axis, the logit at `targets_bt`), both in
    float32, per position. A row whose logits are all -inf has log Z -inf, as logsumexp's."""
    lead = targets_bt.shape
    log_z, target = _flat(logits_btv.reshape(-1, logits_btv.shape[-1]), targets_bt.reshape(-1))
    return log_z.reshape(lead), target.reshape(lead)


@jax.custom_vjp
def _flat(logits_nv, targets_n):
    """log_z_and_target over (positions, vocab) logits."""
    return _forward(logits_nv, targets_n)[0]


def _forward(logits_nv, targets_n):
    # The max and the target are exact in the logits' own dtype, so only the exp-sum reads
    # them converted: XLA:CPU would otherwise write the float32 copy out for its three readers.
    m_n = jnp.max(logits_nv, axis=-1).astype(jnp.float32)
    m_n = jnp.where(jnp.isfinite(m_n), m_n, 0.0)
    log_z_n = jnp.log(jnp.sum(jnp.exp(logits_nv.astype(jnp.float32) - m_n[..., None]), axis=-1)) + m_n
    target_n = jnp.take_along_axis(logits_nv, targets_n[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return (log_z_n, target_n), (logits_nv, targets_n, log_z_n)


def _backward(residuals, cotangents):
    logits_nv, targets_n, log_z_n = residuals
    g_z_n, g_target_n = cotangents
    softmax = jnp.exp(logits_nv.astype(jnp.float32) - log_z_n[..., None])
    hit = jnp.arange(logits_nv.shape[-1]) == targets_n[..., None]
    d_logits = g_z_n[..., None] * softmax + jnp.where(hit, g_target_n[..., None], 0.0)
    return d_logits.astype(logits_nv.dtype), None


_flat.defvjp(_forward, _backward)


def tiled_log_z_and_target(x_btd, logits_fn, targets_bt, tiles: int):
    """log_z_and_target(logits_fn(x_btd), targets_bt), computed `tiles` pieces of each row's
    positions at a time (t / tiles each), one after another under a scan.

    Each piece's logits are made, reduced and dropped, and remade from the piece's hidden
    states in the backward pass (jax.checkpoint), so the step holds one piece's logits,
    (b, t / tiles, vocab), instead of all of them: for a large vocabulary the largest tensor
    of a small model's step (Llama 3.2 1B at 8 x 2048 positions: 4.0 GiB of bf16 logits
    beside 6.9 GiB of parameters and Adam moments). The price is the head's forward product
    twice (2 of a step's 6 head FLOPs per token more), as MaxText's `num_vocab_tiling`.
    Pieces follow the sequence axis, so a batch split over devices stays split. `logits_fn`
    maps (b, c, d) hidden states to (b, c, v) logits; the weights it reads are closed over.
    """
    if tiles == 1:
        return log_z_and_target(logits_fn(x_btd), targets_bt)
    b, t, d = x_btd.shape
    if t % tiles:
        raise ValueError(f"{tiles} loss tiles do not divide the {t} positions of a row")
    x_pbcd = x_btd.reshape(b, tiles, t // tiles, d).swapaxes(0, 1)
    targets_pbc = targets_bt.reshape(b, tiles, t // tiles).swapaxes(0, 1)

    @jax.checkpoint
    def piece(x_bcd, targets_bc):
        return log_z_and_target(logits_fn(x_bcd), targets_bc)

    _, (log_z_pbc, target_pbc) = jax.lax.scan(lambda _, xs: (None, piece(*xs)), None, (x_pbcd, targets_pbc))
    return log_z_pbc.swapaxes(0, 1).reshape(b, t), target_pbc.swapaxes(0, 1).reshape(b, t)
