"""The compiled figures `trainflow plan` reports at scale, from libtpu's compiler on this host
(no step runs, so the machine's load does not change them):

    recipes     llama3.1-8b on a v5p-8 (fsdp 4, 8 rows of 4,096, remat full, splash) with
                each compute.matmul_precision: per-chip memory, the plan's FLOPs, and XLA's
                own FLOP count of a 2-layer model of the same shapes (scan_layers false, so
                its cost analysis counts every layer)
    multislice  a llama3.1-70b-shaped model (the 8B preset at 70B's sizes: d_model 8192, 80
                layers, 64 heads over 8 kv heads, mlp 28672) on two v5p-256 slices (256 chips):
                fsdp over each slice's 128 chips and `data` or `fsdp` over the 2 slices
                (mesh.dcn): per-chip memory and the bytes per chip per step over ICI and DCN
    pipeline    the same on the same slices with its layers in 2 pipeline stages over the
                slices (mesh.dcn.pipeline 2), fsdp within each, 2 micro-batches

    python -m bench.large_scale_plan [--part recipes multislice pipeline]

Writes bench/results/large_scale_plan.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

import jax

from bench import REPO, finish, machine
from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target

LLAMA_70B = {"d_model": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8, "mlp_dim": 28672}


def _config(model, mesh: dict, seq_len: int, rows: int, compute: dict) -> TrainConfig:
    tree = {
        "model": model,
        "mesh": mesh,
        "data": {"seq_len": seq_len, "batch_size": rows},
        "steps": 10,
        "compute": {"attention_impl": "splash", **compute},
    }
    return load_config(tree=tree, schema=TrainConfig)


def _figures(plan) -> dict:
    m = plan.memory
    return {
        "mesh": plan.mesh,
        "how": plan.how,
        "per_chip_gib": {
            "parameters": m.parameters / GiB,
            "optimizer_state": m.optimizer_state / GiB,
            "arguments": m.argument / GiB,
            "temporaries": m.temporaries / GiB,
            "total": m.total / GiB,
        },
        "fits": plan.fits,
        "model_flops": plan.model_flops,
        "hardware_flops": plan.hardware_flops,
        "flops_source": plan.flops_source,
        "network_gib_per_chip_per_step": {k: v / GiB for k, v in plan.network.items()},
    }


def recipes(rows: list) -> None:
    for recipe in ("default", "fp8", "int8"):
        started = time.perf_counter()
        cfg = _config("llama3.1-8b", {"data": 1, "fsdp": 4}, 4096, 8, {"matmul_precision": recipe})
        row = {"part": "recipes", "model": "llama3.1-8b", "target": "v5p-8", "matmul_precision": recipe}
        row.update(_figures(plan_step(cfg, get_target("v5p-8"))))
        two = {"preset": "llama3.1-8b", "num_layers": 2}
        small = _config(two, {"data": 1, "fsdp": 4}, 4096, 8, {"matmul_precision": recipe, "scan_layers": False})
        row["two_layer_xla_flops"] = plan_step(small, get_target("v5p-8")).hardware_flops
        row["compile_seconds"] = time.perf_counter() - started
        rows.append(row)
        print(
            f"llama3.1-8b v5p-8 {recipe:7s}: total {row['per_chip_gib']['total']:.2f} GiB per chip "
            f"(temporaries {row['per_chip_gib']['temporaries']:.2f}), plan FLOPs {row['hardware_flops']:.4g}, "
            f"2-layer XLA FLOPs {row['two_layer_xla_flops']:.4g}",
            flush=True,
        )


def multislice(rows: list) -> None:
    model = {"preset": "llama3.1-8b", **LLAMA_70B}
    for dcn in ("data", "fsdp"):
        started = time.perf_counter()
        mesh = (
            {"data": 2, "fsdp": 128, "dcn": {"data": 2}}
            if dcn == "data"
            else {"data": 1, "fsdp": 256, "dcn": {"fsdp": 2}}
        )
        cfg = _config(model, mesh, 4096, 256, {})
        row = {"part": "multislice", "model": "llama3.1-70b shape", "target": "v5p-256x2", "dcn": dcn}
        row.update(_figures(plan_step(cfg, get_target("v5p-256x2"))))
        row["compile_seconds"] = time.perf_counter() - started
        rows.append(row)
        net = row["network_gib_per_chip_per_step"]
        print(
            f"70B v5p-256x2 dcn {dcn}: total {row['per_chip_gib']['total']:.2f} GiB per chip, "
            f"ICI {net.get('ici', 0):.2f} GiB, DCN {net.get('dcn', 0):.2f} GiB per chip per step",
            flush=True,
        )


def pipeline(rows: list) -> None:
    """The 70B shape on v5p-256x2 with its 80 layers in 2 pipeline stages, one per slice (the
    DCN carries the micro-batches' activations at the stage boundary), fsdp within each."""
    model = {"preset": "llama3.1-8b", **LLAMA_70B}
    started = time.perf_counter()
    mesh = {"pipeline": 2, "data": 1, "fsdp": 128, "dcn": {"pipeline": 2}}
    cfg = _config(model, mesh, 4096, 256, {"pipeline_microbatches": 2})
    row = {"part": "pipeline", "model": "llama3.1-70b shape", "target": "v5p-256x2", "dcn": "pipeline"}
    row.update(_figures(plan_step(cfg, get_target("v5p-256x2"))))
    row["pipeline_microbatches"] = 2
    row["compile_seconds"] = time.perf_counter() - started
    rows.append(row)
    net = row["network_gib_per_chip_per_step"]
    print(
        f"70B v5p-256x2 dcn pipeline: total {row['per_chip_gib']['total']:.2f} GiB per chip, "
        f"ICI {net.get('ici', 0):.2f} GiB, DCN {net.get('dcn', 0):.2f} GiB per chip per step",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", default=["recipes", "multislice"])
    args = parser.parse_args()
    out = REPO / "bench" / "results" / "large_scale_plan.json"
    rows: list = []
    for part in args.part:
        {"recipes": recipes, "multislice": multislice, "pipeline": pipeline}[part](rows)
    # the parts not rerun stay, as the file holds them now (another run may have rewritten it)
    kept = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = [row for row in kept if row["part"] not in args.part] + rows
    info = machine(
        description=__doc__.split("\n\n")[0],
        jax=jax.__version__,
        libtpu=importlib.metadata.version("libtpu"),
        rows=rows,
        figures="compile-time, from libtpu's compiler: not load-sensitive",
    )
    out.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
