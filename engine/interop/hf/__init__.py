"""Hugging Face checkpoints in and out (`python -m engine.interop.hf convert|export ...`).

    files.py      which files of a HF directory matter (no JAX: pipeline validation uses it)
    mapping.py    config.json <-> ModelConfig, tensor layouts (numpy only)
    convert.py    a HF directory -> an Orbax checkpoint + tokenizer
    export.py     an Orbax checkpoint -> a HF directory transformers loads
    __main__.py   the CLI

What each family's files mean is its module in engine/models/families. This package's
__init__ imports nothing, so `engine.interop.hf.files` stays free of JAX.
"""
