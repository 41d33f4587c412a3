"""Throughput of the whole tokenize stage (read, encode, write) against raw `tokenizers`.

Both sides run in the same process on the same text with the same tokenizer: raw
`Tokenizer.encode_batch` (and `encode_batch_fast`) on documents already in memory, and
`run_tokenize` from files on disk to finished shards (workers=1 and workers=N). The corpus
is the Python standard library's sources, present on every machine. Each measurement is
the best of --repeats, interleaved, because the machines are shared and noisy; CPU
seconds (this process and its workers) are reported too, as contention skews wall time.

    python -m bench.tokenize [--mb 8] [--workers 2] [--vocab 8192] [--repeats 3]

Prints a table and writes bench/results/tokenize.json.
"""

from __future__ import annotations

import os
import sys

# This script shares its name with the standard library's `tokenize` (which `inspect`, and
# so numpy, import): keep its own folder off the import path, and the repository on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench import machine  # noqa: E402

from engine.data.tokenize import TokenizeConfig, run_tokenize  # noqa: E402

MB = 1 << 20


def stdlib_corpus(directory: Path, limit_mb: float) -> list[Path]:
    """Links to stdlib .py files (sorted, site-packages left out) up to `limit_mb`."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(f"{root}/**/*.py", recursive=True) if "site-packages" not in f)
    chosen, size = [], 0
    for i, f in enumerate(files):
        if size >= limit_mb * MB:
            break
        link = directory / f"{i:05d}.py"
        link.symlink_to(f)
        chosen.append(link)
        size += os.path.getsize(f)
    return chosen


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the stage's workers)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size (MB of stdlib sources)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tokenize.json"))
    args = parser.parse_args()
    import tokenizers

    info = machine(tokenizers=tokenizers.__version__)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        files = stdlib_corpus(tmp / "corpus", args.mb)
        source = {"format": "text", "path": str(tmp / "corpus" / "*.py")}

        started = time.perf_counter()
        setup = run_tokenize(TokenizeConfig(sources=[source], tokenizer={"vocab_size": args.vocab}, workers=args.workers),
                             tmp / "trained", log=lambda _: None)
        train_seconds = time.perf_counter() - started
        tokenizer_dir = tmp / "trained" / "tokenizer"

        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        tok.encode_special_tokens = True  # as the stage encodes
        texts = [f.read_bytes().decode("utf-8", "replace") for f in files]
        texts = [t for t in texts if t and not t.isspace()]
        documents, text_bytes = len(texts), sum(len(t.encode()) for t in texts)

        def raw(method: str) -> tuple[float, float, int]:
            begin, cpu = time.perf_counter(), cpu_seconds()
            encodings = getattr(tok, method)(texts, add_special_tokens=False)
            return time.perf_counter() - begin, cpu_seconds() - cpu, sum(len(e.ids) for e in encodings)

        def stage(workers: int) -> tuple[float, float, int]:
            out = tmp / f"stage-{workers}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = TokenizeConfig(sources=[source], tokenizer={"path": str(tokenizer_dir)}, workers=workers,
                                 shard_size_mb=max(args.mb / 16, 0.25))
            begin, cpu = time.perf_counter(), cpu_seconds()
            stats = run_tokenize(cfg, out, log=lambda _: None)
            seconds, cpu = time.perf_counter() - begin, cpu_seconds() - cpu
            assert stats["documents"] == documents and stats["bytes"] == text_bytes
            return seconds, cpu, stats["text_tokens"]

        runs = {"raw encode_batch": lambda: raw("encode_batch"),
                "raw encode_batch_fast": lambda: raw("encode_batch_fast"),
                "stage workers=1": lambda: stage(1),
                f"stage workers={args.workers}": lambda: stage(args.workers)}
        best: dict[str, tuple[float, float, int]] = {}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                seconds, cpu, tokens = fn()
                previous = best.get(name)
                best[name] = (min(seconds, previous[0]) if previous else seconds,
                              min(cpu, previous[1]) if previous else cpu, tokens)

    base_seconds, base_cpu, _ = best["raw encode_batch"]
    rows = []
    for name, (seconds, cpu, tokens) in best.items():
        rows.append({
            "run": name, "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
            "documents_per_s": round(documents / seconds, 1), "tokens_per_s": round(tokens / seconds),
            "mb_per_s": round(text_bytes / MB / seconds, 3),
            "vs_raw_encode_batch": round(base_seconds / seconds, 3),
            "vs_raw_encode_batch_cpu": round(base_cpu / cpu, 3),
        })
    header = (f"{'run':<24}{'seconds':>9}{'cpu s':>8}{'docs/s':>9}{'tokens/s':>11}{'MB/s':>7}"
              f"{'vs raw':>8}{'(cpu)':>7}")
    print(f"corpus: {documents} stdlib files, {text_bytes / MB:.1f} MB, {best['raw encode_batch'][2]} tokens; "
          f"vocab {args.vocab}; {info['cpu_count']} CPUs ({info['cpu']})")
    print(header)
    for r in rows:
        print(f"{r['run']:<24}{r['seconds']:>9.2f}{r['cpu_seconds']:>8.2f}{r['documents_per_s']:>9.0f}"
              f"{r['tokens_per_s']:>11.0f}{r['mb_per_s']:>7.2f}{r['vs_raw_encode_batch']:>7.2f}x"
              f"{r['vs_raw_encode_batch_cpu']:>6.2f}x")
    info["load_average_at_end"] = list(os.getloadavg())
    result = {
        "command": "python -m bench.tokenize " + " ".join(sys.argv[1:]),
        "machine": info,
        "corpus": {"source": "python stdlib *.py", "documents": documents, "bytes": text_bytes,
                   "tokens": best["raw encode_batch"][2]},
        "vocab_size": args.vocab,
        "tokenizer_training_stage_seconds": round(train_seconds, 2),
        "tokenizer_training_stage_stats": {k: setup[k] for k in ("documents", "tokens", "bytes")},
        "repeats": args.repeats,
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
