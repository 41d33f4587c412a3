"""The engine's inputs read at a bucket URL (moto S3 on 127.0.0.1): token shards, JSONL, a
tokenizer folder, a config, each read by the process itself (engine/data/urls.py), so the
ranks of a stage on a bucket store share no disk with the runner."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from engine.config import ConfigError
from engine.data import urls
from engine.data.pipeline import make_dataset
from engine.data.shards import open_split, write_dataset
from engine.posttrain.finetune import read_jsonl
from tests.test_object_store import boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)


def _upload(client, bucket_name: str, local, prefix: str) -> str:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.put_object(
                Bucket=bucket_name, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes()
            )
    return f"s3://{bucket_name}/{prefix}"


@pytest.fixture
def host_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(urls.CACHE_ENV, str(tmp_path / "host-cache"))
    return tmp_path / "host-cache"


def test_token_shards_at_a_url_give_the_local_batches_each_shard_fetched_when_first_read(
    bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    host_cache,
):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 250, size=rng.integers(3, 40)) for _ in range(37)]
    local = tmp_path / "data"
    meta = write_dataset(local, {"train": docs, "validation": docs[:5]}, vocab_size=256, docs_per_shard=10)
    assert meta["splits"]["train"]["shard_documents"] == [10, 10, 10, 7]
    url = _upload(boto3.client("s3"), bucket, local, "datasets/d0/data")

    source = open_split(url, "train")
    assert len(source) == 37 and not list(host_cache.glob("*.array_record"))  # counts from meta.json
    assert source[25] == np.asarray(docs[25], "<i4").tobytes()
    assert len(list(host_cache.glob("*shard-00002.array_record"))) == 1  # only the shard read
    assert len(list(host_cache.glob("*.array_record"))) == 1

    kwargs = dict(seq_len=16, batch_size=4, seed=3)
    want = [b for _, b in zip(range(6), make_dataset(local, "train", **kwargs))]
    got = [b for _, b in zip(range(6), make_dataset(url, "train", **kwargs))]
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    # A shard listed in meta.json but gone from the bucket: one sentence naming it.
    boto3.client("s3").delete_object(Bucket=bucket, Key="datasets/d0/data/train/shard-00001.array_record")
    with pytest.raises(ConfigError, match=r"shard listed in meta.json is missing: s3://.*/train/shard-00001"):
        open_split(url, "train")
    with pytest.raises(ConfigError, match=r"no token dataset at s3://.*/nowhere"):
        open_split(f"s3://{bucket}/nowhere", "train")


def test_jsonl_a_tokenizer_folder_and_a_config_read_at_a_url(bucket, s3_endpoint, tmp_path, host_cache):  # noqa: F811
    client = boto3.client("s3")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n\n{"prompt": "2+2="}\n')
    (folder / "b.jsonl").write_text('{"prompt": "3+3="}\n')
    (folder / "notes.txt").write_text("not read")
    url = _upload(client, bucket, folder, "corpus")
    records = read_jsonl(url)
    assert [where.rsplit("/", 1)[-1] for where, _ in records] == ["a.jsonl:1", "a.jsonl:3", "b.jsonl:1"]
    assert read_jsonl(f"{url}/b.jsonl") == [(f"{url}/b.jsonl:1", {"prompt": "3+3="})]
    client.put_object(Bucket=bucket, Key="corpus/bad/c.jsonl", Body=b'{"prompt": 1}\n[2]\n')
    with pytest.raises(ConfigError, match=r"s3://.*/bad/c.jsonl:2: expected a JSON object"):
        read_jsonl(f"{url}/bad")

    # A folder is copied once per version of its files; a rewritten file gives a new copy.
    first = urls.local_folder(url)
    assert sorted(p.name for p in first.iterdir()) == ["a.jsonl", "b.jsonl", "notes.txt"]
    assert urls.local_folder(url) == first
    client.put_object(Bucket=bucket, Key="corpus/notes.txt", Body=b"rewritten")
    second = urls.local_folder(url)
    assert second != first and (second / "notes.txt").read_text() == "rewritten"
    assert urls.existing_folder(f"s3://{bucket}/no-such-folder") is None
    assert not [p for p in host_cache.iterdir() if p.name.startswith(".")]  # no half-written copy left

    # The engine's CLI reads its config at a URL, naming it in errors.
    from engine.train.cli import run_cli
    from engine.train.config import TrainConfig

    client.put_object(Bucket=bucket, Key="cfg/bad.yaml", Body=b"model: [unclosed\n")
    seen = []
    code = run_cli([f"s3://{bucket}/cfg/bad.yaml"], "engine.train", TrainConfig, seen.append)
    assert code == 2 and not seen
    good = {"model": {"preset": "tiny"}, "steps": 3}
    client.put_object(Bucket=bucket, Key="cfg/good.yaml", Body=yaml.safe_dump(good).encode())
    assert (
        run_cli(
            [f"s3://{bucket}/cfg/good.yaml", "steps=5"], "engine.train", TrainConfig, lambda c: seen.append(c) or {}
        )
        == 0
    )
    assert [cfg.steps for cfg in seen] == [5]
    assert seen[0].model.num_layers >= 1  # the preset was resolved
