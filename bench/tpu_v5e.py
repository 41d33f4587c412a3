"""trainflow and MaxText side by side on one TPU chip: the same model, batch, sequence, remat
and dtypes, each run a fresh process, the two systems in turns (trainflow, MaxText, trainflow,
...), so drift of the machine falls on both alike.

Both: bfloat16 parameters, Adam moments and gradients (MaxText weight_dtype and grad_dtype
bfloat16; its moments follow the weights), bfloat16 compute, full remat, layers scanned,
synthetic tokens, AdamW, splash attention (trainflow auto picks it on a TPU; MaxText
attention=flash is the same Pallas kernel). MaxText computes the logits in `num_vocab_tiling`
tiles (its own way to fit a large vocabulary's logits; the other settings are its defaults).
A shape's MoE and hybrid models are cut to fit one chip, the same cut on both sides (SHAPES).

Per run: seconds per step after `--warmup` steps (trainflow: the wall clock over `--steps`
steps; MaxText: the mean of its own per-step times, the wall clock between its loop's
iterations), and the chip's own time for the step program, read off a jax.profiler trace of
3 more steps (`device_step_seconds`: the train_step module's duration, median of the 3;
MaxText's runs are always traced, by its own profiler). tokens per second and MFU come from
`device_step_seconds` where a run has it (`timing` says which): MaxText's logged times run
ahead of the chip (qwen3-0.6b: 0.720 s logged, 0.843 s on the chip), trainflow's wall clock
agrees with the chip's within 0.1%. Then tokens per second, MFU (the same
model FLOPs for both, engine.models.params.flops_per_token, over the chip's dense bf16 peak,
197 TFLOP/s for a v5e) and the chip's peak memory in use (memory_stats' peak_bytes_in_use,
read in the run's own process after its last step: on a v5e with JAX 0.10.2 it followed the
live arrays, parameters, moments and batch, and not the compiled step's temporaries). A run
that fails keeps its row, with the error. `--plan` records instead `trainflow plan`'s memory
for a v5e-1 of each shape (compiled ahead of time through libtpu; no chip needed).

    python -m bench.tpu_v5e --shapes llama3.2-1b-2048,qwen3-0.6b-2048 [--rounds 1] [--out FILE]

Appends its rows to bench/results/tpu-v5e.json (or --out), keeping the rows already there.
Needs a TPU, MaxText (its 0.2.4 wheel: Python 3.11 and JAX 0.10.2 like the chip's) and its
dependencies; MaxText runs with DECOUPLE_GCLOUD=TRUE, its switch for running without Google
Cloud.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO

OUT = REPO / "bench" / "results" / "tpu-v5e.json"
GiB = 1024**3
LLAMA_1B_IN_MAXTEXT = [  # MaxText 0.2.4 has no llama3.2-1b config: llama3.1-8b's block at Llama 3.2 1B's shapes
    "model_name=llama3.1-8b",
    "override_model_config=true",
    "base_emb_dim=2048",
    "base_num_query_heads=32",
    "base_num_kv_heads=8",
    "head_dim=64",
    "base_mlp_dim=8192",
    "base_num_decoder_layers=16",
    "vocab_size=128256",
    "logits_via_embedding=true",  # tied embeddings, as Llama 3.2 1B's
]
CUT = ["override_model_config=true", "base_num_decoder_layers=4", "num_experts=16"]
SHAPES = {
    "llama3.2-1b-2048": {
        "model": "llama3.2-1b",
        "trainflow": {"preset": "llama3-1b"},
        "maxtext": LLAMA_1B_IN_MAXTEXT,
        "batch": 8,
        "seq": 2048,
    },
    "llama3.2-1b-8192": {
        "model": "llama3.2-1b",
        "trainflow": {"preset": "llama3-1b"},
        "maxtext": LLAMA_1B_IN_MAXTEXT,
        "batch": 2,
        "seq": 8192,
    },
    "qwen3-0.6b-2048": {
        "model": "qwen3-0.6b",
        "trainflow": {"preset": "qwen3-0.6b"},
        "maxtext": ["model_name=qwen3-0.6b"],
        "batch": 8,
        "seq": 2048,
    },
    # Qwen3-30B-A3B's layer (32 heads, 2048 wide, experts 768 wide, 8 per token) four times, with 16
    # experts a layer instead of 128: 48 layers of 128 (30B parameters) fit no 16 GiB chip, nor do 4.
    "qwen3-30b-a3b-4l16e-2048": {
        "model": "qwen3-30b-a3b (4 layers, 16 experts)",
        "trainflow": {"preset": "qwen3-30b-a3b", "num_layers": 4, "num_experts": 16},
        "maxtext": ["model_name=qwen3-30b-a3b", *CUT],
        "batch": 4,
        "seq": 2048,
    },
    # Qwen3-Next's repeating unit (three Gated DeltaNet layers, one gated attention layer; experts
    # 512 wide, 10 per token, a shared expert), with 16 experts a layer instead of 512.
    "qwen3-next-80b-a3b-4l16e-2048": {
        "model": "qwen3-next-80b-a3b (4 layers, 16 experts)",
        "trainflow": {"preset": "qwen3-next-80b-a3b", "num_layers": 4, "num_experts": 16},
        "maxtext": ["model_name=qwen3-next-80b-a3b", *CUT],
        "batch": 4,
        "seq": 2048,
    },
}
COMMON = {"remat": "full", "param_dtype": "bfloat16"}
VOCAB_TILES = 4


def trainflow_config(shape: dict, steps: int, settings: dict[str, str] | None = None):
    """The shape's TrainConfig; `settings`: dotted keys (compute.remat, loss_tiles, ...) and
    YAML values over it, a variant to measure beside the side-by-side settings."""
    import yaml

    from engine.config import load_config
    from engine.train.config import TrainConfig

    tree = {
        "model": dict(shape["trainflow"]),
        "compute": {"param_dtype": "bfloat16", "dtype": "bfloat16", "remat": "full", "scan_layers": True},
        "mesh": {"data": -1},
        "data": {"batch_size": shape["batch"], "seq_len": shape["seq"]},
        "optimizer": {"learning_rate": 1e-5},
        "steps": steps,
    }
    for key, value in (settings or {}).items():
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return load_config(tree=tree, schema=TrainConfig)


def maxtext_argv(name: str, shape: dict, steps: int, out_dir: str) -> list[str]:
    return [
        *shape["maxtext"],
        f"per_device_batch_size={shape['batch']}",
        f"max_target_length={shape['seq']}",
        "remat_policy=full",
        "scan_layers=true",
        "attention=flash",
        "weight_dtype=bfloat16",
        "grad_dtype=bfloat16",
        "dtype=bfloat16",
        "opt_type=adamw",
        f"num_vocab_tiling={VOCAB_TILES}",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        f"steps={steps}",
        f"base_output_directory={out_dir}",
        f"run_name={name}",
    ]


def model_flops_per_token(shape: dict) -> float:
    from engine.models.params import flops_per_token

    return flops_per_token(trainflow_config(shape, 10).model, shape["seq"])


def chip_peak_gib() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / GiB if "peak_bytes_in_use" in stats else None


def run_trainflow(name: str, steps: int, warmup: int, settings: dict[str, str], trace_dir: str | None) -> dict:
    import jax
    import numpy as np
    import yaml

    from bench.tpu_trace import summary, traced
    from engine.ops import attention_splash
    from engine.train.trainer import Trainer

    shape = SHAPES[name]
    settings = dict(settings)
    for key in [k for k in settings if k.startswith("splash.")]:  # the kernel's tiles, not the config's
        attention_splash.TUNING[key.removeprefix("splash.")] = yaml.safe_load(settings.pop(key))
    cfg = trainflow_config(shape, 1000, settings)
    trainer = Trainer(cfg, devices=jax.devices()[:1])
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
    started = time.perf_counter()
    for i in range(warmup + steps):
        if i == 1:
            jax.block_until_ready(params)
            compile_seconds = time.perf_counter() - started
        if i == warmup:
            jax.block_until_ready(params)
            start = time.perf_counter()
        params, opt_state, metrics = trainer.train_step(params, opt_state, batch)
    jax.block_until_ready((params, metrics))
    step_seconds = (time.perf_counter() - start) / steps
    row = {
        "step_seconds": step_seconds,
        "loss": float(metrics["loss"]),
        "compile_seconds": compile_seconds,
        "peak_hbm_gib": chip_peak_gib(),
        "memory_stats": jax.devices()[0].memory_stats(),
    }
    # The chip's own compiler's buffer assignment of this step, to set beside `trainflow plan`'s
    # (peak_bytes_in_use above leaves the step's temporaries out on this chip and JAX).
    compiled = trainer.jitted_train_step().lower(params, opt_state, batch).compile().memory_analysis()
    row["compiled_gib"] = {
        "argument": compiled.argument_size_in_bytes / GiB,
        "temporaries": compiled.temp_size_in_bytes / GiB,
        "output": compiled.output_size_in_bytes / GiB,
        "alias": compiled.alias_size_in_bytes / GiB,
        "program": compiled.generated_code_size_in_bytes / GiB,
        "peak": (getattr(compiled, "peak_memory_in_bytes", 0) or 0) / GiB,  # the heap peak `trainflow plan` reads
    }
    if trace_dir:
        traced(trainer.train_step, (params, opt_state), (batch,), TRACED_STEPS, trace_dir)
        row["trace"] = summary(trace_dir, TRACED_STEPS)
    return row


TRACED_STEPS = 3


STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+)")


def run_maxtext(name: str, steps: int, warmup: int, trace_dir: str | None = None) -> dict:
    """MaxText's own training loop (maxtext.trainers.pre_train.train.main) on SHAPES[name]; its
    per-step log lines come back through a logging handler. With `trace_dir`, MaxText's own
    profiler (profiler=xplane) traces TRACED_STEPS steps after the measured ones."""
    import logging

    from absl import app

    from bench.tpu_trace import summary

    result: dict = {}

    def main(argv):
        from maxtext.configs import pyconfig
        from maxtext.trainers.pre_train import train

        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        logging.getLogger().addHandler(Keep())
        out_dir = trace_dir or tempfile.mkdtemp(prefix="maxtext-")  # its trace goes under <run_name>/tensorboard
        base = str(Path(pyconfig.__file__).parent / "base.yml")
        started = time.perf_counter()
        argv = maxtext_argv(name, SHAPES[name], warmup + steps, out_dir)
        if trace_dir:  # the traced steps after the measured ones (and one more: the last is not waited for)
            argv = [a for a in argv if not a.startswith("steps=")] + [f"steps={warmup + steps + TRACED_STEPS + 1}"]
            argv += ["profiler=xplane", f"skip_first_n_steps_for_profiler={warmup + steps}"]
            argv += [f"profiler_steps={TRACED_STEPS}"]
        train.main(["train", base, *argv])
        found = [STEP_LINE.search(line) for line in lines]
        times = {int(m[1]): (float(m[2]), float(m[3])) for m in found if m}
        # The loop's last step is logged before it has run to the end (nothing reads it after):
        # steps warmup .. last - 1 are measured.
        measured = [times[i] for i in range(warmup, warmup + steps - 1) if i in times]
        if not measured:
            raise RuntimeError(f"MaxText logged no step times past step {warmup}: {lines[-5:]}")
        result.update(
            step_seconds=sum(s for s, _ in measured) / len(measured),
            maxtext_tflops_per_device=sum(t for _, t in measured) / len(measured),
            steps_measured=len(measured),
            first_step_seconds=times.get(0, (None,))[0],  # as MaxText logs step 0
            wall_seconds=time.perf_counter() - started,
            peak_hbm_gib=chip_peak_gib(),
        )
        if trace_dir:
            result["trace"] = summary(trace_dir, TRACED_STEPS)

    try:
        app.run(main, argv=["maxtext"])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    return result


def worker(system: str, name: str, steps: int, warmup: int, settings: dict[str, str], trace_dir: str | None) -> dict:
    import jax

    from engine.train.metrics import peak_flops

    shape = SHAPES[name]
    if system == "trainflow":
        run = run_trainflow(name, steps, warmup, settings, trace_dir)
    else:
        run = run_maxtext(name, steps, warmup, trace_dir)
    modules = (run.get("trace") or {}).get("train_step_module_seconds") or []
    if modules:  # the chip's own time for the step program, the same reading for both systems
        run["device_step_seconds"] = sorted(modules)[len(modules) // 2]
    timing = "device_step_seconds" if modules else "step_seconds"
    tokens_per_second = shape["batch"] * shape["seq"] / run[timing]
    peak, _ = peak_flops(jax.devices()[:1])
    return {
        **run,
        "timing": timing,
        "tokens_per_second": tokens_per_second,
        "mfu": model_flops_per_token(shape) * tokens_per_second / peak,
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }


def plan(names: list[str], settings: dict[str, str]) -> dict:
    """`trainflow plan`'s memory for a v5e-1 (the compiler's buffer assignment for the chip,
    compiled ahead of time on this host through libtpu) of each shape's trainflow run."""
    from engine.train.plan import plan_step
    from engine.train.targets import get_target

    planned = {}
    for name in names:
        started = time.perf_counter()
        memory = plan_step(trainflow_config(SHAPES[name], 1000, settings), get_target("v5e-1")).memory
        planned[variant(name, settings)] = {
            "total_gib": memory.total / GiB,
            "argument_gib": memory.argument / GiB,
            "temporaries_gib": memory.temporaries / GiB,
            "seconds": time.perf_counter() - started,
            "commit": commit(),
            "date": datetime.date.today().isoformat(),
        }
        print(variant(name, settings), json.dumps(planned[variant(name, settings)]), flush=True)
    return planned


