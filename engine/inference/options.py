"""The options of `python -m engine.inference.generate` and `trainflow generate`, kept apart
from the sampler so the `trainflow` command declares them without importing JAX."""

from __future__ import annotations

import argparse


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m engine.inference.generate` and `trainflow generate`."""
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); '-' reads stdin lines")
    parser.add_argument(
        "--chat", action="store_true", help="render each prompt as a user message with the chat template"
    )
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the artifact's tokenizer/)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default: %(default)s)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = no top-k filter (default: %(default)s)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass; 1.0 = no nucleus filter (default: %(default)s)"
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="completions per prompt, sampled from one prefill of the prompt (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="sample in this dtype: bfloat16 casts the weights once and multiplies in bf16 with f32 "
        "accumulation (logits and the draw stay f32); default: the checkpoint's compute dtype",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
