"""The attention backends by name, the one list: `Impl` (training and prefill) and
`DecodeImpl` (a decode step against the KV cache).

JAX-free, so that engine/models/config.py types `ComputeConfig.attention_impl` and
`decode_attention_impl` with these very Literals (config validation imports no JAX) and
engine/ops/attention.py dispatches on them: a backend is added here once, and is then a
valid config value and a case the entry point must handle.
"""

from typing import Literal

Impl = Literal["auto", "reference", "blocked", "cudnn", "splash", "cpu_kernel"]
"""auto picks per platform (engine/ops/attention.py: AUTO); the rest name one implementation."""
DecodeImpl = Literal["auto", "reference", "cpu_kernel"]
"""auto: cpu_kernel on a single CPU device where it builds, else reference."""
