"""trainflow and MaxText 0.2.5 side by side under one compiler: llama3.1-8b's training step
compiled for a v5p-8 (4 chips) through libtpu on this host, no step run (compile-time figures,
not load-sensitive). Both: 8 rows (2 per chip) of 4,096 or 8,192 positions, fsdp over the 4
chips, full remat, float32 parameters and AdamW, bf16 compute, splash (MaxText: flash)
attention, layers scanned, with the gradients in float32 or bfloat16 (trainflow
`compute.weight_grad_dtype`, MaxText `grad_dtype`).

    python -m bench.maxtext_compare [--seq 4096 8192] [--grad float32 bfloat16] \\
        [--maxtext-python ../maxtext-venv/bin/python] [--only trainflow|maxtext] [--maxtext-out DIR]

trainflow's step is compiled here, as `trainflow plan` compiles it (plan_step); MaxText's by
its own train_compile in its own environment (bench/maxtext_aot.py, run with
--maxtext-python: a Python 3.12 venv with `maxtext[tpu]==0.2.5`, its libtpu set to this
environment's, so both compile with the same jax / jaxlib / libtpu; the JSON records each
side's versions). Per chip: arguments, temporaries (the buffer assignment's total less the
live arguments and outputs) and total (the assignment's total, `total_allocation_bytes`, plus
the program); FLOPs; per step, the bytes every all-reduce / reduce-scatter of the compiled HLO
reduces, by dtype (`engine.train.plan.collective_bytes`, the layer scan's body once per layer).

Writes bench/results/maxtext_compare.json (after each row, so an interrupted run keeps what it had).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import jax

from bench import REPO, finish, machine
from bench.compiled_step import config
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import collective_bytes, format_plan, plan_step
from engine.train.targets import GiB, get_target

CHIPS = 4
OUT = REPO / "bench" / "results" / "maxtext_compare.json"


# --model qwen3-next-80b-a3b: MaxText's only Qwen3-Next preset at a reduced depth, the same in
# both (its 48 layers' float32 parameters and moments, 960 GB, fit no v5p-8): one repeating unit of
# three Gated DeltaNet layers and a gated attention layer per 4 layers, 512 experts each.
MODELS = {"llama3.1-8b": None, "qwen3-next-80b-a3b": 4}
"""--model -> the layers compiled (None: the preset's own)."""


def maxtext_overrides(seq_len: int, grad: str, model: str = "llama3.1-8b") -> list[str]:
    """MaxText's config for the same step as trainflow_config(seq_len, grad, model)."""
    layers = MODELS[model]
    depth = [] if layers is None else [f"base_num_decoder_layers={layers}", "override_model_config=true"]
    run = "llama8b" if model == "llama3.1-8b" else model
    return [
        "compile_topology=v5p-8",
        "compile_topology_num_slices=1",
        f"model_name={model}",
        *depth,
        f"max_target_length={seq_len}",
        f"per_device_batch_size={8 // CHIPS}",
        "ici_fsdp_parallelism=-1",
        "remat_policy=full",
        "scan_layers=true",
        "attention=flash",
        "weight_dtype=float32",
        "dtype=bfloat16",
        f"grad_dtype={grad}",
        "opt_type=adamw",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        f"base_output_directory={tempfile.gettempdir()}/maxtext-compare/run",
        f"run_name={run}-{seq_len}-{grad}",
        "steps=10",
    ]


def trainflow_config(seq_len: int, grad: str, model: str = "llama3.1-8b"):
    """bench.compiled_step.config (llama3.1-8b), or the same step of `model` at MODELS' depth."""
    if model == "llama3.1-8b":
        return config(seq_len, grad)
    tree = {
        "model": {"preset": model, "num_layers": MODELS[model]},  # its preset: bf16 compute, remat full
        "mesh": {"data": 1, "fsdp": CHIPS},
        "data": {"seq_len": seq_len, "batch_size": 8},
        "steps": 10,
        "compute": {"attention_impl": "splash", "weight_grad_dtype": grad},
    }
    return load_config(tree=tree, schema=TrainConfig)


def reductions(hlo: str) -> dict[str, float]:
    return {dtype: b / GiB for dtype, b in sorted(collective_bytes(hlo).items())}


def trainflow_row(seq_len: int, grad: str, model: str = "llama3.1-8b") -> dict:
    started = time.perf_counter()
    plan = plan_step(trainflow_config(seq_len, grad, model), get_target("v5p-8"))
    analysis = plan.compiled.memory_analysis()
    m = plan.memory
    return {
        "argument_gib": m.argument / GiB,
        "temporaries_gib": m.temporaries / GiB,
        "total_gib": m.total / GiB,
        "total_allocation_gib": analysis.total_allocation_bytes / GiB,
        "temp_size_gib": analysis.temp_size_in_bytes / GiB,
        "peak_memory_gib": analysis.peak_memory_in_bytes / GiB,
        "generated_code_gib": m.generated_code / GiB,
        "model_tflops_per_chip": plan.model_flops / plan.devices / 1e12,
        "executed_tflops_per_chip": plan.hardware_flops / plan.devices / 1e12,
        "reduced_gib_per_step": reductions(plan.compiled.as_text()),
        "plan": format_plan(plan),
        "compile_seconds": time.perf_counter() - started,
        "versions": {name: version(name) for name in ("jax", "jaxlib", "libtpu", "flax")},
    }


def maxtext_row(seq_len: int, grad: str, python: str, keep: Path, model: str = "llama3.1-8b") -> dict:
    """MaxText's compile of the same step, in its own environment; its outputs stay in `keep`
    (a row whose step.json is there, compiled with the same overrides, is read again)."""
    where = keep / (f"{seq_len}-{grad}" if model == "llama3.1-8b" else f"{model}-{seq_len}-{grad}")
    return maxtext_compiled(where, maxtext_overrides(seq_len, grad, model), python)


def maxtext_compiled(out: Path, overrides: list[str], python: str) -> dict:
    """MaxText's train_compile with `overrides` (bench/maxtext_aot.py in `python`), its
    outputs in `out`, read again where step.json there has the same overrides."""
    started = time.perf_counter()
    done = out / "step.json"
    if not (done.exists() and json.loads(done.read_text())["overrides"] == overrides):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # beside this process
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [python, str(REPO / "bench" / "maxtext_aot.py"), str(out), *overrides],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-4000:], "compile_seconds": time.perf_counter() - started}
    step = json.loads(done.read_text())
    hlo = (out / "step.hlo").read_text()
    memory = step["memory"]
    live = memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"]
    total = memory["total_allocation_bytes"]
    tflops = step["maxtext_tflops_per_device"]
    return {
        "argument_gib": memory["argument_size_in_bytes"] / GiB,
        "temporaries_gib": (total - live) / GiB,
        "total_gib": (total + memory["generated_code_size_in_bytes"]) / GiB,
        "total_allocation_gib": total / GiB,
        "temp_size_gib": memory["temp_size_in_bytes"] / GiB,
        "peak_memory_gib": memory["peak_memory_in_bytes"] / GiB,
        "generated_code_gib": memory["generated_code_size_in_bytes"] / GiB,
        "model_tflops_per_chip": tflops["total"],
        "maxtext_tflops_per_device": tflops,
        "reduced_gib_per_step": reductions(hlo),
        "compile_seconds": time.perf_counter() - started,
        "versions": step["versions"],
        "overrides": step["overrides"],
    }


