"""xIELU (arXiv 2411.13010), the activation of Apertus's MLP: a learned quadratic for positive
inputs and a learned ELU-like curve for negative ones, each layer with its own two scalars.

    xielu(x) = alpha_p x^2 + beta x                          for x > 0
               alpha_n (expm1(min(x, eps)) - x) + beta x     otherwise

with alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n), a_p and a_n the learned
parameters (transformers' XIELUActivation `alpha_p`, `alpha_n`, shape (1,)), and beta and
eps constants it stores as buffers (`beta`, `eps`; engine/models/families/apertus.py writes
them on export). Computed in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engine.models.specs import XIELU_BETA as BETA
from engine.models.specs import XIELU_EPS as EPS


def initial_parameters(alpha_p: float = 0.8, alpha_n: float = 0.8) -> tuple[float, float]:
    """(a_p, a_n) for which alpha_p and alpha_n start at these values (transformers' init)."""
    return math.log(math.expm1(alpha_p)), math.log(math.expm1(alpha_n - BETA))


def xielu(x, alpha_p_1, alpha_n_1):
    """xIELU of `x` (float32) with the learned (1,)-shaped parameters a_p and a_n."""
    alpha_p = jax.nn.softplus(alpha_p_1.astype(jnp.float32))
    alpha_n = BETA + jax.nn.softplus(alpha_n_1.astype(jnp.float32))
    negative = (jnp.expm1(jnp.minimum(x, EPS)) - x) * alpha_n
    return jnp.where(x > 0, alpha_p * x * x + BETA * x, negative + BETA * x)
