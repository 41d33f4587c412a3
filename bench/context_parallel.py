"""Context parallelism's memory: the compiled training step's temporaries per device as the
mesh's `context` axis grows, read from the compiler's memory analysis (no step runs, so the
load on the machine does not change the figures; step time is not measured: simulated
devices share this machine's cores).

    python -m bench.context_parallel [--seq 2048 4096] [--tpu-seq 32768] [--no-tpu]

- CPU (`blocked` attention, 8 simulated XLA:CPU devices): the tiny model, 2 rows of each
  --seq, on fsdp 2 x context 1, 2 and 4.
- splash's tiles per context shard (from the kernel's block tables, no compile): positions
  in order against the load-balanced layout, at --tpu-seq positions and 2, 4, 8 shards.
- TPU (with libtpu, compiled for the topology on this host as `trainflow plan` does):
  llama3-1b, one row of --tpu-seq positions, `compute.remat: full`, on a v5p-8 (4 chips):
  tensor 4, context 2 x tensor 2 and context 4 (splash attention), and context 4 with
  `blocked`.

Writes bench/results/context_parallel.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from bench import REPO, finish, machine  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.models.params import init_params  # noqa: E402
from engine.ops.partitioning import use_mesh  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.trainer import Trainer  # noqa: E402

MB = 1e6
GiB = 2**30


def cpu_temporaries(seq: int, context: int, rows: int = 2, fsdp: int = 2) -> float:
    """Bytes of temporaries per device of the tiny model's compiled training step."""
    cfg = load_config(
        tree={
            "model": {"preset": "tiny", "max_seq_len": seq},
            "mesh": {"fsdp": fsdp, "context": context},
            "data": {"batch_size": rows, "seq_len": seq},
            "compute": {"attention_impl": "blocked"},
        },
        schema=TrainConfig,
    )
    trainer = Trainer(cfg, devices=jax.devices()[: fsdp * context])
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(lambda: init_params(cfg.model, cfg.compute, trainer.mesh, seed=0)),
        trainer.param_shardings,
    )
    batch = {
        name: jax.ShapeDtypeStruct(
            (rows, seq), jnp.float32 if name == "loss_mask" else jnp.int32, sharding=trainer.batch_sharding
        )
        for name in ("tokens", "targets", "positions", "segment_ids", "loss_mask")
    }
    with use_mesh(trainer.mesh):
        compiled = (
            jax.jit(jax.value_and_grad(trainer.objective.loss_fn, has_aux=True))
            .lower(params, batch, jnp.float32(1.0))
            .compile()
        )
    return float(compiled.memory_analysis().temp_size_in_bytes)


TPU_MESHES = {
    "tensor 4 (splash)": ({"data": 1, "fsdp": 1, "tensor": 4}, "auto"),
    "context 2 x tensor 2 (splash)": ({"data": 1, "fsdp": 1, "context": 2, "tensor": 2}, "auto"),
    "context 4 (splash)": ({"data": 1, "fsdp": 1, "context": 4}, "auto"),
    "context 4 (blocked)": ({"data": 1, "fsdp": 1, "context": 4}, "blocked"),
}