def line(name: str, row: dict) -> str:
    if "error" in row:
        return f"  {name:9s} failed: {row['error'].splitlines()[-1]}"
    reduced = ", ".join(f"{k} {v:.2f}" for k, v in row["reduced_gib_per_step"].items())
    return (
        f"  {name:9s} arguments {row['argument_gib']:.2f}, temporaries {row['temporaries_gib']:.2f}, total "
        f"{row['total_gib']:.2f} GiB per chip; {row['model_tflops_per_chip']:.1f} model TFLOP per chip; "
        f"reduced per step {reduced} GiB ({row['compile_seconds']:.0f} s to compile)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--grad", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--model", choices=list(MODELS), default="llama3.1-8b")
    parser.add_argument("--maxtext-python", default="../maxtext-venv/bin/python")
    parser.add_argument("--only", choices=["trainflow", "maxtext"])
    parser.add_argument("--maxtext-out", type=Path, default=Path(tempfile.gettempdir()) / "maxtext-compare")
    args = parser.parse_args()
    previous = json.loads(OUT.read_text())["rows"] if OUT.exists() else []
    info = machine(description=__doc__.split("\n\n")[0], jax=jax.__version__, libtpu=version("libtpu"))
    rows = {(r.get("model", "llama3.1-8b"), r["seq_len"], r["weight_grad_dtype"]): r for r in previous}
    model = args.model
    for seq_len in args.seq:
        for grad in args.grad:
            row = rows.setdefault((model, seq_len, grad), {"seq_len": seq_len, "weight_grad_dtype": grad})
            if model != "llama3.1-8b":
                row.update(model=model, num_layers=MODELS[model])
            print(f"{model}, {seq_len} positions, gradients {grad}:", flush=True)
            if args.only != "maxtext":
                row["trainflow"] = trainflow_row(seq_len, grad, model)
                print(line("trainflow", row["trainflow"]), flush=True)
            if args.only != "trainflow":
                row["maxtext"] = maxtext_row(seq_len, grad, args.maxtext_python, args.maxtext_out, model)
                print(line("MaxText", row["maxtext"]), flush=True)
            info["rows"] = sorted(
                rows.values(),
                key=lambda r: (r.get("model", "llama3.1-8b"), r["seq_len"], r["weight_grad_dtype"] != "float32"),
            )
            info["figures"] = "compile-time, from libtpu's compiler: not load-sensitive"
            OUT.write_text(json.dumps(info, indent=1) + "\n")
    OUT.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
