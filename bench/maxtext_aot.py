"""MaxText's own ahead-of-time compile of its training step, run inside MaxText's environment
(its own venv: `pip install "maxtext[tpu]==0.2.5"`, Python 3.12), for bench/maxtext_compare.py.

    python bench/maxtext_aot.py OUT_DIR key=value ...      (MaxText's config overrides)

Runs `maxtext.trainers.pre_train.train_compile.main` (the entry point of MaxText's
`train_compile`, as its docs invoke it) with MaxText's base.yml and the given overrides, keeps
the executable it compiles, and writes to OUT_DIR: step.hlo (the compiled HLO text) and
step.json (the memory analysis, XLA's cost analysis, MaxText's own TFLOPs per device, the
versions). Imports nothing of trainflow: the two never share an environment.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train_compile
from maxtext.utils import maxtext_utils

MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
    "total_allocation_bytes",
)


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    base = Path(pyconfig.__file__).parent / "base.yml"
    argv = ["train_compile", str(base), *overrides]
    compiled = []
    compile_step = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        compiled.append(compile_step(*args, **kwargs))
        return compiled[-1]

    train_compile.jit_and_compile = keep
    train_compile.main(argv)
    (step,) = compiled
    analysis = step.memory_analysis()
    costs = step.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    config = pyconfig.initialize(argv)
    total_tflops, weight_tflops, attention_tflops = maxtext_utils.calculate_tflops_training_per_device(
        config, log=False
    )
    (out / "step.hlo").write_text(step.as_text())
    result = {
        "memory": {name: getattr(analysis, name, None) for name in MEMORY_FIELDS},
        "xla_flops": (costs or {}).get("flops"),
        "maxtext_tflops_per_device": {
            "total": total_tflops,
            "learnable_weights": weight_tflops,
            "attention": attention_tflops,
        },
        "overrides": overrides,
        "versions": {name: version(name) for name in ("maxtext", "jax", "jaxlib", "libtpu", "flax")},
    }
    (out / "step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "overrides"}), flush=True)


if __name__ == "__main__":
    main()
