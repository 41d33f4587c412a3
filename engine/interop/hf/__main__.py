"""Hugging Face checkpoints in and out, from the command line.

    python -m engine.interop.hf convert HF_DIR OUT_DIR [--dtype float32|bfloat16] [--checkpoint DIR_OR_URL]
    python -m engine.interop.hf convert-adapter PEFT_DIR OUT_DIR --base CHECKPOINT_DIR
    python -m engine.interop.hf export CHECKPOINT_DIR OUT_DIR [--tokenizer DIR] [--step N] [--max-shard-gb 5]
                                   [--merged] [--overwrite]

A reward model goes both ways as transformers' <Family>ForSequenceClassification: `export` of a
reward-model checkpoint writes one, `convert` of one gives a reward-model checkpoint
(engine/interop/hf/sequence_classification.py).

Prints `{"result": {...}}` on the last stdout line; a bad input is one `error: ...` line on
stderr and exit code EXIT_CONFIG_ERROR (engine/contract.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config import ConfigError
from engine.contract import EXIT_CONFIG_ERROR, EXIT_OK
from engine.interop.hf.convert import NP_DTYPES, convert_hf, convert_peft
from engine.interop.hf.export import export_hf
from engine.interop.hf.mapping import is_sequence_classification
from engine.interop.hf.sequence_classification import convert_reward_model, export_reward_model
from engine.train.reward_checkpoint import is_reward_model


def _config(hf_dir: str) -> dict:
    path = Path(hf_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.interop.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="a Hugging Face model directory -> an Orbax checkpoint")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", choices=sorted(NP_DTYPES), default=None)
    conv.add_argument("--checkpoint", default=None, help="write the checkpoint here (a directory or a bucket URL)")
    adapter = sub.add_parser("convert-adapter", help="a PEFT LoRA adapter directory -> an adapter checkpoint on BASE")
    adapter.add_argument("adapter_dir")
    adapter.add_argument("out_dir")
    adapter.add_argument("--base", required=True, help="the engine checkpoint directory of the adapter's base model")
    exp = sub.add_parser("export", help="an Orbax checkpoint directory -> a Hugging Face model directory")
    exp.add_argument("checkpoint_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--tokenizer", default=None, help="tokenizer directory (default: ../tokenizer)")
    exp.add_argument("--step", type=int, default=None)
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    exp.add_argument(
        "--merged",
        action="store_true",
        help="an adapter checkpoint: write the whole model with the adapter folded in (default: PEFT's format)",
    )
    exp.add_argument(
        "--overwrite", action="store_true", help="export into a non-empty OUT_DIR, deleting the weights already there"
    )
    exp.add_argument(
        "--multimodal-source",
        default=None,
        help="a multimodal ...ForConditionalGeneration directory (Llama 4's): write the decoder back into its "
        "layout, its vision tower and projector copied from there (default: the text-only model)",
    )
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.command == "convert" and is_sequence_classification(_config(args.hf_dir)):  # a reward model
            result = convert_reward_model(args.hf_dir, args.out_dir, dtype=args.dtype, log=log)
        elif args.command == "convert":
            result = convert_hf(args.hf_dir, args.out_dir, dtype=args.dtype, log=log, checkpoint=args.checkpoint)
        elif args.command == "convert-adapter":
            result = convert_peft(args.adapter_dir, args.out_dir, args.base, log=log)
        elif is_reward_model(args.checkpoint_dir, args.step):  # as <Family>ForSequenceClassification
            result = export_reward_model(
                args.checkpoint_dir,
                args.out_dir,
                args.tokenizer,
                step=args.step,
                max_shard_bytes=int(args.max_shard_gb * 1e9),
                overwrite=args.overwrite,
                log=log,
            )
        else:
            result = export_hf(
                args.checkpoint_dir,
                args.out_dir,
                args.tokenizer,
                step=args.step,
                max_shard_bytes=int(args.max_shard_gb * 1e9),
                overwrite=args.overwrite,
                merged=args.merged,
                log=log,
                multimodal_source=args.multimodal_source,
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps({"result": result}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
