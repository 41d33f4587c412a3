"""The tokenize stage end to end: lossless round trip on real text, a split that depends only
on the documents, the same output for any worker count, resume after SIGKILL, the CLI.

Helpers here are shared with test_tokenize_sources.py and test_tokenize_tokenizer.py.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from engine.config import ConfigError, load_config
from engine.data.pipeline import make_dataset
from engine.data.shards import TOKEN_DTYPE, read_meta
from engine.data.tokenize import WORKERS_PER_PROCESS, TokenizeConfig, run_tokenize

REPO = Path(__file__).resolve().parent.parent
STDLIB = sysconfig.get_paths()["stdlib"]


# --------------------------------------------------------------------------- helpers


def run_stage(out: Path, tree: dict, **overrides) -> dict:
    """run_tokenize on a config tree (validated like a YAML file), quietly.

    With helper processes (more workers than one process runs) it runs as the stage does, as
    `python -m engine.data.tokenize` in a fresh process: spawned helpers re-import their
    parent's __main__, and the test runner's process is no place for them (its JAX and
    Prefect state).
    """
    tree = {"tokenizer": {"vocab_size": 400}, "workers": 1, **tree, **overrides}
    cfg = load_config(tree=tree, schema=TokenizeConfig)
    if cfg.workers <= WORKERS_PER_PROCESS:
        return run_tokenize(cfg, out, log=lambda _: None)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(tree))
    proc = subprocess.run(
        [sys.executable, "-m", "engine.data.tokenize", str(config), str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return read_meta(out / "data")["stats"]


def records(out: Path, split: str) -> list[np.ndarray]:
    from array_record.python.array_record_module import ArrayRecordReader

    result = []
    for rel in read_meta(out / "data")["splits"][split]["shards"]:
        reader = ArrayRecordReader(str(out / "data" / rel))
        result += [np.frombuffer(r, TOKEN_DTYPE) for r in reader.read_all()]
        reader.close()
    return result


def documents(out: Path, split: str | None = None) -> list[str]:
    """Every record decoded with the saved tokenizer, bos/eos stripped (checked), file order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    meta = read_meta(out / "data")
    texts = []
    for name in [split] if split else ["train", "validation"]:
        for record in records(out, name):
            assert record[-1] == meta["eos_id"]
            body = record[1:-1] if meta["add_bos"] else record[:-1]
            if meta["add_bos"]:
                assert record[0] == meta["bos_id"]
            texts.append(tok.decode(body.tolist(), skip_special_tokens=False))
    return texts


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def word_documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["data", "token", "shard", "pipeline", "model", "train", "é", "数据", "λ", "x=1;", "  "]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + f" #{i}" for i in range(count)]


# --------------------------------------------------------------------------- the stage


def test_stdlib_round_trips_losslessly_and_loads_in_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "out"
    stats = run_stage(
        out,
        {
            "sources": [
                {"format": "text", "path": "{stdlib}/[a-c]*.py"},
                {"format": "text", "path": "{stdlib}/json/*.py", "name": "json", "weight": 1},
            ],
            "tokenizer": {"vocab_size": 1000},
            "validation_fraction": 0.2,
        },
    )
    files = sorted(glob.glob(f"{STDLIB}/[a-c]*.py")) + sorted(glob.glob(f"{STDLIB}/json/*.py"))
    texts = [Path(f).read_text(encoding="utf-8") for f in files]

    hf = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    meta = read_meta(out / "data")
    decoded = []
    for split in ("train", "validation"):
        for record in records(out, split):
            assert record[0] == meta["bos_id"] == hf.bos_token_id
            assert record[-1] == meta["eos_id"] == hf.eos_token_id
            decoded.append(hf.decode(record[1:-1].tolist()))
    assert sorted(decoded) == sorted(texts)  # byte-level BPE loses nothing
    assert hf.decode(hf(texts[0])["input_ids"][1:]) == texts[0]  # transformers encodes alike

    assert stats["documents"] == len(files) and stats["skipped"] == {}
    assert stats["bytes"] == sum(len(t.encode()) for t in texts)
    assert meta["vocab_size"] == len(hf) == 1000
    assert meta["pad_id"] == hf.pad_token_id
    assert 0 < meta["splits"]["validation"]["documents"] < len(files)
    assert sum(meta["splits"][s]["tokens"] for s in ("train", "validation")) == stats["tokens"]
    assert sum(stats["length_histogram"]["documents"]) == len(files)
    assert [s["name"] for s in stats["sources"]] == ["text:{stdlib}/[a-c]*.py", "json"]
    assert not (out / ".work").exists()

    # The engine's Grain pipeline reads the shards.
    batch = next(iter(make_dataset(out / "data", "train", seq_len=32, batch_size=2, shuffle=False)))
    assert batch["tokens"].shape == (2, 32) and batch["tokens"].max() < meta["vocab_size"]


