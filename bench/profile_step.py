"""Where one training step of the reference shape spends its time, from a JAX profiler trace.

    python -m bench.profile_step [--dtype float32] [--top 25]

Traces one compiled step (bench/train_throughput.py's shape and batch) and prints how long
XLA:CPU's worker threads were busy in each phase (forward, backward, optimizer) and in each
part of the model (attention, its core, MLP, LM head; matmuls and the rest, from the named
scopes in engine/models/transformer.py), and the costliest operations with their shapes. Writes
bench/results/profile_step.json. Busy time is summed over both threads: XLA runs
independent operations side by side, so it exceeds the step's wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

from bench import REPO, finish, load_line, machine, xla_busy


def _phase(op_name: str) -> str:
    in_layers = "/while/" in op_name
    if "transpose(jvp" in op_name:
        return "layers backward" if in_layers else "head + loss backward"
    if "jvp(" in op_name:
        return "layers forward" if in_layers else "embedding, head + loss forward"
    return "optimizer and the rest"


def _part(op_name: str) -> str:
    """The model part an op belongs to, from the named scopes in engine/models/transformer.py."""
    kind = "matmul" if op_name.endswith("dot_general") else "other"
    for scope in ("attention/core", "attention", "mlp", "lm_head"):
        if re.search(rf"[/(]{scope}[/)]", op_name):
            return f"{scope.replace('/', ' ')} {kind}"
    if "jvp" not in op_name:
        return "optimizer, rest"
    return f"loss, embedding, residual ({kind})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--remat", default="none")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    info = machine()

    import jax

    from bench.train_throughput import BATCH, SEQ, synthetic_step
    from engine.ops.partitioning import use_mesh

    trainer, params, opt_state, batch = synthetic_step(args.dtype, args.remat)
    params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready(metrics)
    step_s = time.perf_counter() - start
    with use_mesh(trainer.mesh):
        hlo = trainer._train_step.lower(params, opt_state, batch).compile().as_text()
    # Each fused HLO op: its result shape and the JAX operation it came from, and its busy time.
    ops, busy = xla_busy(hlo, lambda: trainer.train_step(params, opt_state, batch))
    total_busy = sum(busy.values())
    by_phase, by_part = collections.Counter(), collections.Counter()
    for name, ns in busy.items():
        by_phase[_phase(ops[name][1])] += ns
        by_part[_part(ops[name][1])] += ns

    info = finish(info)
    tokens_per_second = BATCH * SEQ / step_s
    print(
        f"step {step_s:.2f} s ({tokens_per_second:,.0f} tokens/s), {args.dtype}, remat {args.remat}; "
        f"XLA's two threads were busy {total_busy / 1e6:,.0f} ms in all"
    )
    for title, table in (("phase", by_phase), ("part", by_part)):
        print(f"\n{title:<34} {'busy ms':>8} {'share':>6}")
        for name, ns in table.most_common():
            print(f"{name:<34} {ns / 1e6:>8.0f} {ns / total_busy:>6.1%}")
    print(f"\n{'ms':>8} {'share':>6}  {'result':<30} {'part':<22} operation")
    top = []
    for name, ns in busy.most_common(args.top):
        shape, op = ops[name]
        top.append({"op": name, "ms": ns / 1e6, "shape": shape, "part": _part(op), "source": op})
        print(f"{ns / 1e6:>8.1f} {ns / total_busy:>6.1%}  {shape[:30]:<30} {_part(op):<22} {op.split('/')[-1][:30]}")
    print(load_line(info))
    out = REPO / "bench" / "results" / "profile_step.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.profile_step",
                "machine": info,
                "dtype": args.dtype,
                "remat": args.remat,
                "step_seconds": step_s,
                "tokens_per_second": tokens_per_second,
                "busy_ms": total_busy / 1e6,
                "phases_ms": {k: v / 1e6 for k, v in by_phase.items()},
                "parts_ms": {k: v / 1e6 for k, v in by_part.items()},
                "top_ops": top,
                "jax": jax.__version__,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
