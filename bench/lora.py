"""A LoRA fine-tune step (rank 16 on every linear projection) beside the full fine-tune step
of the same model and batch.

bench/train_throughput.py's shape (about 16M parameters, batch 8 x 512, AdamW). A base
checkpoint with random weights is written to a temporary directory first; both runs start
from it through `checkpoint.init_from`, so the LoRA run loads its frozen base as a real run
does and passes it to the step as its fourth argument. Full and LoRA runs alternate
(A B A B ..., each a fresh process, bench/__init__.py); each compiles its step ahead
(`compile_train_step`), runs `--warmup` untimed steps and times `--steps` more one by one.
Besides the step time: the parameters and optimizer-state bytes each trains (from the
trainers' abstract state) and the compiled step's temporaries (XLA's memory analysis).

    python -m bench.lora [--steps 8] [--warmup 2] [--repeats 3] [--dtype float32]

Prints a table and writes bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO, alternate, finish, load_line, machine, run_worker, summary
from bench.train_throughput import BATCH, SEQ, SHAPE, peak_rss_mb

LORA = {"rank": 16, "alpha": 32.0, "target_modules": "all-linear"}
TARGET_RATIO = 1.3  # the issue's: the LoRA step at least 1.3x faster than the full one


def engine_commit() -> str:
    """The commit measured, "+dirty" when engine/ has changes not committed."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "engine") else "")


def make_trainer(kind: str, dtype: str, base: str | None, scan_layers: bool = True):
    """A Trainer of the bench shape: `full` trains every parameter, `lora` an adapter on the
    frozen base; both start from checkpoint `base` (None: from scratch, to write the base).
    `scan_layers=False` lays the layers out one by one (for --flops)."""
    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.trainer import Trainer

    tree = {
        "model": SHAPE,
        "compute": {"dtype": dtype, "scan_layers": scan_layers},
        "mesh": {"data": -1},
        "data": {"batch_size": BATCH, "seq_len": SEQ},
        "optimizer": {"learning_rate": 1e-4},
        "steps": 1000,
        "checkpoint": {"init_from": base},
    }
    if kind == "lora":
        tree["lora"] = LORA
    return Trainer(load_config(tree=tree, schema=TrainConfig))


def write_base(directory: str, dtype: str, scan_layers: bool = True) -> dict:
    """A params-only checkpoint of the bench shape in `directory`, as a conversion writes one."""
    import jax
    import numpy as np

    from engine.contract import CHECKPOINT_FORMAT
    from engine.train.checkpoint import save_params

    trainer = make_trainer("full", dtype, None, scan_layers)
    params = jax.tree.map(np.asarray, trainer.init_state().params)
    cfg = trainer.cfg
    save_params(
        directory,
        0,
        params,
        {
            "step": 0,
            "model": cfg.model.model_dump(mode="json"),
            "compute": cfg.compute.model_dump(mode="json"),
            "format": CHECKPOINT_FORMAT,
        },
    )
    return {"base": directory, "parameters": sum(int(p.size) for p in jax.tree.leaves(params))}


