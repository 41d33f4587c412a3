"""Synchronous vs asynchronous GRPO: tokens per second and the trainer's idle fraction.

    python -m bench.async_grpo [--steps 14] [--repeats 2] [--staleness 1]

Both runs train the same tiny policy on the same copy task (prompt "d=", reward 1 for the
digit d) for the same steps, each in a fresh process, alternating (A B A B):

    sync   rollout_workers 0: the trainer's process samples each batch, then updates
    async  rollout_workers 1, max_staleness N: a worker process samples the next batches while
           the trainer updates (engine/posttrain/async_rollout.py)

Per run, over the steps after the first two (compilation and the worker's start excluded):
completion tokens trained per second of wall time, and the trainer's idle fraction: the share
of that wall time the trainer spent generating (sync) or waiting for a worker's batch (async),
from each step's `rollout_wait_seconds`. Step times are when each step's metrics line lands.

On a 2-core machine the worker and the trainer share the same two cores, so overlap cannot
turn into speed: the idle fraction still shows how much of the trainer's time the rollouts
stop taking. Writes bench/results/async_grpo.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import REPO, alternate, finish, load_line, machine, run_worker, summary
from bench.copy_task import write_copy_task
from engine.models.config import ModelConfig
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import run_grpo

SKIP = 2  # steps left out of the figures: compilation, the worker's start


def make_task(out: Path, d_model: int, layers: int) -> None:
    """A checkpoint of a random policy, a character tokenizer and the prompts."""

    cfg = ModelConfig(
        vocab_size=16,
        d_model=d_model,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=d_model // 4,
        mlp_dim=4 * d_model,
        max_seq_len=64,
    )
    write_copy_task(out, cfg)


def worker(args) -> dict:
    """One run in this process: its throughput and idle fraction."""

    task, out = Path(args.task), Path(tempfile.mkdtemp(prefix="bench-async-grpo-"))
    asynchronous = args.worker == "async"
    cfg = GRPOConfig.model_validate(
        {
            "checkpoint": {"init_from": str(task / "checkpoint"), "directory": str(out / "checkpoint")},
            "data": {"path": str(task / "prompts.jsonl")},
            "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
            "optimizer": {"learning_rate": 1e-2},
            "prompts_per_step": 8,
            "num_generations": 8,
            "max_prompt_length": 2,
            "max_completion_length": args.completion_length,
            "steps": args.steps,
            "progress": False,
            "metrics_dir": str(out),
            "rollout_workers": 1 if asynchronous else 0,
            "max_staleness": args.staleness if asynchronous else 0,
            "rollout_correction": {"mode": "token_truncate"} if asynchronous else None,
        }
    )
    landed: list[float] = []  # when each step's metrics line appeared

    def watch(stop: threading.Event) -> None:
        path = out / "metrics.jsonl"
        while not stop.is_set():
            lines = len(path.read_text().splitlines()) if path.is_file() else 0
            landed.extend([time.perf_counter()] * (lines - len(landed)))
            time.sleep(0.005)

    stop = threading.Event()
    thread = threading.Thread(target=watch, args=(stop,), daemon=True)
    thread.start()
    run_grpo(cfg, log=lambda line: None)
    time.sleep(0.05)
    stop.set()
    thread.join()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = records[SKIP:]
    wall = landed[-1] - landed[SKIP - 1]
    tokens = sum(r["completion_length"] * cfg.prompts_per_step * cfg.num_generations for r in timed)
    idle = sum(r["rollout_wait_seconds"] for r in timed)
    return {
        "mode": args.worker,
        "steps_timed": len(timed),
        "wall_seconds": wall,
        "tokens_per_second": tokens / wall,
        "trainer_idle_fraction": idle / wall,
        "rollout_seconds_mean": float(np.mean([r["rollout_seconds"] for r in timed])),
        "staleness": [r["rollout_staleness"] for r in records],
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
        "is_ratio_max": max((r.get("is_ratio_max", 1.0) for r in timed), default=1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", choices=["sync", "async"])
    parser.add_argument("--task")
    parser.add_argument("--make-task")
    args = parser.parse_args()
    if args.make_task:
        make_task(Path(args.make_task), args.d_model, args.layers)
        print(json.dumps({}))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    info = machine()
    task = Path(tempfile.mkdtemp(prefix="bench-async-grpo-task-"))
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}

    run_worker(
        ["bench.async_grpo", "--make-task", str(task), "--d-model", str(args.d_model), "--layers", str(args.layers)],
        env,
    )
    common = ["--task", str(task), "--steps", str(args.steps), "--staleness", str(args.staleness)]
    common += ["--completion-length", str(args.completion_length)]
    runs = alternate(
        {
            "sync": ["bench.async_grpo", "--worker", "sync", *common],
            "async": ["bench.async_grpo", "--worker", "async", *common],
        },
        args.repeats,
        env,
    )
    info = finish(info)
    result = {
        "description": "GRPO tokens/s and trainer idle fraction, synchronous vs asynchronous rollouts (one worker)",
        "settings": vars(args) | {"prompts_per_step": 8, "num_generations": 8},
        "machine": info,
        "runs": runs,
        "summary": {
            mode: {
                "tokens_per_second": summary([r["tokens_per_second"] for r in rs]),
                "trainer_idle_fraction": summary([r["trainer_idle_fraction"] for r in rs]),
            }
            for mode, rs in runs.items()
        },
    }
    sync, async_ = (result["summary"][m] for m in ("sync", "async"))
    result["async_over_sync_tokens_per_second"] = (
        async_["tokens_per_second"]["median"] / sync["tokens_per_second"]["median"]
    )
    print(f"\n{'mode':6} {'tokens/s (median)':>18} {'spread':>7} {'trainer idle':>13}")
    for mode, s in result["summary"].items():
        tps, idle = s["tokens_per_second"], s["trainer_idle_fraction"]
        print(f"{mode:6} {tps['median']:18.0f} {tps['spread']:7.2f} {idle['median']:13.2f}")
    print(f"async / sync tokens/s: {result['async_over_sync_tokens_per_second']:.2f}")
    print(load_line(info))
    path = REPO / "bench" / "results" / "async_grpo.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
