"""`python -m engine.inference.generate CHECKPOINT --prompt TEXT` (and `trainflow generate ARTIFACT`):
completions of text prompts from a checkpoint, with the KV-cache sampler (sample.py). Its
options are options.py's."""

from __future__ import annotations

import argparse
import json
import sys

from engine.config import ConfigError
from engine.contract import EXIT_CONFIG_ERROR, EXIT_OK
from engine.data import urls
from engine.data.tokenizer import load_saved
from engine.inference.options import add_sampling_arguments
from engine.inference.sample import (
    Sampler,
    checkpoint_in,
    decode_completions,
    encode_prompts,
    left_pad,
    tokenizer_dir_for,
)
from engine.train.checkpoint import load_params, stored_configs


def generate(args: argparse.Namespace) -> int:
    """Run the options of add_sampling_arguments (plus `checkpoint`); the exit code."""
    try:
        checkpoint = checkpoint_in(args.checkpoint)
        tokenizer_dir = urls.existing_folder(args.tokenizer) if args.tokenizer else tokenizer_dir_for(checkpoint)
        if tokenizer_dir is None:
            raise ConfigError(f"no tokenizer next to {checkpoint}; pass --tokenizer DIR")
        prompts = [line.rstrip("\n") for p in args.prompt for line in (sys.stdin if p == "-" else [p])]
        if not prompts:
            raise ConfigError("no prompts; pass --prompt TEXT (repeatable)")
        if (
            args.max_new_tokens < 1
            or args.temperature < 0
            or args.top_k < 0
            or not 0 < args.top_p <= 1
            or args.num_samples < 1
        ):
            raise ConfigError(
                "--max-new-tokens must be >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1, --num-samples >= 1"
            )
        bundle = load_saved(tokenizer_dir)
        model_cfg, compute = stored_configs(checkpoint)
        _, params, step = load_params(checkpoint)
        inputs = [[{"role": "user", "content": p}] for p in prompts] if args.chat else prompts
        pad_id = bundle.pad_id if bundle.pad_id is not None else bundle.eos_id
        tokens, mask = left_pad(encode_prompts(bundle, inputs), pad_id=pad_id)
        if tokens.shape[1] + args.max_new_tokens > model_cfg.max_seq_len:
            raise ConfigError(
                f"prompt ({tokens.shape[1]} tokens) + --max-new-tokens exceeds the model's "
                f"max_seq_len ({model_cfg.max_seq_len})"
            )
        sampler = Sampler(model_cfg, compute, dtype=args.dtype)  # None: the checkpoint's compute dtype
        output = sampler(
            params,
            tokens,
            mask,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            num_generations=args.num_samples,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_ids=(bundle.eos_id,),
            pad_id=pad_id,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    rows = [prompt for prompt in prompts for _ in range(args.num_samples)]  # a prompt's samples are adjacent rows
    for row, (prompt, text, length) in enumerate(zip(rows, decode_completions(bundle, output), output.lengths)):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "sample": row % args.num_samples,
                        "completion": text,
                        "tokens": int(length),
                        "step": step,
                    }
                )
            )
        else:
            print(f"{prompt}{text}" if not args.chat else f"{prompt}\n---\n{text}")
            print("=" * 40)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.inference.generate", description="Sample completions of prompts from a checkpoint."
    )
    parser.add_argument("checkpoint", help="checkpoint directory, or a checkpoint artifact holding checkpoint/")
    add_sampling_arguments(parser)
    return generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
