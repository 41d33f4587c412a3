"""Kernels and primitives: attention, the model's matmuls, logical-axis sharding constraints."""
