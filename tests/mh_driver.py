"""Several engine entry points run one after another in one process (one rank of a gang).

    python -m tests.mh_driver engine.posttrain.sft=RUN.yaml engine.posttrain.dpo=RUN.yaml ...

Each `module=config` is that module's `main([config])`, the same call `python -m module config`
makes. A test that compares several stages on two layouts then pays one process start per rank
(imports, jax.distributed's join, the backend, the matmul that measures the CPU's peak FLOP/s)
instead of one per stage and rank. jax.distributed joins a process once, so this process
joins before the first stage and the stages run in the joined process (engine.train.cli's
`maybe_initialize_distributed` then finds no launcher variables and does not join again).
After each stage's success it prints `mh_driver: finished MODULE CONFIG`. Exits with the
first non-zero exit code (the stage's own `error: ...` line stays the one a failure names),
before the next stage starts.
"""

from __future__ import annotations

import importlib
import os
import sys

from engine.parallel.distributed import maybe_initialize_distributed


def main(argv: list[str]) -> int:
    maybe_initialize_distributed()
    for variable in ("TRAINFLOW_COORDINATOR", "TRAINFLOW_CLUSTER"):
        os.environ.pop(variable, None)
    for argument in argv:
        module, _, config = argument.partition("=")
        code = importlib.import_module(module).main([config])
        if code:
            print(f"mh_driver: {module} {config} exited with code {code}", file=sys.stderr)
            return code
        print(f"mh_driver: finished {module} {config}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
