"""Training throughput of the engine beside PyTorch + transformers on the same model shape.

Reference shape (about 16M parameters): d_model 384, 6 layers, 6 heads / 2 KV heads,
head_dim 64, MLP 1024, untied embeddings, vocab 8192, batch 8 x seq 512; AdamW.
Each measurement runs in its own process so peak RSS is that framework's alone.

    python -m bench.train_throughput [--steps 8] [--warmup 2]

Prints a table and writes bench/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench import machine

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=8192, d_model=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
             mlp_dim=1024, max_seq_len=512, tie_embeddings=False)  # configs/models/bench-16m.yaml
BATCH, SEQ = 8, 512


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_step(dtype: str, remat: str):
    """(trainer, params, opt_state, batch) of the reference shape on random tokens."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.trainer import Trainer

    cfg = load_config(tree={
        "model": SHAPE, "compute": {"dtype": dtype, "remat": remat},  # float32 params, `dtype` matmuls
        "mesh": {"data": -1}, "data": {"batch_size": BATCH, "seq_len": SEQ},
        "optimizer": {"learning_rate": 1e-4}, "steps": 1000,
    }, schema=TrainConfig)
    trainer = Trainer(cfg)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocab_size"], (BATCH, SEQ + 1)).astype(np.int32)
    batch = trainer.global_batch({
        "tokens": tokens[:, :-1], "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1)),
        "segment_ids": np.ones((BATCH, SEQ), np.int32), "loss_mask": np.ones((BATCH, SEQ), np.float32),
    })
    return trainer, state.params, state.opt_state, batch


def run_jax(dtype: str, steps: int, warmup: int, remat: str) -> dict:
    import jax

    from engine.train.metrics import measure_matmul_flops
    from engine.models.params import flops_per_token

    peak = measure_matmul_flops(2048)
    trainer, params, opt_state, batch = synthetic_step(dtype, remat)
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
    return {"framework": "jax", "dtype": dtype, "remat": remat, "steps": steps, "step_seconds": step_s,
            "tokens_per_second": tokens_per_second, "tflops": flops / 1e12, "matmul_peak_tflops": peak / 1e12,
            "mfu_vs_matmul_peak": flops / peak, "peak_rss_mb": peak_rss_mb(),
            "loss": float(metrics["loss"]), "jax": jax.__version__, "devices": jax.device_count()}


def run_torch(dtype: str, steps: int, warmup: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from engine.models.config import ModelConfig
    from engine.models.params import flops_per_token

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["d_model"], num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
        head_dim=SHAPE["head_dim"], intermediate_size=SHAPE["mlp_dim"], max_position_embeddings=SEQ,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = LlamaForCausalLM(config).to(torch_dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1))
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step_s = (time.perf_counter() - t0) / steps
    tokens_per_second = BATCH * SEQ / step_s
    flops = flops_per_token(ModelConfig(**SHAPE), SEQ) * tokens_per_second
    return {"framework": "torch", "dtype": dtype, "steps": steps, "step_seconds": step_s, "tokens_per_second": tokens_per_second,
            "tflops": flops / 1e12, "peak_rss_mb": peak_rss_mb(), "loss": float(out.loss.detach()),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def in_subprocess(args: list[str]) -> dict | None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--worker", *args],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        print(f"  {' '.join(args)} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", nargs="*")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--torch-bf16-steps", type=int, default=1,
                        help="torch bf16 runs about 20x slower than f32 on CPUs without native bf16 matmuls")
    args = parser.parse_args()
    if args.worker:
        framework, dtype, *rest = args.worker
        if framework == "jax":
            result = run_jax(dtype, args.steps, args.warmup, rest[0] if rest else "none")
        else:
            result = run_torch(dtype, args.steps, args.warmup)
        print(json.dumps(result))
        return

    runs = []
    for dtype in ("float32", "bfloat16"):
        for spec in (["jax", dtype, "none"], ["torch", dtype]):
            if spec[0] == "torch" and args.skip_torch:
                continue
            print(f"running {' '.join(spec)} ...", file=sys.stderr)
            steps, warmup = args.steps, args.warmup
            if spec == ["torch", "bfloat16"]:
                steps, warmup = args.torch_bf16_steps, min(args.warmup, 1)
            r = in_subprocess([*spec, "--steps", str(steps), "--warmup", str(warmup)])
            if r:
                runs.append(r)
    by = {(r["framework"], r["dtype"]): r for r in runs}
    print(f"\n{'framework':<8} {'dtype':<9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU*':>6} {'peak RSS MB':>12} {'vs torch':>9}")
    for r in runs:
        peer = by.get(("torch", r["dtype"]))
        ratio = r["tokens_per_second"] / peer["tokens_per_second"] if peer else float("nan")
        mfu = r.get("mfu_vs_matmul_peak", float("nan"))
        print(f"{r['framework']:<8} {r['dtype']:<9} {r['tokens_per_second']:>10,.0f} {r['tflops']:>8.3f} "
              f"{mfu:>6.1%} {r['peak_rss_mb']:>12,.0f} {ratio:>9.2f}")
    print("* MFU against the f32 matmul peak measured in the same process.")
    out = REPO / "bench" / "results" / "train_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "shape": SHAPE, "batch": BATCH, "seq": SEQ, "runs": runs}, indent=2))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