def tpu_plans(seq: int) -> dict:
    """Per-chip memory of llama3-1b's step on a v5p-8 for each of TPU_MESHES."""
    from flows.spec import load_plan
    from tasks.plan import plan_pipeline

    stages = {
        f"m{i}": {
            "task": "pretrain",
            "inputs": {"dataset": "tokenize"},
            "config": {
                "model": {"preset": "llama3-1b", "max_seq_len": seq},
                "mesh": mesh,
                "steps": 3,
                "data": {"seq_len": seq, "batch_size": 1},
                "compute": {"remat": "full", "attention_impl": impl},
            },
        }
        for i, (mesh, impl) in enumerate(TPU_MESHES.values())
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "name": "cpbench",
                    "store": str(Path(tmp) / "store"),
                    "stages": {
                        "tokenize": {
                            "task": "tokenize",
                            "config": {
                                "sources": [{"format": "text", "path": "{stdlib}/a*.py", "name": "stdlib-a"}],
                                "tokenizer": {"vocab_size": 512},
                            },
                        },
                        **stages,
                    },
                }
            )
        )
        started = time.perf_counter()
        plans = {p.stage: p for p in plan_pipeline(load_plan(str(path)), "v5p-8")[0]}
        seconds = time.perf_counter() - started
    out = {}
    for i, name in enumerate(TPU_MESHES):
        plan = plans[f"m{i}"]
        out[name] = {
            "how": plan.how,
            "mesh": plan.mesh,
            "temporaries_gib": round(plan.memory.temporaries / GiB, 2),
            "total_gib": round(plan.memory.total / GiB, 2),
            "fits": plan.fits,
        }
    return {
        "model": "llama3-1b",
        "rows": 1,
        "seq": seq,
        "target": "v5p-8",
        "compile_seconds": round(seconds, 1),
        "plans": out,
    }


def splash_tiles(seq: int, shards: int) -> dict:
    """The (query block, key block) tiles each shard's splash kernel computes on a causal
    layer, from the kernel's own block tables: positions in order, and load-balanced."""
    from engine.ops.attention_splash import _kernel, balanced_order

    def tiles(rows):
        table = _kernel(1, seq, None, None, True, q_seq_shards=shards, rows=rows).fwd_mask_info.block_mask
        return [int((part != 0).sum()) for part in np.array_split(np.asarray(table)[0], shards, axis=0)]

    return {"contiguous": tiles(None), "balanced": tiles(balanced_order(seq, shards))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--tpu-seq", type=int, default=32768)
    parser.add_argument("--no-tpu", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "context_parallel.json"))
    args = parser.parse_args(argv)
    info = machine(jax=jax.__version__)
    cpu = {seq: {context: cpu_temporaries(seq, context) for context in (1, 2, 4)} for seq in args.seq}
    print("CPU, tiny model, 2 rows, fsdp 2: compiled temporaries per device (MB)")
    print(f"{'positions':>10} {'context 1':>10} {'context 2':>10} {'context 4':>10}")
    for seq, by_context in cpu.items():
        print(f"{seq:>10} " + " ".join(f"{by_context[c] / MB:>10.1f}" for c in (1, 2, 4)))
    result = {
        "machine": info,
        "cpu": {"model": "tiny", "rows": 2, "fsdp": 2, "attention": "blocked", "temporaries_bytes": cpu},
    }
    result["splash_tiles"] = {shards: splash_tiles(args.tpu_seq, shards) for shards in (2, 4, 8)}
    print(f"\nsplash tiles per context shard, causal, {args.tpu_seq} positions (the slowest shard bounds the step)")
    for shards, layouts in result["splash_tiles"].items():
        print(f"  context {shards}: in order {layouts['contiguous']}, balanced {layouts['balanced']}")
    if not args.no_tpu and importlib.util.find_spec("libtpu") is not None:
        result["tpu"] = tpu_plans(args.tpu_seq)
        print(
            f"\nTPU v5p-8 (4 chips), llama3-1b, 1 row of {args.tpu_seq}, remat full: per chip "
            f"(compiled in {result['tpu']['compile_seconds']} s)"
        )
        for name, plan in result["tpu"]["plans"].items():
            print(
                f"  {name:32} temporaries {plan['temporaries_gib']:6.2f} GiB, total {plan['total_gib']:6.2f} GiB"
                f" ({plan['how']}{', fits' if plan['fits'] else ', DOES NOT FIT'})"
            )
    result["machine"] = finish(info, settle=0)
    result["what"] = (
        "compile-time memory analysis and the splash kernel's block tables: no timing, so the "
        "machine's load does not change these figures (its load is recorded all the same)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
