"""trainflow and MaxText 0.2.5 at the largest scales, each step compiled through libtpu on this
host (no step runs: compile-time figures, not load-sensitive):

    pipeline  llama3.1-70b's shapes (d_model 8192, 64 heads over 8 kv heads, mlp 28672, vocab
              128,256) on two v5p-256 slices (256 chips): 2 pipeline stages, one per slice
              (over DCN), fsdp over each slice's 128 chips; 512 rows of 4,096 positions in 4
              micro-batches (GPipe), remat full, float32 parameters and AdamW, bf16 compute,
              splash (MaxText: flash) attention. 8 layers, not 80 (each compile of 80 took
              longer than this 2-core host allows; both sides get the same 8)
    fp8       llama3.1-8b on a v5p-8 (fsdp 4, 8 rows of 4,096, remat full, float32 parameters,
              splash), the trainable matmuls in fp8 (trainflow `compute.matmul_precision:
              fp8`, MaxText `quantization=fp8_full use_qwix_quantization=true`: both qwix,
              e4m3 forward, e5m2 gradients, current absmax scaling)

    python -m bench.maxtext_scale [--case pipeline fp8] [--only trainflow|maxtext] \\
        [--maxtext-python ../maxtext-venv/bin/python] [--maxtext-out DIR]

Per chip: arguments, temporaries and total as bench/maxtext_compare.py takes them; model
TFLOPs per chip (trainflow's plan, MaxText's calculate_tflops_training_per_device) and the
plan's executed TFLOPs (with remat, and the pipeline's bubble); bytes per chip per step over
ICI and DCN from each compiled HLO (`engine.train.plan.network_bytes`, the same reader for
both). Writes bench/results/maxtext_scale.json after each row.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import jax

from bench import REPO, finish, machine
from bench.maxtext_compare import maxtext_compiled
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import _ARRAY, _bytes, _executed, _senders, format_plan, network_bytes, plan_step
from engine.train.targets import GiB, get_target

OUT = REPO / "bench" / "results" / "maxtext_scale.json"
LLAMA_70B = {"d_model": 8192, "num_heads": 64, "num_kv_heads": 8, "mlp_dim": 28672}
LAYERS = 8
COMMON = [  # MaxText: what both cases share
    "weight_dtype=float32",
    "dtype=bfloat16",
    "opt_type=adamw",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "remat_policy=full",
    "attention=flash",
    "steps=10",
    "max_target_length=4096",
]
MAXTEXT = {
    "pipeline": [
        *COMMON,
        "compile_topology=v5p-256",
        "compile_topology_num_slices=2",
        "model_name=llama3.1-70b",
        "override_model_config=true",
        f"base_num_decoder_layers={LAYERS}",
        "per_device_batch_size=2",
        "dcn_pipeline_parallelism=2",
        "dcn_data_parallelism=1",
        "ici_fsdp_parallelism=-1",
        "num_pipeline_microbatches=4",
        f"num_layers_per_pipeline_stage={LAYERS // 2}",
        "scan_layers=false",
        "grad_dtype=float32",
        f"base_output_directory={tempfile.gettempdir()}/mtscale/run",
        "run_name=l70pp",
    ],
    "fp8": [
        *COMMON,
        "compile_topology=v5p-8",
        "compile_topology_num_slices=1",
        "model_name=llama3.1-8b",
        "per_device_batch_size=2",
        "ici_fsdp_parallelism=-1",
        "scan_layers=true",
        "grad_dtype=float32",
        "quantization=fp8_full",
        "use_qwix_quantization=true",
        f"base_output_directory={tempfile.gettempdir()}/mtscale/run",
        "run_name=l8fp8",
    ],
}
TARGETS = {"pipeline": "v5p-256x2", "fp8": "v5p-8"}


def trainflow_config(case: str) -> TrainConfig:
    compute = {"attention_impl": "splash", "remat": "full", "dtype": "bfloat16", "param_dtype": "float32"}
    if case == "pipeline":
        tree = {
            "model": {"preset": "llama3.1-8b", **LLAMA_70B, "num_layers": LAYERS},
            "mesh": {"pipeline": 2, "data": 1, "fsdp": 128, "dcn": {"pipeline": 2}},
            "data": {"seq_len": 4096, "batch_size": 512},
            "compute": {**compute, "pipeline_microbatches": 4},
        }
    else:
        tree = {
            "model": "llama3.1-8b",
            "mesh": {"data": 1, "fsdp": 4},
            "data": {"seq_len": 4096, "batch_size": 8},
            "compute": {**compute, "matmul_precision": "fp8"},
        }
    return load_config(tree={**tree, "steps": 10}, schema=TrainConfig)


def trainflow_row(case: str, keep: Path) -> dict:
    started = time.perf_counter()
    plan = plan_step(trainflow_config(case), get_target(TARGETS[case]))
    m = plan.memory
    if plan.compiled is not None:  # beside MaxText's, for reading collectives by hand
        (keep / f"trainflow-{case}").mkdir(parents=True, exist_ok=True)
        (keep / f"trainflow-{case}" / "step.hlo").write_text(plan.compiled.as_text())
    return {
        "argument_gib": m.argument / GiB,
        "temporaries_gib": m.temporaries / GiB,
        "total_gib": m.total / GiB,
        "model_tflops_per_chip": plan.model_flops / plan.devices / 1e12,
        "executed_tflops_per_chip": plan.hardware_flops / plan.devices / 1e12,
        "network_gib_per_chip_per_step": {k: v / GiB for k, v in plan.network.items()},
        "dcn_gib_by_transfer": dcn_by_transfer(plan.compiled.as_text()) if plan.compiled is not None else {},
        "plan": format_plan(plan),
        "compile_seconds": time.perf_counter() - started,
        "versions": {name: version(name) for name in ("jax", "jaxlib", "libtpu", "flax")},
    }


def dcn_by_transfer(hlo_text: str) -> dict[str, float]:
    """The DCN bytes per chip per step of `network_bytes`, GiB by the Megascale transfer's type
    (ONE_TO_ONE: a collective-permute, the stage hand-offs, counted as network_bytes counts
    them; ALL_REDUCE, ALL_GATHER, ...)."""
    kinds: dict[str, float] = {}
    for runs, shape, opcode, rest in _executed(hlo_text):
        if opcode == "send" and (kind := re.search(r'_xla_megascale_transfer_type="(\w+)"', rest)):
            sent = runs * _bytes(*_ARRAY.findall(shape)[0]) * _senders(rest) / GiB
            kinds[kind.group(1)] = kinds.get(kind.group(1), 0.0) + sent
    return kinds


def maxtext_row(case: str, python: str, keep: Path) -> dict:
    out = keep / case
    row = maxtext_compiled(out, MAXTEXT[case], python)
    if "error" not in row:
        hlo = (out / "step.hlo").read_text()
        row["network_gib_per_chip_per_step"] = {k: v / GiB for k, v in network_bytes(hlo).items()}
        row["dcn_gib_by_transfer"] = dcn_by_transfer(hlo)
    return row


def line(name: str, row: dict) -> str:
    if "error" in row:
        return f"  {name:9s} failed: {row['error'].splitlines()[-1]}"
    net = row["network_gib_per_chip_per_step"]
    return (
        f"  {name:9s} arguments {row['argument_gib']:.2f}, temporaries {row['temporaries_gib']:.2f}, total "
        f"{row['total_gib']:.2f} GiB per chip; {row['model_tflops_per_chip']:.1f} model TFLOP per chip; "
        f"ICI {net['ici']:.2f}, DCN {net['dcn']:.2f} GiB per chip per step ({row['compile_seconds']:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs="+", default=["pipeline", "fp8"], choices=sorted(MAXTEXT))
    parser.add_argument("--maxtext-python", default="../maxtext-venv/bin/python")
    parser.add_argument("--only", choices=["trainflow", "maxtext"])
    parser.add_argument("--maxtext-out", type=Path, default=Path(tempfile.gettempdir()) / "mtscale")
    args = parser.parse_args()
    previous = json.loads(OUT.read_text())["rows"] if OUT.exists() else []
    info = machine(description=__doc__.split("\n\n")[0], jax=jax.__version__, libtpu=version("libtpu"))
    rows = {r["case"]: r for r in previous}
    for case in args.case:
        row = rows.setdefault(case, {"case": case, "target": TARGETS[case]})
        row["seq_len"] = trainflow_config(case).data.seq_len
        print(f"{case} on {TARGETS[case]}:", flush=True)
        if args.only != "maxtext":
            row["trainflow"] = trainflow_row(case, args.maxtext_out)
            print(line("trainflow", row["trainflow"]), flush=True)
        elif (hlo := args.maxtext_out / f"trainflow-{case}" / "step.hlo").exists() and "trainflow" in row:
            row["trainflow"]["dcn_gib_by_transfer"] = dcn_by_transfer(hlo.read_text())  # the compile kept
        if args.only != "trainflow":
            row["maxtext"] = maxtext_row(case, args.maxtext_python, args.maxtext_out)
            print(line("MaxText", row["maxtext"]), flush=True)
        info["rows"] = sorted(rows.values(), key=lambda r: r["case"])
        info["figures"] = "compile-time, from libtpu's compiler: not load-sensitive"
        OUT.write_text(json.dumps(info, indent=1) + "\n")
    OUT.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
