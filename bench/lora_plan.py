"""LoRA and QLoRA memory from the compiler: llama3.1-8b SFT steps (rows of 4,096 tokens,
the preset's bf16 compute and full remat, float32 parameters) compiled for TPU topologies
through libtpu on this host, as `trainflow plan` compiles them (no step runs, so the load on
the machine does not change the figures):

    full fine-tune            v5e-4 (4 x 16 GiB), fsdp 4, 4 rows
    LoRA rank 16, all-linear  v5e-4, fsdp 4, 4 rows
    LoRA, bfloat16 base       v5e-1 (one 16 GiB chip), 1 row
    QLoRA int8 / nf4 base     v5e-1, 1 row (nf4 also 4 rows)

plus the bytes of a rank-16 adapter against the base checkpoint's, and each compiled step's
FLOPs per chip (the work LoRA saves: no weight gradients for the frozen base).

    python -m bench.lora_plan

Writes bench/results/lora_plan.json.
"""

from __future__ import annotations

import json
import math

from bench import REPO, finish, machine
from engine.config import load_config
from engine.models.config import LoraConfig
from engine.models.lora import split_adapter
from engine.models.params import abstract_model_params
from engine.train.config import TrainConfig
from engine.train.memory import shard_bytes
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target

LORA = {"rank": 16, "alpha": 32, "target_modules": "all-linear"}
CASES = [  # (name, target, rows of 4,096 tokens, lora section or None)
    ("full fine-tune", "v5e-4", 4, None),
    ("LoRA r16 all-linear", "v5e-4", 4, LORA),
    ("LoRA r16, bfloat16 base", "v5e-1", 1, {**LORA, "base_dtype": "bfloat16"}),
    ("QLoRA r16, int8 base", "v5e-1", 1, {**LORA, "base_dtype": "int8"}),
    ("QLoRA r16, nf4 base", "v5e-1", 1, {**LORA, "base_dtype": "nf4"}),
    ("QLoRA r16, nf4 base", "v5e-1", 4, {**LORA, "base_dtype": "nf4"}),
]


def config(lora: dict | None, rows: int = 4) -> TrainConfig:
    tree = {
        "model": "llama3.1-8b",
        "mesh": {"data": 1, "fsdp": -1},
        "data": {"seq_len": 4096, "batch_size": rows},
        "steps": 10,
        **({"lora": lora} if lora else {}),
    }
    return load_config(tree=tree, schema=TrainConfig)


def main() -> None:
    rows = []
    for name, target, rows_per_step, lora in CASES:
        plan = plan_step(config(lora, rows_per_step), get_target(target), stage=name)
        m = plan.memory
        row = {
            "case": name,
            "target": target,
            "rows": rows_per_step,
            "how": plan.how,
            "fits": plan.fits,
            "total_gib": m.total / GiB,
            "parameters_gib": m.parameters / GiB,
            "optimizer_state_gib": m.optimizer_state / GiB,
            "temporaries_gib": m.temporaries / GiB,
            "capacity_gib": plan.capacity / GiB,
            # The compiled step's FLOPs per chip (XLA's cost analysis of the TPU program) and the
            # compute-bound step time they imply at the chip's peak: what LoRA saves of the work.
            "tflops_per_chip": plan.hardware_flops / plan.devices / 1e12,
            "flops_source": plan.flops_source,
            "compute_seconds": plan.hardware_flops / plan.devices / plan.peak_flops,
        }
        rows.append(row)
        print(
            f"{name:28s} {target:6s} {rows_per_step} x 4096 {plan.how:24s} "
            f"total {row['total_gib']:6.2f} GiB of {row['capacity_gib']:.0f} "
            f"(params {row['parameters_gib']:.2f}, Adam {row['optimizer_state_gib']:.3f}, "
            f"temporaries {row['temporaries_gib']:.2f}) {'fits' if plan.fits else 'DOES NOT FIT'}; "
            f"{row['tflops_per_chip']:.1f} TFLOP per chip ({row['flops_source']})",
            flush=True,
        )
    cfg = config(LORA)
    adapter, base = split_adapter(abstract_model_params(cfg.model, cfg.compute, None, LoraConfig(**LORA)))
    adapter_bytes, base_bytes = shard_bytes(adapter), shard_bytes(base)
    print(
        f"rank-16 all-linear adapter: {adapter_bytes / 2**20:.1f} MiB float32 = "
        f"{100 * adapter_bytes / base_bytes:.2f}% of the base's {base_bytes / GiB:.1f} GiB"
    )
    info = machine(
        description=__doc__.split("\n\n")[0],
        rows=rows,
        adapter_bytes=adapter_bytes,
        base_bytes=base_bytes,
        adapter_fraction=adapter_bytes / base_bytes,
        figures="compile-time, from libtpu's memory analysis: not load-sensitive",
    )
    out = REPO / "bench" / "results" / "lora_plan.json"
    out.write_text(json.dumps(finish(info, settle=0), indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    assert all(math.isfinite(r["total_gib"]) for r in rows)


if __name__ == "__main__":
    main()
