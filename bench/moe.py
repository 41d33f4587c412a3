"""Training throughput of a small Mixtral-shaped mixture of experts beside transformers'
MixtralForCausalLM, and the share of the engine's step spent getting tokens to and from
their experts.

Shape (about 60M parameters, 17M active): d_model 256, 4 layers, 8 heads / 2 KV heads,
head_dim 32, 8 SwiGLU experts of width 704 with 2 per token, vocab 8192, batch 8 x seq 256;
AdamW, float32 or (--dtype bfloat16) bf16: the engine's float32 parameters with bf16 matmuls
accumulated in f32, torch's whole model cast to bf16. Each run is its own process and engine
and torch runs alternate (A B A B, bench/__init__.py); the table gives the median and spread.
The profile traces one engine step and sums XLA's busy time by the named scopes of
engine/models/moe.py: `router` (logits, top-k, balancing statistics), `dispatch` (sort by
expert, gather), `experts` (the grouped matmuls) and `combine` (back to token order, weighted
sum), forward and backward.

    python -m bench.moe [--steps 6] [--warmup 2] [--repeats 3] [--dispatch dropless] [--dtype float32]
    python -m bench.moe --tiny      # a dry run of every path on a toy shape (seconds)

Prints a table and writes bench/results/moe.json (not with --tiny).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import sys
import time
from pathlib import Path

from bench import REPO, alternate, finish, load_line, machine, summary, time_torch_steps, xla_busy

SHAPE = dict(
    family="mixtral",
    vocab_size=8192,
    d_model=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=704,
    max_seq_len=256,
    tie_embeddings=False,
    num_experts=8,
    experts_per_token=2,
)
BATCH, SEQ = 8, 256
TINY = dict(SHAPE, vocab_size=97, d_model=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=48, max_seq_len=32)
TINY_BATCH, TINY_SEQ = 2, 32
MOE_SCOPES = ("router", "dispatch", "experts", "combine")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def engine_step(shape: dict, batch_size: int, seq: int, dispatch: str, dtype: str = "float32"):
    """(trainer, params, opt_state, batch) on random tokens."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.trainer import Trainer

    cfg = load_config(
        tree={
            "model": shape,
            "compute": {"moe_dispatch": dispatch, "moe_capacity_factor": 1.25, "dtype": dtype},
            "mesh": {"data": -1},
            "data": {"batch_size": batch_size, "seq_len": seq},
            "optimizer": {"learning_rate": 1e-4},
            "steps": 1000,
        },
        schema=TrainConfig,
    )
    trainer = Trainer(cfg)
    state = trainer.init_state()
    tokens = np.random.default_rng(0).integers(0, shape["vocab_size"], (batch_size, seq + 1)).astype(np.int32)
    batch = trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(seq, dtype=np.int32), (batch_size, 1)),
            "segment_ids": np.ones((batch_size, seq), np.int32),
            "loss_mask": np.ones((batch_size, seq), np.float32),
        }
    )
    return trainer, state.params, state.opt_state, batch


def run_jax(shape, batch_size, seq, steps, warmup, dispatch, dtype) -> dict:
    import jax

    trainer, params, opt_state, batch = engine_step(shape, batch_size, seq, dispatch, dtype)
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            jax.block_until_ready(params)
            t0 = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready((params, metrics))
    step_s = (time.perf_counter() - t0) / steps
    return {
        "framework": "jax",
        "dispatch": dispatch,
        "steps": steps,
        "step_seconds": step_s,
        "tokens_per_second": batch_size * seq / step_s,
        "peak_rss_mb": peak_rss_mb(),
        "loss": float(metrics["loss"]),
        "moe_load_max": float(metrics["moe_load_max"]),
        "jax": jax.__version__,
    }