def bench_batch(trainer) -> dict:
    """The bench's batch (random tokens, one document per row) placed for `trainer`."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (BATCH, SEQ + 1)).astype(np.int32)
    return trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
            "segment_ids": np.ones((BATCH, SEQ), np.int32),
            "loss_mask": np.ones((BATCH, SEQ), np.float32),
        }
    )


def step_flops(dtype: str) -> dict:
    """The compiled full and LoRA steps' FLOPs (XLA's cost analysis). It counts a loop body
    once, so the layers are laid out one by one here (scan_layers false, base written so); the
    programs are otherwise the timed ones. Compile-time figures: the machine's load does not
    move them."""
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "checkpoint")
        write_base(base, dtype, scan_layers=False)
        flops = {}
        for kind in ("full", "lora"):
            trainer = make_trainer(kind, dtype, base, scan_layers=False)
            trainer.init_state()
            trainer.compile_train_step(bench_batch(trainer))
            analysis = trainer._compiled_step[1].cost_analysis()
            analysis = analysis[0] if isinstance(analysis, list) else analysis
            flops[kind] = {"flops": analysis["flops"], "bytes_accessed": analysis["bytes accessed"]}
    return flops


def run_step(kind: str, dtype: str, base: str, steps: int, warmup: int) -> dict:
    """Compile, warm up and time one trainer's steps; its state's sizes and the step's memory."""
    import jax

    from engine.train.memory import shard_bytes

    trainer = make_trainer(kind, dtype, base)
    state = trainer.init_state()  # with LoRA: loads the frozen base from `base`
    params, opt_state = state.params, state.opt_state
    batch = bench_batch(trainer)
    start = time.perf_counter()
    trainer.compile_train_step(batch)
    compile_seconds = time.perf_counter() - start
    analysis = trainer._compiled_step[1].memory_analysis()
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    frozen = trainer.abstract_base
    return {
        "kind": kind,
        "dtype": dtype,
        "steps": steps,
        "step_seconds": statistics.median(times),
        "step_times": times,
        "compile_seconds": compile_seconds,
        "loss": float(metrics["loss"]),
        "trained_parameters": sum(math.prod(a.shape) for a in jax.tree.leaves(trainer.abstract_params)),
        "trained_parameter_bytes": shard_bytes(trainer.abstract_params),
        "frozen_parameter_bytes": 0.0 if frozen is None else shard_bytes(frozen),
        "optimizer_state_bytes": shard_bytes(trainer.abstract_opt_state),
        "temp_bytes": None if analysis is None else analysis.temp_size_in_bytes,
        "argument_bytes": None if analysis is None else analysis.argument_size_in_bytes,
        "peak_rss_mb": peak_rss_mb(),
        "jax": jax.__version__,
        "devices": jax.device_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of full, lora (each a process)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="bench/results/lora.json (lora_flops.json with --flops)")
    parser.add_argument(
        "--flops", action="store_true", help="only the compiled steps' FLOPs (one process; load-independent)"
    )
    parser.add_argument("--worker", nargs="*")
    args = parser.parse_args()
    if args.worker:
        kind, base = args.worker
        sys.path.insert(0, str(REPO))
        if kind == "flops":
            result = step_flops(args.dtype)
        elif kind == "base":
            result = write_base(base, args.dtype)
        else:
            result = run_step(kind, args.dtype, base, args.steps, args.warmup)
        print(json.dumps(result))
        return
    if args.flops:
        flops_only(args)
        return

    env = {"XLA_FLAGS": ""}  # one device, the engine's defaults
    common = ["--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "checkpoint")
        written = run_worker(["bench.lora", "--worker", "base", base, *common], env)
        info = machine(engine_commit=engine_commit())  # the load from here on: the measured runs
        runs = alternate(
            {kind: ["bench.lora", "--worker", kind, base, *common] for kind in ("full", "lora")}, args.repeats, env=env
        )
    info = finish(info)
    rows = {
        kind: {
            "step_seconds": summary([r["step_seconds"] for r in results]),
            **{
                k: results[0][k]
                for k in (
                    "trained_parameters",
                    "trained_parameter_bytes",
                    "frozen_parameter_bytes",
                    "optimizer_state_bytes",
                    "temp_bytes",
                    "argument_bytes",
                )
            },
            "peak_rss_mb": summary([r["peak_rss_mb"] for r in results]),
            "runs": results,
        }
        for kind, results in runs.items()
    }
    full, lora = rows["full"], rows["lora"]
    ratio = full["step_seconds"]["median"] / lora["step_seconds"]["median"]
    verdict = "comparable" if info["comparable"] else "not comparable (under load)"

    mb = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
    print(
        f"\n{'step':<6} {'s/step (spread)':>17} {'trained params':>15} {'trained MiB':>12} {'frozen MiB':>11} "
        f"{'opt state MiB':>14} {'temp MiB':>10} {'peak RSS MiB':>13}"
    )
    for kind, r in rows.items():
        s = r["step_seconds"]
        print(
            f"{kind:<6} {s['median']:>8.3f} ({s['spread']:>5.1%}) {r['trained_parameters']:>15,} "
            f"{mb(r['trained_parameter_bytes']):>12} {mb(r['frozen_parameter_bytes']):>11} "
            f"{mb(r['optimizer_state_bytes']):>14} {mb(r['temp_bytes']):>10} {r['peak_rss_mb']['median']:>13,.0f}"
        )
    print(
        f"full / lora step time: {ratio:.2f}x (target >= {TARGET_RATIO}x; {verdict}); "
        f"{args.dtype}, batch {BATCH} x {SEQ}, LoRA rank {LORA['rank']} on {LORA['target_modules']}"
    )
    print(load_line(info))
    out = Path(args.out or REPO / "bench" / "results" / "lora.json").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.lora " + " ".join(sys.argv[1:]),
                "machine": info,
                "shape": SHAPE,
                "batch": BATCH,
                "seq": SEQ,
                "dtype": args.dtype,
                "lora": LORA,
                "base_parameters": written["parameters"],
                "ratio_full_over_lora": ratio,
                "ratio_status": verdict,
                "target_ratio": TARGET_RATIO,
                "meets_target": ratio >= TARGET_RATIO if info["comparable"] else None,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


def flops_only(args) -> None:
    """--flops: the FLOPs ratio is the most a LoRA step can gain from the work it skips (the
    weight gradients of the frozen projections and LM head); the timed ratio falls short of it
    by what both steps spend outside those products."""
    result = run_worker(["bench.lora", "--worker", "flops", "-", "--dtype", args.dtype], {"XLA_FLAGS": ""})
    full, lora = result["full"]["flops"], result["lora"]["flops"]
    print(
        f"compiled step FLOPs ({args.dtype}, batch {BATCH} x {SEQ}): full {full / 1e9:,.1f} G, LoRA {lora / 1e9:,.1f} G"
    )
    print(f"full / LoRA FLOPs: {full / lora:.3f}x (timed-step target >= {TARGET_RATIO}x)")
    out = Path(args.out or REPO / "bench" / "results" / "lora_flops.json").resolve()
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.lora " + " ".join(sys.argv[1:]),
                "description": step_flops.__doc__,
                "machine": machine(engine_commit=engine_commit()),
                "shape": SHAPE,
                "batch": BATCH,
                "seq": SEQ,
                "dtype": args.dtype,
                "lora": LORA,
                "steps": result,
                "ratio_full_over_lora_flops": full / lora,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
