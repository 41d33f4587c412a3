"""The next-token loss: cross entropy's fused log Z / target terms against logsumexp's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.ops.cross_entropy import log_z_and_target
from engine.train.step import cross_entropy


def reference(logits_btv, targets_bt, mask_bt, z_loss):
    """The loss as autodiff of jax.nn.logsumexp computes it."""
    logits = logits_btv.astype(jnp.float32)
    log_z_bt = jax.nn.logsumexp(logits, axis=-1)
    target_bt = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    nll = jnp.sum((log_z_bt - target_bt) * mask_bt)
    return nll + z_loss * jnp.sum(jnp.square(log_z_bt) * mask_bt), nll


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_and_its_gradient_equal_autodiff_of_logsumexp(dtype, z_loss):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 5, 37)) * 4, dtype)
    targets = jnp.asarray(rng.integers(0, 37, (3, 5)))
    mask = jnp.asarray(rng.integers(0, 2, (3, 5)), jnp.float32)

    def weighted(fn):  # both outputs, so both cotangents reach the backward pass
        return lambda lg: (lambda total, nll: 0.7 * total + 0.3 * nll)(*fn(lg, targets, mask, z_loss))

    ours, theirs = weighted(cross_entropy), weighted(reference)
    np.testing.assert_allclose(ours(logits), theirs(logits), rtol=1e-6)
    g_ours, g_theirs = jax.grad(ours)(logits), jax.grad(theirs)(logits)
    assert g_ours.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.float32(g_ours), np.float32(g_theirs), atol=tol)
    # The gradient is softmax minus the target's one-hot where counted, zero elsewhere.
    assert np.all(np.float32(g_ours)[np.asarray(mask) == 0] == 0)


def test_log_z_is_exact_for_large_logits_and_minus_inf_for_an_all_masked_row():
    logits = jnp.asarray([[1000.0, 1000.0, -1000.0], [-jnp.inf, -jnp.inf, -jnp.inf]])
    log_z, target = log_z_and_target(logits, jnp.asarray([1, 0]))
    np.testing.assert_allclose(log_z[0], 1000.0 + np.log(2.0), rtol=1e-7)
    assert log_z[1] == -jnp.inf and target[1] == -jnp.inf and target[0] == 1000.0