def test_special_token_text_in_a_document_stays_text(tmp_path):
    doc = "a literal <|eos|> and <|user|> inside a document"
    out = tmp_path / "out"
    run_stage(
        out,
        {
            "sources": [{"format": "text", "path": str(write_lines(tmp_path / "a.txt", [doc])), "unit": "line"}],
            "validation_fraction": 0,
        },
    )
    (record,) = records(out, "train")
    meta = read_meta(out / "data")
    assert list(record).count(meta["eos_id"]) == 1  # only the real document end
    assert documents(out) == [doc]


def test_split_depends_only_on_each_document(tmp_path):
    docs = word_documents(1500)
    write_lines(tmp_path / "ordered.txt", docs)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    for i in range(3):
        write_lines(tmp_path / f"shuffled-{i}.txt", shuffled[i::3])
    common = {"validation_fraction": 0.1}
    a = tmp_path / "a"
    run_stage(a, {"sources": [{"format": "text", "path": str(tmp_path / "ordered.txt"), "unit": "line"}]}, **common)
    b = tmp_path / "b"
    run_stage(
        b,
        {
            "sources": [{"format": "text", "path": str(tmp_path / "shuffled-*.txt"), "unit": "line"}],
            "tokenizer": {"path": str(a / "tokenizer")},
            "shard_size_mb": 0.01,
        },
        **common,
    )

    validation = set(documents(a, "validation"))
    assert validation == set(documents(b, "validation"))
    assert validation.isdisjoint(documents(a, "train"))
    assert sorted(documents(a)) == sorted(docs)
    assert 0.07 < len(validation) / len(docs) < 0.13

    c = tmp_path / "c"
    run_stage(
        c,
        {
            "sources": [{"format": "text", "path": str(tmp_path / "ordered.txt"), "unit": "line"}],
            "tokenizer": {"path": str(a / "tokenizer")},
            "split_seed": 1,
        },
        **common,
    )
    assert set(documents(c, "validation")) != validation


def test_output_is_identical_for_any_worker_count(tmp_path):
    write_lines(tmp_path / "big.jsonl", [json.dumps({"text": d}) for d in word_documents(600)])
    tree = {
        "sources": [
            {"format": "text", "path": "{stdlib}/email/*.py"},
            {"format": "jsonl", "path": str(tmp_path / "big.jsonl")},
        ],
        "shard_size_mb": 0.05,  # ~10 shards; the JSONL file is cut into byte ranges
        "validation_fraction": 0.1,
    }
    one, two, many = tmp_path / "one", tmp_path / "two", tmp_path / "many"
    stats_one = run_stage(one, tree, workers=1)
    stats_two = run_stage(two, tree, workers=2)  # two threads
    stats_many = run_stage(many, tree, workers=WORKERS_PER_PROCESS + 2)  # threads here and in a helper process
    assert len(read_meta(one / "data")["splits"]["train"]["shards"]) >= 8
    assert tree_bytes(one) == tree_bytes(two) == tree_bytes(many)
    assert stats_one["documents"] == stats_two["documents"] == stats_many["documents"] == 20 + 600


@pytest.mark.parametrize("workers", [3, WORKERS_PER_PROCESS + 1])
def test_a_failing_task_fails_the_stage_with_its_error(tmp_path, workers):
    for i in range(12):
        write_lines(tmp_path / f"part-{i:02d}.jsonl", [json.dumps({"text": d}) for d in word_documents(20, seed=i)])
    tree = {"sources": [{"format": "jsonl", "path": str(tmp_path / "part-*.jsonl")}], "shard_size_mb": 0.001}
    run_stage(tmp_path / "clean", tree)  # its tokenizer, so that the bad record is met by a task, not by training
    with open(tmp_path / "part-07.jsonl", "a") as f:
        f.write("not json\n")
    tree["tokenizer"] = {"path": str(tmp_path / "clean" / "tokenizer")}
    # In this process the error is raised; from the stage's CLI (a helper process's error) it is printed.
    error = ConfigError if workers <= WORKERS_PER_PROCESS else AssertionError
    with pytest.raises(error, match=r"part-07\.jsonl, line 21: "):
        run_stage(tmp_path / "out", tree, workers=workers)
    assert not (tmp_path / "out" / "data").exists()


