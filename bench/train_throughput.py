"""Training throughput of the engine beside PyTorch + transformers on the same model shape.

Reference shape (about 16M parameters): d_model 384, 6 layers, 6 heads / 2 KV heads,
head_dim 64, MLP 1024, untied embeddings, vocab 8192, batch 8 x seq 512; AdamW.
Each measurement runs in its own process so peak RSS is that framework's alone; engine and
torch runs alternate (A B A B ..., --repeats rounds per dtype, bench/__init__.py) and the
table gives the median and the spread. bf16 is the compute dtype (float32 params, bf16
matmuls with float32 accumulation; torch: the whole model in bf16).

    python -m bench.train_throughput [--steps 8] [--warmup 2] [--repeats 3] [--dtypes float32,bfloat16]
        [--attention auto,blocked] [--skip-torch]

`--attention` lists the engine's `compute.attention_impl` values to run, each its own engine
worker in the alternation (engine rows named `jax (blocked)` etc. when more than one).

Prints a table and writes bench/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from bench import REPO, alternate, finish, load_line, machine, summary, time_torch_steps

SHAPE = dict(
    vocab_size=8192,
    d_model=384,
    num_layers=6,
    num_heads=6,
    num_kv_heads=2,
    head_dim=64,
    mlp_dim=1024,
    max_seq_len=512,
    tie_embeddings=False,
)  # configs/models/bench-16m.yaml
BATCH, SEQ = 8, 512


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_step(dtype: str, remat: str, attention: str = "auto"):
    """(trainer, params, opt_state, batch) of the reference shape on random tokens."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.trainer import Trainer

    cfg = load_config(
        tree={
            "model": SHAPE,
            "compute": {"dtype": dtype, "remat": remat, "attention_impl": attention},  # f32 params, `dtype` matmuls
            "mesh": {"data": -1},
            "data": {"batch_size": BATCH, "seq_len": SEQ},
            "optimizer": {"learning_rate": 1e-4},
            "steps": 1000,
        },
        schema=TrainConfig,
    )
    trainer = Trainer(cfg)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocab_size"], (BATCH, SEQ + 1)).astype(np.int32)
    batch = trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
            "segment_ids": np.ones((BATCH, SEQ), np.int32),
            "loss_mask": np.ones((BATCH, SEQ), np.float32),
        }
    )
    return trainer, state.params, state.opt_state, batch


def matmul_peak(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n^3 matmul in the run's dtype, accumulated in f32 as the model's are."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    f = jax.jit(lambda x: jax.lax.dot(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_jax(dtype: str, steps: int, warmup: int, remat: str, attention: str = "auto") -> dict:
    import jax

    from engine.models.params import flops_per_token

    peak = matmul_peak(dtype)
    trainer, params, opt_state, batch = synthetic_step(dtype, remat, attention)
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            jax.block_until_ready(params)
            t0 = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready((params, metrics))
    step_s = (time.perf_counter() - t0) / steps
    tokens_per_second = BATCH * SEQ / step_s
    flops = flops_per_token(trainer.cfg.model, SEQ) * tokens_per_second
    return {
        "framework": "jax",
        "dtype": dtype,
        "remat": remat,
        "attention_impl": attention,
        "steps": steps,
        "step_seconds": step_s,
        "tokens_per_second": tokens_per_second,
        "tflops": flops / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "mfu_vs_matmul_peak": flops / peak,
        "peak_rss_mb": peak_rss_mb(),
        "loss": float(metrics["loss"]),
        "jax": jax.__version__,
        "devices": jax.device_count(),
    }


def run_torch(dtype: str, steps: int, warmup: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from engine.models.config import ModelConfig
    from engine.models.params import flops_per_token

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab_size"],
        hidden_size=SHAPE["d_model"],
        num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"],
        head_dim=SHAPE["head_dim"],
        intermediate_size=SHAPE["mlp_dim"],
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = LlamaForCausalLM(config).to(torch_dtype)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1))
    step_s, loss = time_torch_steps(model, tokens, warmup, steps)
    tokens_per_second = BATCH * SEQ / step_s
    flops = flops_per_token(ModelConfig(**SHAPE), SEQ) * tokens_per_second
    return {
        "framework": "torch",
        "dtype": dtype,
        "steps": steps,
        "step_seconds": step_s,
        "tokens_per_second": tokens_per_second,
        "tflops": flops / 1e12,
        "peak_rss_mb": peak_rss_mb(),
        "loss": loss,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of engine, torch (each a process) per dtype")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--out",
        default=str(REPO / "bench" / "results" / "train_throughput.json"),
        help="where the JSON goes (bench/results/<cpu kind>/ for a second CPU kind)",
    )
    parser.add_argument("--worker", nargs="*")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--attention", default="auto", help="engine attention_impl values, comma-separated")
    args = parser.parse_args()
    if args.worker:
        framework, dtype, *rest = args.worker
        if framework == "jax":
            result = run_jax(dtype, args.steps, args.warmup, *(rest or ["none"]))
        else:
            result = run_torch(dtype, args.steps, args.warmup)
        print(json.dumps(result))
        return

    info, rows = machine(), []
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    for dtype in args.dtypes.split(","):
        impls = args.attention.split(",")
        workers = {
            "jax" if len(impls) == 1 else f"jax ({impl})": [
                *("bench.train_throughput", "--worker", "jax", dtype, "none", impl),
                *steps,
            ]
            for impl in impls
        }
        if not args.skip_torch:
            workers["torch"] = ["bench.train_throughput", "--worker", "torch", dtype, *steps]
        results = alternate(workers, args.repeats, env={"XLA_FLAGS": ""})  # one device, the engine's defaults
        for framework, runs in results.items():
            rows.append(
                {
                    "framework": framework,
                    "dtype": dtype,
                    "tokens_per_second": summary([r["tokens_per_second"] for r in runs]),
                    "peak_rss_mb": summary([r["peak_rss_mb"] for r in runs]),
                    "runs": runs,
                }
            )
    info = finish(info)
    by = {(r["framework"], r["dtype"]): r for r in rows}
    print(
        f"\n{'framework':<15} {'dtype':<9} {'tokens/s (spread)':>20} {'MFU*':>6} {'peak RSS MB':>12} "
        f"{'vs torch':>9} {'RSS vs torch':>13}"
    )
    for r in rows:
        peer = by.get(("torch", r["dtype"]))
        tokens, rss = r["tokens_per_second"]["median"], r["peak_rss_mb"]["median"]
        ratio = tokens / peer["tokens_per_second"]["median"] if peer else float("nan")
        rss_ratio = rss / peer["peak_rss_mb"]["median"] if peer else float("nan")
        mfu = statistics.median(run.get("mfu_vs_matmul_peak", float("nan")) for run in r["runs"])
        print(
            f"{r['framework']:<15} {r['dtype']:<9} {tokens:>11,.0f} ({r['tokens_per_second']['spread']:>5.1%}) "
            f"{mfu:>6.1%} {rss:>12,.0f} {ratio:>8.2f}x {rss_ratio:>12.2f}x"
        )
    print("* MFU against the matmul peak of the run's dtype (bf16 x bf16 -> f32 for bf16), measured in its process.")
    print(load_line(info))
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.train_throughput " + " ".join(sys.argv[1:]),
                "machine": info,
                "shape": SHAPE,
                "batch": BATCH,
                "seq": SEQ,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
