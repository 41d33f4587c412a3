"""bench/tpu_roofline.py counts a compiled step's products and loop trips as the model says."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.tpu_roofline import _convolution_flops, roofline


def test_a_query_projection_written_as_a_convolution_counts_its_products():
    """XLA:TPU writes x (b, t, d) . w (d, heads, h) as a convolution whose window slides over a
    padded heads axis (from a compiled v5e step); only the products that land on input count."""
    line = "window={size=1x16 pad=0_0x15_15 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f"
    flops = _convolution_flops([8, 2048, 1024, 1], [1024, 16, 128, 1], [8, 2048, 16, 128], line)
    assert flops == 2 * (8 * 2048) * 1024 * (16 * 128)


def test_a_loop_of_products_counts_each_trip():
    """Five trips of a (37, 29) x (29, 23) product, compiled here: 5 x 2 x 37 x 29 x 23 FLOPs."""

    def body(carry, w):
        return carry, carry @ w

    step = jax.jit(lambda x, w: jax.lax.scan(body, x, w)[1])
    hlo = step.lower(jnp.ones((37, 29)), jnp.ones((5, 29, 23))).compile().as_text()
    found = roofline(hlo)
    assert found["flops"] == 5 * 2 * 37 * 29 * 23
    assert found["roofline_seconds"] >= found["matmul_seconds"] > 0