def error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exhausted|OOM)\b.*", line)]
    return (found[-1] if found else (lines[-1] if lines else "no output"))[:600]


def variant(name: str, settings: dict[str, str]) -> str:
    """A shape's key with its trainflow settings, if any: llama3.2-1b-2048[loss_tiles=4]."""
    return name + ("[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]" if settings else "")


def measure(system: str, name: str, args) -> dict:
    shape = SHAPES[name]
    settings = args.settings if system == "trainflow" else {}
    row = {
        "system": system,
        "shape": name,
        "model": shape["model"],
        "batch": shape["batch"],
        "seq": shape["seq"],
        **COMMON,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if settings:  # a variant: its own settings over the side-by-side ones
        row["settings"] = settings
        row["remat"] = settings.get("compute.remat", row["remat"])
        row["param_dtype"] = settings.get("compute.param_dtype", row["param_dtype"])
    if system == "maxtext":
        row["maxtext_overrides"] = maxtext_argv(name, shape, args.warmup + args.steps, "OUT")
    argv = [sys.executable, "-m", "bench.tpu_v5e", "--worker", system, "--shape", name]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += [f"--set={k}={v}" for k, v in settings.items()]
    if args.trace or system == "maxtext":  # MaxText's logged step times run ahead of the chip: its trace times it
        traces = args.trace or Path(tempfile.mkdtemp(prefix="trace-"))
        argv += ["--trace", str(traces / system / variant(name, settings))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if system == "maxtext":
        env["DECOUPLE_GCLOUD"] = "TRUE"
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        return {**row, "error": f"did not finish in {args.timeout} s", "log_tail": str(e.stderr or "")[-1500:]}
    row["process_seconds"] = time.perf_counter() - started
    if proc.returncode != 0:
        return {**row, "error": error_line(proc.stderr), "log_tail": proc.stderr[-1500:]}
    return {**row, **json.loads(proc.stdout.strip().splitlines()[-1])}


def commit() -> str | None:
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        return subprocess.run(git, capture_output=True, text=True, cwd=REPO).stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--systems", default="trainflow,maxtext")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=240, help="seconds for one run's process")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--commit", default=None, help="the commit measured, where the checkout has no git")
    parser.add_argument("--plan", action="store_true", help="record `trainflow plan` for v5e-1 of each shape instead")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE over trainflow's config: a variant")
    parser.add_argument("--trace", type=Path, help="trace 3 more steps of each run under DIR and summarise them")
    parser.add_argument("--worker", choices=["trainflow", "maxtext"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.settings = dict(item.split("=", 1) for item in args.set)
    if args.worker:
        trace_dir = str(args.trace) if args.trace else None
        row = worker(args.worker, args.shape, args.steps, args.warmup, args.settings, trace_dir)
        print(json.dumps(row), flush=True)
        return
    if args.plan:
        planned = plan(args.shapes.split(","), args.settings)
        results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}  # as it is now
        results.setdefault("plan_v5e_1", {}).update(planned)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        return
    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    results.update(date=datetime.date.today().isoformat(), commit=args.commit or commit())
    for round_ in range(args.rounds):
        for name in args.shapes.split(","):
            for system in args.systems.split(","):
                row = measure(system, name, args)
                row["round"] = round_ + 1
                results["runs"].append(row)
                for key in ("device_kind", "jax"):
                    if key in row:
                        results[key] = row[key]
                shown = {k: row.get(k) for k in ("tokens_per_second", "mfu", "peak_hbm_gib", "step_seconds", "error")}
                print(f"{system:9s} {name:30s} {json.dumps(shown)}", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
