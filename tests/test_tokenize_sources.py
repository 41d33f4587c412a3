"""Every input format of the tokenize stage, mixture weights, and each kind of bad input:
a clear error naming the file and record (before anything is written), or a counted skip."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from test_tokenize import documents, records, run_stage, word_documents, write_lines

from engine.config import ConfigError
from tests.deps import need

# --------------------------------------------------------------------------- formats


def test_text_file_line_and_block_units(tmp_path):
    body = "first line\n\n  second, indented\nstill second\n \t \nthird\n"
    path = tmp_path / "doc.txt"
    path.write_text(body)
    expected = {
        "file": [body],
        "line": ["first line", "  second, indented", "still second", "third"],
        "block": ["first line", "  second, indented\nstill second", "third"],
    }
    for unit, docs in expected.items():
        out = tmp_path / unit
        stats = run_stage(
            out, {"sources": [{"format": "text", "path": str(path), "unit": unit}]}, validation_fraction=0
        )
        assert documents(out) == docs, unit
        assert stats["skipped"] == ({"empty": 2} if unit == "line" else {})  # the blank lines


def test_gzipped_text_and_jsonl(tmp_path):
    docs = word_documents(30)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = tmp_path / "out"
    run_stage(out, {"sources": [{"format": "jsonl", "path": str(tmp_path / "*.jsonl.gz")}]}, validation_fraction=0)
    assert documents(out) == docs


def test_jsonl_cut_into_byte_ranges_reads_each_record_once(tmp_path):
    docs = word_documents(1500)
    write_lines(tmp_path / "a.jsonl", [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)])
    out = tmp_path / "out"
    run_stage(
        out,
        {"sources": [{"format": "jsonl", "path": str(tmp_path / "a.jsonl"), "field": "body"}], "shard_size_mb": 0.01},
        validation_fraction=0,
    )
    assert len(records(out, "train")) == len(docs)
    assert documents(out) == docs  # parts in order, no record lost or doubled at a cut


def test_parquet_is_streamed_by_row_group(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = word_documents(2000)
    table = pa.table({"id": list(range(len(docs))), "content": docs})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=100)
    # Never loaded whole: the whole-file readers are off limits.
    for name in ("read", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, lambda *a, **k: pytest.fail("read whole"))
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read whole"))
    out = tmp_path / "out"
    run_stage(
        out,
        {
            "sources": [{"format": "parquet", "path": str(tmp_path / "*.parquet"), "field": "content"}],
            "shard_size_mb": 0.02,
        },
        validation_fraction=0,
    )
    assert len(list((out / "data" / "train").iterdir())) > 1  # row groups spread over shards
    assert documents(out) == docs


def test_tfrecord_of_tf_examples(tmp_path):
    tf = need("tensorflow")
    docs = word_documents(40)
    with tf.io.TFRecordWriter(str(tmp_path / "a.tfrecord")) as writer:
        for i, doc in enumerate(docs):
            feature = {
                "text": tf.train.Feature(bytes_list=tf.train.BytesList(value=[doc.encode()])),
                "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    out = tmp_path / "out"
    run_stage(out, {"sources": [{"format": "tfrecord", "path": str(tmp_path / "*.tfrecord")}]}, validation_fraction=0)
    assert documents(out) == docs

    with pytest.raises(ConfigError, match=r"sources\[0\]\.field: .*a\.tfrecord, record 0: no feature 'body'"):
        run_stage(
            tmp_path / "bad",
            {"sources": [{"format": "tfrecord", "path": str(tmp_path / "*.tfrecord"), "field": "body"}]},
        )
    assert not (tmp_path / "bad").exists()


def test_tfds_dataset_on_disk(tmp_path):
    tf = need("tensorflow")
    tfds = need("tensorflow_datasets")
    docs = word_documents(30)
    builder = tfds.dataset_builders.TfDataBuilder(
        name="tiny_corpus",
        version="1.0.0",
        data_dir=str(tmp_path / "tfds"),
        split_datasets={
            "train": tf.data.Dataset.from_tensor_slices({"text": docs}),
            "test": tf.data.Dataset.from_tensor_slices({"text": ["held out"]}),
        },
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )
    builder.download_and_prepare()
    out = tmp_path / "out"
    run_stage(out, {"sources": [{"format": "tfds", "path": builder.data_dir}]}, validation_fraction=0)
    assert sorted(documents(out)) == sorted(docs)  # TFDS shuffles on write

    with pytest.raises(ConfigError, match=r"sources\[0\]\.split: .* has no split 'validation' \(splits: "):
        run_stage(tmp_path / "bad", {"sources": [{"format": "tfds", "path": builder.data_dir, "split": "validation"}]})


def test_engine_token_shards_as_a_source(tmp_path):
    docs = word_documents(200)
    first = tmp_path / "first"
    run_stage(
        first,
        {"sources": [{"format": "text", "path": str(write_lines(tmp_path / "a.txt", docs)), "unit": "line"}]},
        validation_fraction=0.2,
    )
    second = tmp_path / "second"
    stats = run_stage(
        second,
        {"sources": [{"format": "tokens", "path": str(first / "data")}], "tokenizer": {"vocab_size": 300}},
        validation_fraction=0.2,
    )
    assert sorted(documents(second)) == sorted(docs)  # decoded with the first tokenizer, re-encoded
    assert set(documents(second, "validation")) == set(documents(first, "validation"))
    assert stats["documents"] == len(docs)


def test_mixture_weights_repeat_and_sample_documents(tmp_path):
    often, rare = word_documents(300, seed=1), word_documents(300, seed=2)
    sources = [
        {"format": "text", "path": str(write_lines(tmp_path / "often.txt", often)), "unit": "line", "weight": 2},
        {"format": "text", "path": str(write_lines(tmp_path / "rare.txt", rare)), "unit": "line", "weight": 0.5},
    ]
    out = tmp_path / "out"
    stats = run_stage(out, {"sources": sources}, validation_fraction=0.1)
    written = documents(out)
    assert all(written.count(d) == 2 for d in often)
    kept = [d for d in rare if d in written]
    assert all(written.count(d) == 1 for d in kept)
    assert 0.4 < len(kept) / len(rare) < 0.6
    assert stats["weighted_out"] == len(rare) - len(kept)
    assert stats["sources"][0]["token_share"] > 0.75
    again = tmp_path / "again"
    run_stage(again, {"sources": sources, "tokenizer": {"path": str(out / "tokenizer")}}, validation_fraction=0.1)
    assert documents(again) == written  # the sample is a function of the text, not chance


# --------------------------------------------------------------------------- bad input


def test_invalid_utf8_is_replaced_or_skipped_and_counted(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"good line\nbad \xff\xfe line\ncaf\xc3\xa9\n")
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"text": "lone \\ud800 surrogate"}\n{"text": "fine"}\n')
    sources = [{"format": "text", "path": str(path), "unit": "line"}, {"format": "jsonl", "path": str(lines)}]

    out = tmp_path / "replace"
    stats = run_stage(out, {"sources": sources}, validation_fraction=0)
    assert documents(out) == ["good line", "bad \ufffd\ufffd line", "café", "lone \ufffd surrogate", "fine"]
    assert stats["invalid_utf8_replaced"] == 2 and stats["skipped"] == {}

    out = tmp_path / "skip"
    stats = run_stage(out, {"sources": sources}, validation_fraction=0, invalid_utf8="skip")
    assert documents(out) == ["good line", "café", "fine"]
    assert stats["skipped"] == {"invalid_utf8": 2} and stats["records_read"] == 5


def test_a_binary_file_given_as_text_is_refused_naming_it(tmp_path):
    """Decoded with replacement characters it made a complete dataset of U+FFFD; a NUL byte
    marks it binary (as git and grep judge), and no dataset is written."""
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    good = {"format": "text", "path": str(write_lines(tmp_path / "good.txt", ["fine"]))}
    with pytest.raises(ConfigError, match=re.escape(f"{binary}: binary data (a NUL byte), not text")):
        run_stage(tmp_path / "out", {"sources": [good, {"format": "text", "path": str(binary)}]})
    assert not (tmp_path / "out" / "data").exists() and not (tmp_path / "out" / "tokenizer").exists()


def test_empty_documents_are_skipped_and_counted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lines(tmp_path / "a.jsonl", [json.dumps({"text": t}) for t in ["one", "", "  \n ", "two"]] + [""])
    pq.write_table(pa.table({"text": ["three", None, ""]}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    stats = run_stage(
        out,
        {
            "sources": [
                {"format": "jsonl", "path": str(tmp_path / "a.jsonl")},
                {"format": "parquet", "path": str(tmp_path / "b.parquet")},
            ]
        },
        validation_fraction=0,
    )
    assert documents(out) == ["one", "two", "three"]
    assert stats["skipped"] == {"empty": 4, "null": 1}
    assert stats["records_read"] == 8


def test_long_documents_are_split_or_truncated_and_counted(tmp_path):
    doc = " ".join(f"word{i}" for i in range(200))
    source = {"format": "text", "path": str(write_lines(tmp_path / "a.txt", [doc, "short"])), "unit": "line"}
    out = tmp_path / "split"
    stats = run_stage(out, {"sources": [source]}, validation_fraction=0, max_document_tokens=16)
    pieces = records(out, "train")
    assert len(pieces) > 3 and all(len(r) <= 16 for r in pieces)
    assert "".join(documents(out)) == doc + "short"  # the pieces put back together
    assert stats["long_documents"] == {"split": 1, "truncated": 0, "tokens_dropped": 0}

    out = tmp_path / "truncate"
    stats = run_stage(
        out,
        {"sources": [source], "tokenizer": {"path": str(tmp_path / "split" / "tokenizer")}},
        validation_fraction=0,
        max_document_tokens=16,
        long_documents="truncate",
    )
    first, short = documents(out)
    assert doc.startswith(first) and len(first) < len(doc) and short == "short"
    assert len(records(out, "train")[0]) == 16
    assert stats["long_documents"]["truncated"] == 1
    doc_tokens = sum(len(r) - 2 for r in pieces[:-1])  # bos/eos off every piece of the split run
    assert stats["long_documents"]["tokens_dropped"] == doc_tokens - 14


def test_malformed_records_stop_the_run_or_are_skipped(tmp_path):
    write_lines(
        tmp_path / "a.jsonl",
        ['{"text": "ok"}', '{"text": 3}', "not json", '{"other": "x"}', "[1]", '{"text": "also ok"}'],
    )
    source = {"format": "jsonl", "path": str(tmp_path / "a.jsonl")}
    with pytest.raises(ConfigError, match=r"a\.jsonl, line 2: field 'text' is a int, not a string \(set bad_records"):
        run_stage(tmp_path / "error", {"sources": [source]})
    assert not (tmp_path / "error" / "data").exists()

    out = tmp_path / "skip"
    stats = run_stage(out, {"sources": [source]}, bad_records="skip", validation_fraction=0)
    assert documents(out) == ["ok", "also ok"]
    assert stats["skipped"] == {"not_text": 1, "malformed": 2, "missing_field": 1}


@pytest.mark.parametrize("case", ["jsonl_field", "parquet_column", "glob", "parquet_file", "gzip", "tfds_dir"])
def test_bad_input_fails_before_anything_is_written(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lines(tmp_path / "a.jsonl", ['{"body": "x"}'])
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    source, message = {
        "jsonl_field": (
            {"format": "jsonl", "path": str(tmp_path / "a.jsonl")},
            r"sources\[0\]\.field: .*a\.jsonl, line 1 has no field 'text' \(fields: body\)",
        ),
        "parquet_column": (
            {"format": "parquet", "path": str(tmp_path / "a.parquet")},
            r"sources\[0\]\.field: .*a\.parquet has no column 'text' \(columns: body\)",
        ),
        "glob": (
            {"format": "text", "path": str(tmp_path / "*.md")},
            r"sources\[0\]\.path: '.*\*\.md' matches no files",
        ),
        "parquet_file": (
            {"format": "parquet", "path": str(tmp_path / "broken.parquet")},
            r"sources\[0\]: .*broken\.parquet is not a readable Parquet file",
        ),
        "gzip": (
            {"format": "text", "path": str(tmp_path / "broken.txt.gz")},
            r"sources\[0\]: cannot read .*broken\.txt\.gz",
        ),
        "tfds_dir": ({"format": "tfds", "path": str(tmp_path)}, r"sources\[0\]\.path: .* is not a prepared TFDS"),
    }[case]
    good = {"format": "text", "path": str(write_lines(tmp_path / "good.txt", ["fine"]))}
    with pytest.raises(ConfigError, match=message):
        run_stage(tmp_path / "out", {"sources": [source, good]})
    assert not (tmp_path / "out").exists()


def test_a_corpus_with_no_usable_documents_is_an_error(tmp_path):
    write_lines(tmp_path / "a.txt", ["", "   ", ""])
    source = {"format": "text", "path": str(tmp_path / "a.txt"), "unit": "line"}
    named = re.escape(f"the corpus ({tmp_path / 'a.txt'}) has no usable documents (skipped empty: 3)")
    with pytest.raises(ConfigError, match=named):
        run_stage(tmp_path / "trained", {"sources": [source]})
    with pytest.raises(ConfigError, match="no usable documents"):  # no training pass to notice it early
        run_stage(tmp_path / "loaded", {"sources": [source], "tokenizer": {"path": str(_any_tokenizer(tmp_path))}})
    for out in ("trained", "loaded"):
        assert not (tmp_path / out / "data").exists() and not (tmp_path / out / "tokenizer").exists()


def test_source_keys_that_do_not_apply_to_the_format_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="'unit' applies to format text, not jsonl"):
        run_stage(tmp_path / "out", {"sources": [{"format": "jsonl", "path": "x", "unit": "line"}]})


def _any_tokenizer(tmp_path: Path) -> Path:
    out = tmp_path / "base"
    run_stage(out, {"sources": [{"format": "text", "path": str(write_lines(tmp_path / "t.txt", ["some text"]))}]})
    return out / "tokenizer"
