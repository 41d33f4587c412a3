"""Fine-tuning stages on 2 processes and a bucket (moto S3 on 127.0.0.1): SFT and GRPO read
their config, tokenizer and a corpus input's JSONL at their URLs, and every rank writes its
own checkpoint shards at the artifact's URL.

Split from tests/test_bucket_multihost.py (pretraining's SIGKILL and resume on another layout
at the bucket), whose helpers it shares, so that `pytest -n 2 --dist loadfile` runs the two
side by side.
"""

from __future__ import annotations

import pytest
import yaml

from flows.spec import load_plan
from tasks.runner import RAN, execute_stage
from tasks.store.base import ArtifactStore
from tasks.store.objects import read_url
from tests.conftest import child_xla_flags
from tests.test_bucket_multihost import _staged_checkpoint_files
from tests.test_object_store import boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)

pytestmark = pytest.mark.slow


# The ranks compile as tests/conftest.py has this process compile (child_xla_flags): the tiny
# models spend far more time compiling than running.
QUICKSTART_ON_A_BUCKET = """
name: bucket-posttrain
stages:
  problems:
    task: arithmetic
    config: {seed: 0, max_number: 9, pretrain_problems: 400, sft_problems: 64, rl_problems: 16, eval_problems: 8}
  tokenize:
    task: tokenize
    inputs: {corpus: problems}
    config:
      sources: [{format: text, path: "{input:corpus}/pretrain.txt", unit: line, name: arithmetic}]
      tokenizer: {vocab_size: 300}
  pretrain:
    task: pretrain
    inputs: {dataset: tokenize}
    config: {model: tiny, steps: 2, data: {seq_len: 32, batch_size: 8}, checkpoint: {every_steps: 2, async_save: false}}
  sft:
    task: sft
    inputs: {checkpoint: pretrain, corpus: problems}
    launcher:
      kind: local-multi
      processes: 2
      env: {XLA_FLAGS: "CHILD_XLA_FLAGS"}
    config:
      steps: 2
      mesh: {data: 2}
      data: {path: "{input:corpus}/sft.jsonl", seq_len: 32, batch_size: 4}
      checkpoint: {every_steps: 2, async_save: false}
  grpo:
    task: grpo
    inputs: {checkpoint: sft, corpus: problems}
    launcher:
      kind: local-multi
      processes: 2
      env: {XLA_FLAGS: "CHILD_XLA_FLAGS"}
    config:
      steps: 2
      mesh: {data: 2}
      data: {path: "{input:corpus}/rl.jsonl"}
      rewards: [{function: exact_match, name: correct, kwargs: {pattern: '^\\\\s*(-?\\\\d+)'}}]
      prompts_per_step: 2
      num_generations: 2
      max_prompt_length: 16
      max_completion_length: 3
      checkpoint: {every_steps: 2, async_save: false}
"""


def _keys(client, bucket_name: str, prefix: str) -> list[str]:
    keys, token = [], None
    while True:
        page = client.list_objects_v2(
            Bucket=bucket_name, Prefix=prefix, **({"ContinuationToken": token} if token else {})
        )
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def test_sft_and_grpo_on_two_processes_read_their_inputs_at_the_bucket(
    bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Fine-tuning stages on 2 processes: each rank reads the config, the tokenizer and the JSONL
    of a corpus input at their URLs (the corpus is not the runner's path), and writes its
    checkpoint shards at the artifact's URL."""
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pipeline.yaml"
    path.write_text(QUICKSTART_ON_A_BUCKET.replace("CHILD_XLA_FLAGS", child_xla_flags(1)))
    url = f"s3://{bucket}/posttrain"
    plan, store = load_plan(path, store=url), ArtifactStore(url)
    for name in plan.stages:
        job = plan.resolve(name)
        assert job is not None and execute_stage(job, store).status == RAN, name
    client = boto3.client("s3")
    for name, data_key in {"sft": "path", "grpo": "path"}.items():
        artifact_id = plan.stages[name].job.artifact_id
        config = yaml.safe_load(read_url(f"{url}/{name}/{artifact_id}/{name}.yaml"))
        corpus = f"{url}/problems/{plan.stages['problems'].job.artifact_id}"
        assert config["data"][data_key] == f"{corpus}/{'sft' if name == 'sft' else 'rl'}.jsonl", name
        upstream = "pretrain" if name == "sft" else "sft"
        assert config["tokenizer"] == f"{url}/{upstream}/{plan.stages[upstream].job.artifact_id}/tokenizer", name
        keys = _keys(client, bucket, f"posttrain/{name}/{artifact_id}/checkpoint/2/")
        for process in (0, 1):
            assert any(f"ocdbt.process_{process}/" in key for key in keys), (name, process)
        manifest = store.manifest(name, artifact_id)
        assert manifest["layout"]["processes"] == 2 and manifest["kind"] == "checkpoint"
        parents = [(p["input"], p["stage"]) for p in manifest["parents"]]
        assert parents == [("checkpoint", upstream), ("corpus", "problems")]
        assert manifest["metrics"]["steps"] == 2 and (name == "sft" or "reward" in manifest["metrics"])
        assert {"tokenizer/tokenizer.json", f"{name}.yaml"} <= set(manifest["files"])
    assert _staged_checkpoint_files(tmp_path / "cache") == []
