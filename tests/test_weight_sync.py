"""The bucket weight sync (engine/interop/weight_sync.py, engine/interop/bucket_weights.py): the
policy's weights to a rollout server on another host through s3:// (moto S3 on 127.0.0.1) or
file://, only the shards whose tensors changed; a reader gets the trainer's bits and never a
version whose manifest was not written; a trainer of 2 processes (jax.distributed, gloo) writes
each shard from one process. With TRAINFLOW_VLLM_PYTHON (tests/test_vllm_rollouts.py), GRPO's
weights reach a real vLLM server through the bucket and its loader.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from engine.config import ConfigError
from engine.data.urls import filesystem
from engine.interop.bucket_weights import MANIFEST, OBJECTS, follow, pull, read_manifest
from engine.interop.hf.export import export_hf, write_hf_model
from engine.interop.hf.safetensors_io import SafetensorsFile
from engine.interop.weight_sync import BucketWeightSync
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import abstract_model_params
from engine.posttrain.config import RolloutCorrectionConfig
from engine.posttrain.rollout_server import RolloutServerConfig
from engine.posttrain.vllm_rollout import run_grpo_on_server
from tasks.launch.run import LauncherSpec, run_child
from tests.conftest import REPO, child_xla_flags
from tests.test_grpo import grpo_config, make_copy_task
from tests.test_object_store import bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)
from tests.test_vllm_rollouts import FIXED, checkpoint_params, engine_logps, needs_vllm, vllm_server

CFG = ModelConfig(
    vocab_size=37, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=24, max_seq_len=16
)
SHARD_BYTES = 3000  # a few tensors a shard: 12 shards of this model


def random_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = abstract_model_params(CFG, ComputeConfig(), None)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)


def changed(params: dict, value: float) -> dict:
    """`params` with one tensor changed: the final norm (Hugging Face's model.norm.weight)."""
    params = jax.tree.map(lambda x: x, params)
    params["final_norm"]["scale"] = params["final_norm"]["scale"] + value
    return params


def tensors_of(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with SafetensorsFile(path) as f:
            out.update({name: f.get(name) for name in f.names()})
    return out


def assert_same_as_local_export(pulled: Path, params: dict, tmp_path: Path) -> None:
    """The pulled directory holds exactly the tensors the local path (write_hf_model) writes, bitwise."""
    local = tmp_path / f"local-{len(list(tmp_path.iterdir()))}"
    write_hf_model(params, CFG, ComputeConfig(), local)
    want, got = tensors_of(local), tensors_of(pulled)
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name
    assert json.loads((pulled / "config.json").read_text()) == json.loads((local / "config.json").read_text())


@pytest.fixture(params=["s3", "file"])
def url(request, tmp_path) -> str:
    if request.param == "file":
        return (tmp_path / "bucket").as_uri()
    name = request.getfixturevalue("bucket")
    return f"s3://{name}/policy"


def test_a_second_sync_rewrites_only_the_changed_shard_and_the_reader_gets_the_trainers_bits(url, tmp_path):
    sync = BucketWeightSync(url, CFG, ComputeConfig(), shard_bytes=SHARD_BYTES)
    params = random_params()
    assert sync.push(params) == 1
    first = sync.last
    assert first["shards"] > 4 and first["shards_written"] == first["shards"]
    server_dir = tmp_path / "server"
    pulled = pull(url, server_dir)
    assert pulled["version"] == 1 and len(pulled["fetched"]) == pulled["files"]
    assert (server_dir / "model.safetensors.index.json").is_file()
    assert_same_as_local_export(server_dir, params, tmp_path)

    # One tensor changed: one shard uploaded, one fetched by the reader.
    params2 = changed(params, 0.5)
    assert sync.push(params2) == 2
    assert sync.last["shards_written"] == 1 and sync.last["bytes_written"] < first["bytes_written"] / 4
    v1, v2 = sync.history
    differ = [name for name, e in v2["files"].items() if v1["files"][name]["key"] != e["key"]]
    assert differ == [next(n for n, e in v2["files"].items() if "model.norm.weight" in e.get("tensors", ()))]
    pulled = pull(url, server_dir)
    assert pulled["version"] == 2 and pulled["fetched"] == differ
    assert_same_as_local_export(server_dir, params2, tmp_path)

    # Unchanged weights: a new version, nothing uploaded. Version 1's own shard is then
    # deleted (two versions are kept), the others stay: version 3 still names them.
    fs, root = filesystem(url)
    old_key = v1["files"][differ[0]]["key"]
    assert fs.exists(f"{root}/{OBJECTS}/{old_key}")
    assert sync.push(params2) == 3 and sync.last["shards_written"] == 0
    assert not fs.exists(f"{root}/{OBJECTS}/{old_key}")
    assert pull(url, server_dir)["fetched"] == []

    # A restarted trainer continues the versions and uploads nothing it finds there.
    again = BucketWeightSync(url, CFG, ComputeConfig(), shard_bytes=SHARD_BYTES)
    assert again.push(params2) == 4 and again.last["shards_written"] == 0


def test_a_staged_version_is_not_read_before_its_manifest_and_a_bad_object_is_refused(url, tmp_path):
    sync = BucketWeightSync(url, CFG, ComputeConfig(), shard_bytes=SHARD_BYTES)
    params = random_params(1)
    sync.push(params)
    # A writer killed after uploading version 2's shards, before its manifest: readers see 1.
    staged = sync.stage(changed(params, 1.0))
    assert sync.last["shards_written"] == 1
    server_dir = tmp_path / "server"
    assert pull(url, server_dir)["version"] == 1
    assert_same_as_local_export(server_dir, params, tmp_path)

    # An object that is not what the manifest names (a truncated upload on a store without
    # atomic writes): refused before it takes the file's name; the reader keeps version 1.
    fs, root = filesystem(url)
    sync.commit(staged)
    manifest = read_manifest(url)
    name = next(n for n, e in manifest["files"].items() if "model.norm.weight" in e.get("tensors", ()))
    key = manifest["files"][name]["key"]
    fs.pipe_file(f"{root}/{OBJECTS}/{key}", fs.cat_file(f"{root}/{OBJECTS}/{key}")[:-4] + b"\0\0\0\1")
    with pytest.raises(ConfigError, match="model.norm.weight is not the one the manifest names"):
        pull(url, server_dir)
    assert_same_as_local_export(server_dir, params, tmp_path)
    assert not [p for p in server_dir.iterdir() if p.name.endswith(".tmp")]

    fs.rm_file(f"{root}/{MANIFEST}")
    with pytest.raises(ConfigError, match="no weights committed yet"):
        pull(url, tmp_path / "elsewhere")


# --------------------------------------------------------------------------- a trainer of 2 processes


def test_a_trainer_of_two_processes_writes_each_shard_from_one_process(bucket, s3_endpoint, tmp_path):  # noqa: F811
    """fsdp spans the 2 processes (one CPU device each): each process uploads the shards k with
    k mod 2 its index, process 0 the manifest; the reader gets what the trainer holds."""
    url = f"s3://{bucket}/policy"
    env = {"XLA_FLAGS": child_xla_flags(1), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    run_child(
        [sys.executable, "-m", "tests.weight_sync_ranks", url, str(tmp_path), str(SHARD_BYTES)],
        launcher=LauncherSpec(kind="local-multi", processes=2, env=env),
        log=lambda line: None,
        cwd=REPO,
    )
    manifest = read_manifest(url)
    assert manifest["version"] == 2 and manifest["processes"] == 2
    writers = {e["writer"] for e in manifest["files"].values() if "tensors" in e}
    assert writers == {0, 1}
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert stats[0] == stats[1]  # every process knows the whole version's numbers
    assert stats[0]["first"]["shards_written"] == stats[0]["first"]["shards"]
    assert stats[0]["second"]["shards_written"] == 1
    with np.load(tmp_path / "params.npz") as saved:
        params = random_params()  # the shapes; the values are the trainer's, gathered by rank 0
        leaves, treedef = jax.tree.flatten(params)
        params = jax.tree.unflatten(treedef, [saved[str(i)] for i in range(len(leaves))])
    pull(url, tmp_path / "server")
    assert_same_as_local_export(tmp_path / "server", params, tmp_path)


# --------------------------------------------------------------------------- a real vLLM server (opt-in)


@pytest.fixture(scope="module")
def served_copy(tmp_path_factory):
    """(copy task, client): the copy task's model (head_dim 64: vLLM's CPU attention refuses 16)
    exported and served by `vllm serve` on 127.0.0.1 (tests/test_vllm_rollouts.py's server)."""
    root = tmp_path_factory.mktemp("vllm")
    cfg = ModelConfig(
        vocab_size=16, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=128, max_seq_len=32
    )
    task = make_copy_task(root / "task", cfg)
    export_hf(task / "checkpoint", root / "hf")
    with vllm_server(root / "hf", root / "server.log") as (client, _):
        yield task, client


@pytest.fixture
def start_loader():
    """Starts the loader beside the server in a thread (on another host: python -m
    engine.interop.bucket_weights); stopped after the test, before the S3 server goes."""
    stop = threading.Event()
    threads = []

    def start(url: str, directory: Path, client) -> None:
        kwargs = {"log": print, "stop": stop}
        threads.append(threading.Thread(target=follow, args=(url, directory, client), kwargs=kwargs, daemon=True))
        threads[-1].start()

    yield start
    stop.set()
    for thread in threads:
        thread.join(10)


@needs_vllm
def test_grpo_weights_reach_a_vllm_server_through_the_bucket(served_copy, bucket, start_loader, tmp_path):  # noqa: F811
    """The server is loaded by its loader from the bucket alone: the first push's probe check
    passes (the server's log-probs are the trainer's, else the run stops), every step's
    importance ratios are 1, and after the run the server holds the trainer's step 1 (what
    step 2 sampled with)."""
    task, client = served_copy
    url, run_dir = f"s3://{bucket}/policy", tmp_path / "run"
    start_loader(url, tmp_path / "server-weights", client)
    run = grpo_config(task, run_dir, steps=2, prompts_per_step=4, num_generations=4, **{"checkpoint.every_steps": 1})
    update = {
        "rollout": RolloutServerConfig(url=client.url, weights_url=url),
        "rollout_correction": RolloutCorrectionConfig(),
    }
    run_grpo_on_server(run.model_copy(update=update))
    after = client.prompt_logprobs(FIXED)
    assert read_manifest(url)["version"] == 2  # one push per step's rollouts
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert abs(row["is_ratio_max"] - 1) < 1e-3 and abs(row["is_ratio_min"] - 1) < 1e-3, row
    params, model_cfg = checkpoint_params(run_dir / "checkpoint", step=1)
    np.testing.assert_allclose(after, engine_logps(params, model_cfg, FIXED), atol=1e-4)


@needs_vllm
def test_grpo_of_two_processes_samples_on_the_server_through_the_bucket(served_copy, bucket, start_loader, tmp_path):  # noqa: F811
    """GRPO on 2 processes (data 2, one CPU device each): both push their shards, process 0 asks
    the server and every process trains on its answer; the ratios are 1 at both steps."""
    task, client = served_copy
    url, run_dir = f"s3://{bucket}/policy", tmp_path / "run"
    start_loader(url, tmp_path / "server-weights", client)
    run = grpo_config(task, run_dir, steps=2, prompts_per_step=4, num_generations=4, **{"checkpoint.every_steps": 1})
    tree = run.model_dump(mode="json", exclude_unset=False)
    tree.update(
        mesh={"data": 2},
        rollout={"url": client.url, "weights_url": url},
        rollout_correction={},
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    env = {"XLA_FLAGS": child_xla_flags(1), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    run_child(
        [sys.executable, "-m", "engine.posttrain.vllm_rollout", str(tmp_path / "run.yaml")],
        launcher=LauncherSpec(kind="local-multi", processes=2, env=env),
        log=print,
        cwd=REPO,
    )
    manifest = read_manifest(url)
    assert manifest["version"] == 2 and manifest["processes"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert abs(row["is_ratio_max"] - 1) < 1e-3 and abs(row["is_ratio_min"] - 1) < 1e-3, row