def _config_file(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "tokenize.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = word_documents(2400, seed=3)
    for i in range(40):
        write_lines(corpus / f"part-{i:02d}.txt", docs[i::40])
    config = _config_file(
        tmp_path,
        {
            "sources": [{"format": "text", "path": str(corpus / "*.txt"), "unit": "line"}],
            "tokenizer": {"vocab_size": 400},
            "shard_size_mb": 0.001,
            "validation_fraction": 0.05,
        },
    )
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.data.tokenize", str(config), str(out), "workers=2"],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if len(list((out / ".work" / "tasks").glob("task-*.json"))) >= 3:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage and its workers, mid-run
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert not (out / "data" / "meta.json").exists()
    task_files = list((out / ".work" / "tasks").glob("task-*.json"))
    done = len(task_files)
    assert 3 <= done < 40
    finished = {
        rel: (out / ".work" / "data" / rel).stat().st_ino
        for task in task_files
        for rel in json.loads(task.read_text())["shards"].values()
    }

    stats = run_tokenize(load_config(config, ["workers=1"], schema=TokenizeConfig), out, log=lambda _: None)
    assert stats["resumed_shards"] == done
    reference = tmp_path / "reference"
    run_tokenize(load_config(config, ["workers=1"], schema=TokenizeConfig), reference, log=lambda _: None)
    assert tree_bytes(out) == tree_bytes(reference)
    # A shard finished before the kill was moved into place, never rewritten.
    assert finished and all((out / "data" / rel).stat().st_ino == inode for rel, inode in finished.items())


def test_rerun_of_a_finished_stage_is_a_no_op_and_a_changed_config_is_refused(tmp_path):
    source = {"format": "text", "path": str(write_lines(tmp_path / "a.txt", word_documents(50))), "unit": "line"}
    out = tmp_path / "out"
    first = run_stage(out, {"sources": [source]})
    before = tree_bytes(out)
    again = run_stage(out, {"sources": [source]}, workers=2)  # workers do not change the output
    assert again["documents"] == first["documents"] and tree_bytes(out) == before
    with pytest.raises(ConfigError, match="another config"):
        run_stage(out, {"sources": [source]}, validation_fraction=0.5)


def test_cli_reports_a_user_error_in_one_line(tmp_path):
    config = _config_file(tmp_path, {"sources": [{"format": "text", "path": str(tmp_path / "none-*.txt")}]})
    result = subprocess.run(
        [sys.executable, "-m", "engine.data.tokenize", str(config), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.strip() == f"error: sources[0].path: '{tmp_path}/none-*.txt' matches no files"
    assert not (tmp_path / "out").exists()

    result = subprocess.run(
        [sys.executable, "-m", "engine.data.tokenize", str(config), str(tmp_path / "out"), "validation_fraktion=0.1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "did you mean 'validation_fraction'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_output_counts_documents_and_records_alike_in_short_lines(tmp_path):
    """What the stage prints: documents read, and records written (a long document becomes
    several) per split, said as such, on lines a log view shows whole (at most 160 characters)."""
    long_doc = " ".join(f"word{i}" for i in range(300))
    docs = [long_doc, *word_documents(40)]
    source = {"format": "text", "path": str(write_lines(tmp_path / "a.txt", docs)), "unit": "line"}
    tree = {"sources": [source], "tokenizer": {"vocab_size": 400}, "validation_fraction": 0.2}
    config = _config_file(tmp_path, {**tree, "max_document_tokens": 32, "workers": 1})
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "engine.data.tokenize", str(config), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 160, [line for line in lines if len(line) > 160]
    written = {split: len(records(out, split)) for split in ("train", "validation")}
    assert sum(written.values()) > len(docs)  # the long document's pieces
    text = "\n".join(lines)
    pieced = read_meta(out / "data")["stats"]["long_documents"]["split"]
    assert f"{len(docs)} documents" in text
    assert f"{sum(written.values())} records ({pieced} long documents split)" in text
    for split, count in written.items():
        assert f"{split} {count} records" in text


def test_shipped_tokenize_configs_validate_and_find_their_files():
    from engine.data.sources import plan_source

    configs = sorted((REPO / "configs" / "tokenize").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path, schema=TokenizeConfig)
        for index, source in enumerate(cfg.sources):
            parts = plan_source(index, source, 64 << 20)
            assert parts and not any("site-packages" in p.path for p in parts), path
