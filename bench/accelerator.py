"""Training throughput and MFU on one accelerator: the engine with cuDNN attention (bf16
matmuls, and fp8 matmuls: `compute.matmul_precision: fp8`, engine/ops/low_precision.py) and
with blocked attention, beside transformers + torch SDPA on the same device.

Shapes (bf16 compute; batch x sequence per step, one device):

    1b     llama3-1b     8 x 2048, float32 parameters and Adam moments, the preset's remat (save_dots)
    8b     llama3.1-8b   4 x 2048, bfloat16 parameters and moments (float32 would not fit 141 GB), remat full
    tiny   a 2-layer Llama, 4 x 256: the dry run on CPU (cuDNN is skipped there, said in the table)

Each measurement runs in a fresh process; the engine and torch alternate (A B C A B C ...,
--repeats rounds, bench/__init__.py) and the table gives the median and the spread. MFU is
model FLOPs (6 x parameters x tokens + attention, engine.models.params.flops_per_token) per
second over the device's dense bf16 peak (its data sheet; on CPU the measured matmul peak),
for the fp8 run too (as torchtitan reports its Float8 runs: the same work over the same peak,
so the two MFUs compare as step times do).
A run that fails (out of memory, a kernel the device lacks) is recorded with its error and
the others go on, so the script runs unattended:

    python -m bench.accelerator                      # 1b and 8b on the GPU here
    python -m bench.accelerator --shape tiny         # the dry run, on any machine

Prints a table and writes bench/results/accelerator.json (accelerator-tiny.json for the dry run).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

from bench import REPO, finish, load_line, machine, run_worker, summary

SHAPES = {
    "1b": {
        "model": "llama3-1b",
        "batch": 8,
        "seq": 2048,
        "compute": {"param_dtype": "float32"},
        "torch_checkpointing": False,
    },
    "8b": {
        "model": "llama3.1-8b",
        "batch": 4,
        "seq": 2048,
        "compute": {"param_dtype": "bfloat16", "remat": "full"},
        "torch_checkpointing": True,
    },
    "tiny": {
        "model": {"preset": "tiny", "max_seq_len": 256},
        "batch": 4,
        "seq": 256,
        "compute": {},
        "torch_checkpointing": False,
    },
}
RUNS = ("engine-cudnn", "engine-cudnn-fp8", "engine-blocked", "torch-sdpa")
"""engine-ATTENTION[-RECIPE]: the attention implementation, then the matmul recipe if not bf16."""


def engine_config(shape: dict, attention: str, matmul_precision: str = "default"):
    sys.path.insert(0, str(REPO))
    from engine.config import load_config
    from engine.train.config import TrainConfig

    return load_config(
        tree={
            "model": shape["model"],
            "compute": {
                **shape["compute"],
                "dtype": "bfloat16",
                "attention_impl": attention,
                "matmul_precision": matmul_precision,
            },
            "mesh": {"data": -1},
            "data": {"batch_size": shape["batch"], "seq_len": shape["seq"]},
            "optimizer": {"learning_rate": 1e-5},
            "steps": 1000,
        },
        schema=TrainConfig,
    )


def run_engine(shape_name: str, attention: str, steps: int, warmup: int, matmul_precision: str = "default") -> dict:
    """One device, synthetic tokens: seconds per optimizer step after `warmup` steps."""
    import jax
    import numpy as np

    from engine.models.params import flops_per_token
    from engine.train.metrics import peak_flops
    from engine.train.trainer import Trainer

    shape = SHAPES[shape_name]
    cfg = engine_config(shape, attention, matmul_precision)
    devices = jax.devices()[:1]
    trainer = Trainer(cfg, devices=devices)
    state = trainer.init_state()
    rows, seq = shape["batch"], shape["seq"]
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (rows, seq + 1)).astype(np.int32)
    batch = trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
            "segment_ids": np.ones((rows, seq), np.int32),
            "loss_mask": np.ones((rows, seq), np.float32),
        }
    )
    params, opt_state = state.params, state.opt_state
    for i in range(warmup + steps):
        if i == warmup:
            jax.block_until_ready(params)
            start = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready((params, metrics))
    step_seconds = (time.perf_counter() - start) / steps
    peak, peak_source = peak_flops(devices)
    tokens_per_second = rows * seq / step_seconds
    flops = flops_per_token(cfg.model, seq) * tokens_per_second
    return {
        "run": f"engine-{attention}" + ("" if matmul_precision == "default" else f"-{matmul_precision}"),
        "step_seconds": step_seconds,
        "tokens_per_second": tokens_per_second,
        "mfu": flops / peak,
        "peak_flops": peak,
        "peak_source": peak_source,
        "loss": float(metrics["loss"]),
        "device": devices[0].device_kind,
        "jax": jax.__version__,
    }


def run_torch(shape_name: str, steps: int, warmup: int) -> dict:
    """transformers' LlamaForCausalLM with SDPA attention, bf16 weights, AdamW, the same shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.params import flops_per_token
    from engine.train.metrics import PEAK_FLOPS_PER_DEVICE, measure_matmul_flops

    shape = SHAPES[shape_name]
    model_cfg = engine_config(shape, "blocked").model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.d_model,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.attention.num_heads,
        num_key_value_heads=model_cfg.attention.num_kv_heads,
        head_dim=model_cfg.attention.head_dim,
        intermediate_size=model_cfg.mlp.dim,
        max_position_embeddings=shape["seq"],
        rope_theta=model_cfg.rope.theta,
        rms_norm_eps=model_cfg.norm.eps,
        tie_word_embeddings=model_cfg.tie_embeddings,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    if shape["torch_checkpointing"]:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    tokens = torch.randint(0, model_cfg.vocab_size, (shape["batch"], shape["seq"]), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    step_seconds = (time.perf_counter() - start) / steps
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((flops for name, flops in PEAK_FLOPS_PER_DEVICE.items() if name.lower() in kind.lower()), None)
    peak_source = f"{kind} data sheet" if peak else "measured cpu matmul"
    peak = peak or measure_matmul_flops()
    tokens_per_second = shape["batch"] * shape["seq"] / step_seconds
    flops = flops_per_token(model_cfg, shape["seq"]) * tokens_per_second
    return {
        "run": "torch-sdpa",
        "step_seconds": step_seconds,
        "tokens_per_second": tokens_per_second,
        "mfu": flops / peak,
        "peak_flops": peak,
        "peak_source": peak_source,
        "loss": float(out.loss.detach()),
        "device": kind,
        "torch": torch.__version__,
    }


def error_line(stderr: str) -> str:
    """The exception line of a failed worker's stderr (its last `SomethingError: ...`)."""
    lines = stderr.strip().splitlines()
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exhausted)\b.*: ", line)]
    return (found[-1] if found else lines[-1])[:500]


