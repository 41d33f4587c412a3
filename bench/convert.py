"""Checkpoint conversion throughput and peak memory, beside the disk's raw speed.

A synthetic Llama-shaped Hugging Face checkpoint of a few hundred MB (bfloat16, two
safetensors shards and an index) is converted to an Orbax checkpoint and exported back, each
in a child process (`python -m engine.interop.hf ...`) whose peak RSS the kernel reports. In the
same run the disk's raw sequential write (with fsync) and cold read (page cache dropped
with posix_fadvise) are measured on a file of the same size. The source files are dropped
from the page cache before each conversion too, so both sides read from the disk.

Peak RSS is compared with a child that only imports what the converter imports (the
baseline), so "above baseline / model" near 1 means one model in memory, not two.

    python -m bench.convert [--layers 12] [--repeats 2] [--workdir DIR]

Prints a table and writes bench/results/convert.json.
"""

from __future__ import annotations

import os
import sys

# bench/tokenize.py would shadow the standard library's `tokenize`: keep this script's folder
# off the import path, and the repository on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from bench import machine  # noqa: E402
from engine.interop.hf.safetensors_io import write_safetensors  # noqa: E402

GB = 1e9
CHUNK = 64 << 20


def drop_cache(path: Path) -> None:
    """Evict a file's (clean) pages from the page cache, so the next read hits the disk."""
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_speed(directory: Path, nbytes: int) -> dict:
    """Sequential write (+fsync) and cold sequential read of one file of nbytes."""
    block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    path = directory / "disk_probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, CHUNK):
            f.write(block[: min(CHUNK, nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write_seconds": write_s, "read_seconds": read_s, "bytes": nbytes}


def llama_shaped(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }


def write_source(directory: Path, config: dict) -> int:
    """A HF directory with random bfloat16 weights in two shards + index; returns bytes."""
    d, f, v, n, k, h = (
        config[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    )
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (n * h, d),
                p + "self_attn.k_proj.weight": (k * h, d),
                p + "self_attn.v_proj.weight": (k * h, d),
                p + "self_attn.o_proj.weight": (d, n * h),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (v, d)})
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, part in enumerate(halves):
        filename = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = ((name, (0.02 * rng.standard_normal(shapes[name], np.float32)).astype(bf16)) for name in part)
        total += write_safetensors(
            directory / filename, tensors, {"format": "pt"}, shapes={name: (shapes[name], bf16) for name in part}
        )
        weight_map.update({name: filename for name in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(json.dumps(config))
    return total


def run_child(argv: list[str]) -> tuple[dict | None, float, float, float]:
    """(the child's JSON result, wall seconds, peak RSS in MB, CPU seconds) of `python argv...`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.path.dirname(_HERE), text=True
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{argv} failed:\n{err[-2000:]}")
    lines = [line for line in out.splitlines() if line.startswith('{"result":')]
    cpu = usage.ru_utime + usage.ru_stime
    return (json.loads(lines[-1])["result"] if lines else None), wall, usage.ru_maxrss / 1024, cpu


# What the converter's process imports and plans before it reads a weight: the baseline.
BASELINE = (
    "import jax, orbax.checkpoint, numpy, engine.interop.hf.convert, engine.interop.hf.export; "
    "from engine.interop.hf.mapping import model_config_from_hf; "
    "from engine.models.params import abstract_model_params; import json, sys; "
    "abstract_model_params(*model_config_from_hf(json.load(open(sys.argv[1]))), None)"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="model depth (12: ~400 MB in bfloat16)")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()

    info = machine()
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        config = llama_shaped(args.layers)
        source_bytes = write_source(work / "hf", config)
        disk = [disk_speed(work, source_bytes) for _ in range(args.repeats)]
        write_s = min(d["write_seconds"] for d in disk)
        read_s = min(d["read_seconds"] for d in disk)
        _, _, baseline_mb, baseline_cpu = run_child(["-c", BASELINE, str(work / "hf" / "config.json")])

        rows = [
            {"operation": "disk write (sequential, fsync)", "gb": source_bytes / GB, "seconds": write_s},
            {"operation": "disk read (sequential, cold)", "gb": source_bytes / GB, "seconds": read_s},
        ]
        for dtype, model_bytes in (("bfloat16", source_bytes), ("float32", 2 * source_bytes)):
            best = None
            for _ in range(args.repeats):
                out = work / f"converted-{dtype}"
                shutil.rmtree(out, ignore_errors=True)
                drop_cache(work / "hf")
                result, wall, rss, cpu = run_child(
                    ["-m", "engine.interop.hf", "convert", str(work / "hf"), str(out), "--dtype", dtype]
                )
                if best is None or result["seconds"] < best[0]["seconds"]:
                    best = (result, wall, rss, cpu)
            result, wall, rss, cpu = best
            rows.append(
                {
                    "operation": f"convert HF bf16 -> Orbax {dtype}",
                    "gb": source_bytes / GB,
                    "seconds": result["seconds"],
                    "process_seconds": wall,
                    "peak_rss_mb": rss,
                    "cpu_seconds_above_baseline": cpu - baseline_cpu,
                    "model_mb": model_bytes / 1e6,
                }
            )
        best = None
        for _ in range(args.repeats):
            shutil.rmtree(work / "exported", ignore_errors=True)
            drop_cache(work / "converted-bfloat16")
            result, wall, rss, cpu = run_child(
                [
                    "-m",
                    "engine.interop.hf",
                    "export",
                    str(work / "converted-bfloat16" / "checkpoint"),
                    str(work / "exported"),
                ]
            )
            if best is None or result["seconds"] < best[0]["seconds"]:
                best = (result, wall, rss, cpu)
        result, wall, rss, cpu = best
        rows.append(
            {
                "operation": "export Orbax bf16 -> HF bf16",
                "gb": result["bytes"] / GB,
                "seconds": result["seconds"],
                "process_seconds": wall,
                "peak_rss_mb": rss,
                "cpu_seconds_above_baseline": cpu - baseline_cpu,
                "model_mb": source_bytes / 1e6,
            }
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for row in rows:
        row["gb_per_second"] = row["gb"] / row["seconds"]
        if "peak_rss_mb" in row:
            row["above_baseline_per_model"] = (row["peak_rss_mb"] - baseline_mb) / row["model_mb"]
    disk_read = rows[1]["gb_per_second"]
    print(
        f"model: Llama-shaped, {args.layers} layers, {source_bytes / 1e6:.0f} MB bfloat16 in 2 shards; "
        f"baseline RSS (imports) {baseline_mb:.0f} MB; best of {args.repeats}"
    )
    print(
        f"{'operation':34s} {'GB':>6s} {'s':>7s} {'GB/s':>6s} {'vs disk read':>12s} {'CPU s':>6s} "
        f"{'peak RSS MB':>11s} {'(RSS-base)/model':>16s}"
    )
    for row in rows:
        rss = f"{row['peak_rss_mb']:11.0f}" if "peak_rss_mb" in row else f"{'-':>11s}"
        ratio = f"{row['above_baseline_per_model']:16.2f}" if "above_baseline_per_model" in row else f"{'-':>16s}"
        cpu = f"{row['cpu_seconds_above_baseline']:6.2f}" if "cpu_seconds_above_baseline" in row else f"{'-':>6s}"
        print(
            f"{row['operation']:34s} {row['gb']:6.3f} {row['seconds']:7.2f} {row['gb_per_second']:6.2f} "
            f"{row['gb_per_second'] / disk_read:12.2f} {cpu} {rss} {ratio}"
        )
    info["load_average_at_end"] = list(os.getloadavg())
    results = {
        "command": "python -m bench.convert " + " ".join(sys.argv[1:]),
        "machine": info,
        "model": {"shape": config, "source_bytes": source_bytes, "shards": 2},
        "baseline_rss_mb": baseline_mb,
        "baseline_cpu_seconds": baseline_cpu,
        "rows": rows,
        "notes": "seconds of convert/export are engine.interop.hf's own timing (no interpreter start-up); "
        "process_seconds include starting Python and importing JAX; cpu_seconds_above_baseline "
        "is the child's user+sys time minus that of a child that only imports and plans (less "
        "sensitive to other load on a shared machine than wall time).",
    }
    out = Path(_HERE) / "results" / "convert.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.relative_to(Path(_HERE).parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
