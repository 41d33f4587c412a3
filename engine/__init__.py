"""The sharded JAX engine of trainflow, usable without Prefect.

Subpackages, lowest layer first (each imports only from the layers below it; tests/
test_imports.py enforces it):

    config, contract   the config machinery and the contract with launchers (no JAX)
    ops, data          attention and matmuls; corpora, tokenizers, token shards, Grain
    models             the decoder, its families, params and their shardings
    parallel           meshes and multi-process runs
    train              the trainer with hooks, step, optimizer, checkpoints, metrics
    inference          the KV-cache sampler and `generate`
    posttrain          SFT and GRPO/GSPO on the trainer
    evaluate, interop  evaluation reports; Hugging Face checkpoints in and out

Importing it sets up the process: where no TPU is attached, libtpu's TPU probe is told it is
one host, so it prints nothing (tpu_probe.py).
"""

from importlib.metadata import PackageNotFoundError, version

from engine.tpu_probe import quiet_tpu_probe

try:
    __version__ = version("trainflow")
except PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"

quiet_tpu_probe()  # before jax starts in this process: no libtpu probe lines where no TPU is attached
