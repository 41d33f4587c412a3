"""`python -m engine.generate CHECKPOINT --prompt TEXT` (and `trainflow generate ARTIFACT`):
completions of text prompts from a checkpoint, with engine/sample.py's KV-cache sampler.

Kept apart from the sampler so the `trainflow` command can declare these options without
importing JAX; it loads when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config import ConfigError


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m engine.sample` and `trainflow generate`."""
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); '-' reads stdin lines")
    parser.add_argument("--chat", action="store_true", help="render each prompt as a user message with the chat template")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the artifact's tokenizer/)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = no nucleus filter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def generate(args: argparse.Namespace) -> int:
    """Run the options of add_sampling_arguments (plus `checkpoint`); the exit code."""
    try:
        from engine.checkpoint import load_params
        from engine.sample import Sampler, decode_completions, encode_prompts, left_pad, tokenizer_dir_for
        from engine.tokenizer import load_saved

        checkpoint = Path(args.checkpoint)
        if (checkpoint / "checkpoint").is_dir():
            checkpoint = checkpoint / "checkpoint"
        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else tokenizer_dir_for(checkpoint)
        if tokenizer_dir is None or not tokenizer_dir.is_dir():
            raise ConfigError(f"no tokenizer next to {checkpoint}; pass --tokenizer DIR")
        prompts = [line.rstrip("\n") for p in args.prompt for line in (sys.stdin if p == "-" else [p])]
        if not prompts:
            raise ConfigError("no prompts; pass --prompt TEXT (repeatable)")
        if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
            raise ConfigError("--max-new-tokens must be >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1")
        bundle = load_saved(tokenizer_dir)
        model_cfg, params, step = load_params(checkpoint)
        inputs = [[{"role": "user", "content": p}] for p in prompts] if args.chat else prompts
        pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
        tokens, mask = left_pad(encode_prompts(bundle, inputs), pad_id=pad_id)
        if tokens.shape[1] + args.max_new_tokens > model_cfg.max_seq_len:
            raise ConfigError(f"prompt ({tokens.shape[1]} tokens) + --max-new-tokens exceeds the model's "
                              f"max_seq_len ({model_cfg.max_seq_len})")
        output = Sampler(model_cfg)(params, tokens, mask, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    eos_ids=(bundle.eos_id,), pad_id=pad_id)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, text, length in zip(prompts, decode_completions(bundle, output), output.lengths):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": int(length), "step": step}))
        else:
            print(f"{prompt}{text}" if not args.chat else f"{prompt}\n---\n{text}")
            print("=" * 40)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.generate",
                                     description="Sample completions of prompts from a checkpoint.")
    parser.add_argument("checkpoint", help="checkpoint directory, or a checkpoint artifact holding checkpoint/")
    add_sampling_arguments(parser)
    return generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
