"""Fold a LoRA adapter into its base: an adapter checkpoint in, a full checkpoint out.

    python -m engine.posttrain.merge ADAPTER_CHECKPOINT_DIR OUT_CHECKPOINT_DIR [--step N]

Every adapted weight becomes w + scale * A.B (computed in float64, stored in w's dtype;
engine/models/lora.py: merge_into_base); everything else is the base's. The result is a
params-only checkpoint (no optimizer state, as a conversion writes) that any stage takes as
a plain checkpoint, and whose meta names the adapter and base it came from. Prints
`{"result": {...}}` on the last stdout line; a bad input is one `error: ...` line and
EXIT_CONFIG_ERROR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.contract import CHECKPOINT_FORMAT, EXIT_CONFIG_ERROR, EXIT_OK
from engine.train.bucket_paths import checkpoint_path
from engine.train.checkpoint import load_adapter, load_params, read_meta, save_params


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write the merged model of adapter checkpoint `adapter_dir` as checkpoint `out_dir`."""
    model_cfg, lora, _, step, base = load_adapter(adapter_dir, step)
    _, merged, _ = load_params(adapter_dir, step=step, as_numpy=True)
    _, meta = read_meta(adapter_dir, step)
    hf = read_meta(base)[1].get("hf")  # the base's Hugging Face token ids, if it was converted
    out_meta = {
        "step": 0,
        "model": meta["model"],
        "compute": meta["compute"],
        "format": CHECKPOINT_FORMAT,
        "stage": "merge",
        **({"hf": hf} if hf else {}),
        "merged": {
            "adapter": str(checkpoint_path(adapter_dir)),  # absolute, or the URL
            "step": step,
            "base": str(base),
            "lora": lora.model_dump(mode="json"),
        },
    }
    save_params(out_dir, 0, merged, out_meta)
    return {
        "family": model_cfg.family,
        "rank": lora.rank,
        "adapter_step": step,
        "base_checkpoint": str(base),
        "num_params": model_cfg.num_params(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.posttrain.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        result = merge_adapter(args.adapter_dir, args.out_dir, args.step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps({"result": result}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
