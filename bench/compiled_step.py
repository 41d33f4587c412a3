"""The compiled figures of llama3.1-8b's training step on a v5p-8 (4 chips), as `trainflow plan`
compiles it for the slice's topology through libtpu on this host (no step runs, so the load
on the machine does not change the figures): 8 rows of 4,096 or 8,192 positions, fsdp 4,
remat full, float32 parameters and Adam, bf16 compute, splash attention, with the weight
gradients in float32 or bfloat16 (compute.weight_grad_dtype).

Per chip: the arguments, the temporaries as XLA's memory analysis states them
(temp_size_in_bytes) and as its buffer assignment holds them (read from the compiler's own
dump), the compiler's peak (peak_memory_in_bytes), the plan's total; per step, the bytes the
gradient reductions (all-reduce / reduce-scatter) move by dtype, from the compiled HLO with
the layer scan's body counted once per layer.

    python -m bench.compiled_step [--seq 4096 8192] [--grad float32 bfloat16]

Writes bench/results/compiled_step.json (one file per JAX version: compiled_step-jax<ver>.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax

from bench import REPO, finish, machine
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import buffer_assignment, collective_bytes, dump_options, plan_step
from engine.train.targets import GiB, get_target


def config(seq_len: int, weight_grad_dtype: str) -> TrainConfig:
    tree = {
        "model": "llama3.1-8b",  # its preset computes in bf16 with remat full
        "mesh": {"data": 1, "fsdp": 4},
        "data": {"seq_len": seq_len, "batch_size": 8},
        "steps": 10,
        "compute": {"attention_impl": "splash", "weight_grad_dtype": weight_grad_dtype},
    }
    return load_config(tree=tree, schema=TrainConfig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--grad", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    libtpu = __import__("importlib.metadata").metadata.version("libtpu")
    rows = []
    for seq_len in args.seq:
        for grad in args.grad:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as dump:
                plan = plan_step(config(seq_len, grad), get_target("v5p-8"), compiler_options=dump_options(dump))
                assigned = buffer_assignment(dump)
            analysis = plan.compiled.memory_analysis()
            reduced = collective_bytes(plan.compiled.as_text())
            m = plan.memory
            row = {
                "seq_len": seq_len,
                "weight_grad_dtype": grad,
                "argument_gib": analysis.argument_size_in_bytes / GiB,
                "temp_size_gib": analysis.temp_size_in_bytes / GiB,
                "buffer_assignment_temporaries_gib": assigned["temporaries"] / GiB,
                "buffer_assignment_total_gib": assigned["total"] / GiB,
                "peak_memory_gib": getattr(analysis, "peak_memory_in_bytes", 0) / GiB,
                "generated_code_gib": analysis.generated_code_size_in_bytes / GiB,
                "plan_temporaries_gib": m.temporaries / GiB,
                "plan_total_gib": m.total / GiB,
                "reduced_gib_per_step": {k: v / GiB for k, v in sorted(reduced.items())},
                "compile_seconds": time.perf_counter() - started,
            }
            rows.append(row)
            print(
                f"{seq_len:5d} positions, grads {grad:8s}: arguments {row['argument_gib']:.2f} GiB, temporaries "
                f"{row['temp_size_gib']:.2f} (memory analysis) / {row['buffer_assignment_temporaries_gib']:.2f} "
                f"(buffer assignment), peak {row['peak_memory_gib']:.2f}, plan total {row['plan_total_gib']:.2f}; "
                "reduced per step " + ", ".join(f"{k} {v:.2f} GiB" for k, v in row["reduced_gib_per_step"].items()),
                flush=True,
            )
    info = machine(
        description=__doc__.split("\n\n")[0],
        jax=jax.__version__,
        libtpu=libtpu,
        rows=rows,
        figures="compile-time, from libtpu's compiler: not load-sensitive",
    )
    out = REPO / "bench" / "results" / f"compiled_step-jax{jax.__version__}.json"
    out.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
