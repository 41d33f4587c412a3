"""The arithmetic stage: synthetic word problems with verifiable answers, as a corpus artifact.

    <out>/pretrain.txt, sft.jsonl, rl.jsonl, eval.jsonl   (engine/data/synthetic.py)

Later stages read these files through `{input:corpus}/...` paths in their configs.
"""

from __future__ import annotations

from typing import Any

from engine.data.synthetic import ArithmeticConfig, write_arithmetic
from tasks.registry import StageContext, StageKind


class ArithmeticStage(StageKind):
    task = "arithmetic"
    output = "corpus"
    config_schema = ArithmeticConfig
    version = 1

    def run(self, ctx: StageContext) -> dict[str, Any]:
        counts = write_arithmetic(ctx.config, ctx.out_dir)
        ctx.log(f"wrote {', '.join(f'{v} {k}' for k, v in counts.items())}")
        return counts