def worker_argv(run: str, shape: str, steps: int, warmup: int) -> list[str]:
    return ["bench.accelerator", "--worker", run, "--shape", shape, "--steps", str(steps), "--warmup", str(warmup)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b,8b", help="comma-separated: 1b, 8b, tiny (the CPU dry run)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three runs (each a fresh process)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        result = (
            run_torch(args.shape, args.steps, args.warmup)
            if args.worker == "torch-sdpa"
            else run_engine(
                args.shape,
                (parts := args.worker.removeprefix("engine-").split("-"))[0],
                args.steps,
                args.warmup,
                *parts[1:],
            )
        )
        print(json.dumps(result))
        return

    shapes = args.shape.split(",")
    info, rows = machine(), []
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "XLA_FLAGS": ""}  # the 8B step needs most of the memory
    for shape in shapes:
        results: dict[str, list[dict]] = {run: [] for run in RUNS}
        for round_ in range(args.repeats):
            for run in RUNS:
                print(f"[{shape} {round_ + 1}/{args.repeats}] {run} ...", file=sys.stderr, flush=True)
                try:
                    results[run].append(run_worker(worker_argv(run, shape, args.steps, args.warmup), env))
                except RuntimeError as e:  # recorded, and the others go on: the script runs unattended
                    results[run].append({"error": error_line(str(e))})
        for run, runs in results.items():
            good = [r for r in runs if "error" not in r]
            rows.append(
                {
                    "shape": shape,
                    "run": run,
                    "runs": runs,
                    **(
                        {
                            "tokens_per_second": summary([r["tokens_per_second"] for r in good]),
                            "mfu": statistics.median(r["mfu"] for r in good),
                            "device": good[0]["device"],
                            "peak_source": good[0]["peak_source"],
                        }
                        if good
                        else {"error": runs[-1]["error"]}
                    ),
                }
            )
    info = finish(info)
    print(f"\n{'shape':<6} {'run':<16} {'tokens/s (spread)':>22} {'MFU':>6} {'vs torch':>9}  device")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<6} {row['run']:<16} {'failed: ' + row['error'][:90]}")
            continue
        peer = next(
            (r for r in rows if r["shape"] == row["shape"] and r["run"] == "torch-sdpa" and "error" not in r), None
        )
        tokens = row["tokens_per_second"]["median"]
        ratio = tokens / peer["tokens_per_second"]["median"] if peer else float("nan")
        print(
            f"{row['shape']:<6} {row['run']:<16} {tokens:>13,.0f} ({row['tokens_per_second']['spread']:>5.1%}) "
            f"{row['mfu']:>6.1%} {ratio:>8.2f}x  {row['device']} ({row['peak_source']})"
        )
    print(load_line(info))
    name = "accelerator-tiny.json" if shapes == ["tiny"] else "accelerator.json"
    out = REPO / "bench" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.accelerator " + " ".join(sys.argv[1:]),
                "machine": info,
                "shapes": {s: SHAPES[s] for s in shapes},
                "rows": rows,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