def run_torch(shape, batch_size, seq, steps, warmup, dtype) -> dict:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["mlp_dim"],
        max_position_embeddings=seq,
        num_local_experts=shape["num_experts"],
        num_experts_per_tok=shape["experts_per_token"],
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    model = MixtralForCausalLM(config).to(getattr(torch, dtype))  # transformers' default attention and experts kernels
    tokens = torch.randint(0, shape["vocab_size"], (batch_size, seq + 1))
    step_s, loss = time_torch_steps(model, tokens, warmup, steps)
    return {
        "framework": "torch",
        "steps": steps,
        "step_seconds": step_s,
        "tokens_per_second": batch_size * seq / step_s,
        "peak_rss_mb": peak_rss_mb(),
        "loss": loss,
        "experts_implementation": model.config._experts_implementation,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _scope(op_name: str) -> str:
    for scope in MOE_SCOPES:
        if re.search(rf"mlp/{scope}[/)]", op_name):
            return scope
    return "rest of the step"


def profile_jax(shape, batch_size, seq, dispatch, dtype) -> dict:
    """One traced engine step: XLA's busy time by MoE scope, and their shares."""
    import jax

    from engine.ops.partitioning import use_mesh

    trainer, params, opt_state, batch = engine_step(shape, batch_size, seq, dispatch, dtype)
    for _ in range(2):  # compile, then one warm step
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
        jax.block_until_ready(metrics)
    with use_mesh(trainer.mesh):
        hlo = trainer._train_step.lower(params, opt_state, batch).compile().as_text()
    ops, per_op = xla_busy(hlo, lambda: trainer.train_step(params, opt_state, batch))
    busy = collections.Counter()
    for name, ns in per_op.items():
        busy[_scope(ops[name][1])] += ns
    total = sum(busy.values()) or 1
    return {
        "dispatch": dispatch,
        "busy_ms": {k: v / 1e6 for k, v in busy.items()},
        "share": {k: v / total for k, v in busy.items()},
        "routing_share": sum(busy[k] for k in ("router", "dispatch", "combine")) / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of engine, torch (each a process)")
    parser.add_argument("--dispatch", default="dropless", choices=["dropless", "capacity"])
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="engine: the compute dtype (float32 parameters); torch: the whole model",
    )
    parser.add_argument("--tiny", action="store_true", help="a dry run on a toy shape; writes nothing")
    parser.add_argument(
        "--out",
        default=str(REPO / "bench" / "results" / "moe.json"),
        help="where the JSON goes (bench/results/<cpu kind>/ for a second CPU kind)",
    )
    parser.add_argument("--worker", nargs="*")
    args = parser.parse_args()
    shape, batch_size, seq = (TINY, TINY_BATCH, TINY_SEQ) if args.tiny else (SHAPE, BATCH, SEQ)
    if args.worker:
        kind = args.worker[0]
        if kind == "jax":
            result = run_jax(shape, batch_size, seq, args.steps, args.warmup, args.dispatch, args.dtype)
        elif kind == "profile":
            result = profile_jax(shape, batch_size, seq, args.dispatch, args.dtype)
        else:
            result = run_torch(shape, batch_size, seq, args.steps, args.warmup, args.dtype)
        print(json.dumps(result))
        return

    info = machine()
    common = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--dispatch",
        args.dispatch,
        "--dtype",
        args.dtype,
    ]
    common += ["--tiny"] if args.tiny else []
    workers = {"jax": ["bench.moe", "--worker", "jax", *common], "torch": ["bench.moe", "--worker", "torch", *common]}
    results = alternate(workers, args.repeats, env={"XLA_FLAGS": ""})  # one device
    profile = alternate({"profile": ["bench.moe", "--worker", "profile", *common]}, 1, env={"XLA_FLAGS": ""})
    profile = profile["profile"][0]
    info = finish(info)
    rows = {
        framework: {
            "tokens_per_second": summary([r["tokens_per_second"] for r in runs]),
            "peak_rss_mb": summary([r["peak_rss_mb"] for r in runs]),
            "runs": runs,
        }
        for framework, runs in results.items()
    }
    torch_median = rows["torch"]["tokens_per_second"]["median"]
    print(f"\n{'framework':<8} {'tokens/s (spread)':>20} {'peak RSS MB':>12} {'vs torch':>9}")
    for framework, row in rows.items():
        tokens = row["tokens_per_second"]["median"]
        print(
            f"{framework:<8} {tokens:>11,.0f} ({row['tokens_per_second']['spread']:>5.1%}) "
            f"{row['peak_rss_mb']['median']:>12,.0f} {tokens / torch_median:>8.2f}x"
        )
    print(f"\nengine step by MoE scope ({args.dispatch}, XLA busy time, forward + backward):")
    for scope, share in sorted(profile["share"].items(), key=lambda kv: -kv[1]):
        print(f"  {scope:<18} {profile['busy_ms'][scope]:>9.1f} ms {share:>6.1%}")
    print(f"  routing (router + dispatch + combine): {profile['routing_share']:.1%} of the step")
    print(load_line(info))
    if args.tiny:
        return
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.moe " + " ".join(sys.argv[1:]),
                "machine": info,
                "shape": SHAPE,
                "batch": BATCH,
                "seq": SEQ,
                "dispatch": args.dispatch,
                "dtype": args.dtype,
                "rows": rows,
                "profile": profile,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
