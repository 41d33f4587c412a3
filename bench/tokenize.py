"""Throughput of the whole tokenize stage (read, encode, write) against raw `tokenizers`.

Both sides run in the same process on the same text with the same tokenizer: raw
`Tokenizer.encode_batch` (and `encode_batch_fast`) on documents already in memory, and
`run_tokenize` from files on disk to finished shards (workers=1 and workers=N). The corpus
is the Python standard library's sources, present on every machine. The runs alternate
(one of each per round, --repeats rounds), each in a fresh process (bench/__init__.py), and
the table gives the median and the spread; CPU seconds (the process and its workers) are
reported too, as contention skews wall time.

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

from bench import alternate, finish, load_line, machine, summary  # noqa: E402
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


def corpus_texts(corpus: Path) -> list[str]:
    texts = [f.read_bytes().decode("utf-8", "replace") for f in sorted(corpus.glob("*.py"))]
    return [t for t in texts if t and not t.isspace()]


def worker(kind: str, workdir: Path, workers: int, shard_mb: float) -> dict:
    """One timed run in this fresh process: raw `tokenizers` on the documents in memory, or
    the tokenize stage from the files to finished shards."""
    if kind.startswith("raw"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(workdir / "trained" / "tokenizer" / "tokenizer.json"))
        tok.encode_special_tokens = True  # as the stage encodes
        texts = corpus_texts(workdir / "corpus")
        begin, cpu = time.perf_counter(), cpu_seconds()
        encodings = getattr(tok, kind.removeprefix("raw-"))(texts, add_special_tokens=False)
        return {
            "seconds": time.perf_counter() - begin,
            "cpu_seconds": cpu_seconds() - cpu,
            "tokens": sum(len(e.ids) for e in encodings),
        }
    out = workdir / f"stage-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TokenizeConfig(
        sources=[{"format": "text", "path": str(workdir / "corpus" / "*.py")}],
        tokenizer={"path": str(workdir / "trained" / "tokenizer")},
        workers=workers,
        shard_size_mb=shard_mb,
    )
    begin, cpu = time.perf_counter(), cpu_seconds()
    stats = run_tokenize(cfg, out, log=lambda _: None)
    return {
        "seconds": time.perf_counter() - begin,
        "cpu_seconds": cpu_seconds() - cpu,
        "tokens": stats["text_tokens"],
        "documents": stats["documents"],
        "bytes": stats["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size (MB of stdlib sources)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each run of a round is a fresh process")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tokenize.json"))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # kind, workdir, workers
    args = parser.parse_args()
    shard_mb = max(args.mb / 16, 0.25)
    if args.worker:
        kind, workdir, workers = args.worker
        print(json.dumps(worker(kind, Path(workdir), int(workers), shard_mb)))
        return
    import tokenizers

    # The raw side's parallelism is the tokenizer's own thread pool: record what shapes it.
    info = machine(
        tokenizers=tokenizers.__version__,
        **{k.lower(): os.environ[k] for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS") if k in os.environ},
    )

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        stdlib_corpus(tmp / "corpus", args.mb)
        source = {"format": "text", "path": str(tmp / "corpus" / "*.py")}
        started = time.perf_counter()
        setup = run_tokenize(
            TokenizeConfig(sources=[source], tokenizer={"vocab_size": args.vocab}, workers=args.workers),
            tmp / "trained",
            log=lambda _: None,
        )
        train_seconds = time.perf_counter() - started
        texts = corpus_texts(tmp / "corpus")
        documents, text_bytes = len(texts), sum(len(t.encode()) for t in texts)

        common = ["--mb", str(args.mb)]
        runs = {
            "raw encode_batch": ["raw-encode_batch", str(tmp), "1"],
            f"stage workers={args.workers}": ["stage", str(tmp), str(args.workers)],
            "raw encode_batch_fast": ["raw-encode_batch_fast", str(tmp), "1"],
            "stage workers=1": ["stage", str(tmp), "1"],
        }
        results = alternate(
            {name: ["bench.tokenize", *common, "--worker", *argv] for name, argv in runs.items()}, args.repeats
        )
    raw_tokens = results["raw encode_batch"][0]["tokens"]
    for name, rs in results.items():  # every run did the same work
        assert all(
            r.get("documents", documents) == documents
            and r.get("bytes", text_bytes) == text_bytes
            and r["tokens"] == raw_tokens
            for r in rs
        ), name
    info = finish(info)

    base = summary([r["seconds"] for r in results["raw encode_batch"]])["median"]
    base_cpu = summary([r["cpu_seconds"] for r in results["raw encode_batch"]])["median"]
    rows = []
    for name, rs in results.items():
        seconds, cpu = summary([r["seconds"] for r in rs]), summary([r["cpu_seconds"] for r in rs])
        tokens = rs[0]["tokens"]
        rows.append(
            {
                "run": name,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "documents_per_s": round(documents / seconds["median"], 1),
                "tokens_per_s": round(tokens / seconds["median"]),
                "mb_per_s": round(text_bytes / MB / seconds["median"], 3),
                "vs_raw_encode_batch": round(base / seconds["median"], 3),
                "vs_raw_encode_batch_cpu": round(base_cpu / cpu["median"], 3),
            }
        )
    print(
        f"corpus: {documents} stdlib files, {text_bytes / MB:.1f} MB, {results['raw encode_batch'][0]['tokens']} "
        f"tokens; vocab {args.vocab}; medians of {args.repeats} alternating runs"
    )
    print(f"{'run':<24}{'seconds':>9}{'spread':>8}{'cpu s':>8}{'tokens/s':>11}{'MB/s':>7}{'vs raw':>8}{'(cpu)':>7}")
    for r in rows:
        print(
            f"{r['run']:<24}{r['seconds']['median']:>9.2f}{r['seconds']['spread']:>8.1%}"
            f"{r['cpu_seconds']['median']:>8.2f}{r['tokens_per_s']:>11.0f}{r['mb_per_s']:>7.2f}"
            f"{r['vs_raw_encode_batch']:>7.2f}x{r['vs_raw_encode_batch_cpu']:>6.2f}x"
        )
    print(load_line(info))
    result = {
        "command": "python -m bench.tokenize " + " ".join(sys.argv[1:]),
        "machine": info,
        "corpus": {
            "source": "python stdlib *.py",
            "documents": documents,
            "bytes": text_bytes,
            "tokens": results["raw encode_batch"][0]["tokens"],
        },
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
