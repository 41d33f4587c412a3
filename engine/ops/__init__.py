"""Kernels and primitives: attention, the model's matmuls, logical-axis sharding constraints.

attention.py            the one attention entry point; picks an implementation per platform
attention_reference.py  masked softmax over all scores: the tests' yardstick, KV-cache decoding
attention_blocked.py    block-causal with a recomputing backward, laid out for XLA:CPU
attention_cudnn.py      cuDNN flash attention (NVIDIA GPUs)
attention_splash.py     the Pallas splash-attention kernel (TPUs)
cpu_kernels/            C++ kernels for XLA:CPU (decode and training attention), built on first use
dense.py                the matmuls: one injectable dot_general, a CPU-ordered backward
low_precision.py        fp8 / int8 training recipes of those matmuls (qwix's quantized dot_general)
grouped.py              the experts' grouped matmuls: ragged_dot, or a tile-aligned layout on CPU
gated_delta.py          Gated DeltaNet's delta rule: chunked (training), one step (decoding), per-token reference
ssd.py                  Mamba2's SSD: chunked scan (training), one step (decoding), per-token reference
linear_mixing.py        shared by both: short causal convolution and its window, gated RMSNorm
partitioning.py         logical axis names -> mesh axes; the current mesh and platform
"""
