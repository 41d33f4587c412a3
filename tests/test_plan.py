"""The preflight (`trainflow plan`, `python -m engine.train CONFIG --plan`): what it reports is
the compiled step's memory analysis, a step too big for the target is refused naming the
numbers and the knobs, and the trainer refuses one too big for its devices before any state
exists. The llama3.1-8b pair compiles for TPU topologies through libtpu on this CPU host."""

import importlib.util
import math
import re

import jax
import pytest
import yaml

from engine.config import ConfigError, load_config
from engine.contract import EXIT_CONFIG_ERROR, EXIT_FAILED
from engine.train import pretrain
from engine.train.config import TrainConfig
from engine.train.memory import device_memory
from engine.train.plan import plan_step
from engine.train.targets import get_target
from engine.train.trainer import Trainer, lm_batch
from flows import cli

TINY = {"model": "tiny", "data": {"seq_len": 128, "batch_size": 16}, "steps": 3}
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


def write(path, tree) -> str:
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_unknown_target_is_one_sentence_listing_the_valid_ones(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"unknown target 'v5e-9'; valid targets: local, v4-8, .*v5e-16, .*h100x8"):
        get_target("v5e-9")
    code = pretrain.main([write(tmp_path / "run.yaml", TINY), "--plan", "--target", "v5e-9"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG_ERROR and len(err.splitlines()) == 1 and "v6e-8" in err


def test_local_plan_reports_the_memory_analysis_of_the_step_the_trainer_compiles():
    cfg = load_config(tree=TINY, schema=TrainConfig)
    plan = plan_step(cfg, get_target("local"))
    analysis = plan.compiled.memory_analysis()
    trainer = Trainer(cfg)
    trainer.compile_train_step(lm_batch(16, 128))
    theirs = trainer._compiled_step[1].memory_analysis()
    m = plan.memory
    assert plan.how == "compiled" and plan.devices == len(jax.devices()) and plan.fits
    assert (m.argument, m.output, m.alias, m.temporaries, m.generated_code) == (
        analysis.argument_size_in_bytes, analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
        analysis.temp_size_in_bytes, analysis.generated_code_size_in_bytes)
    assert (theirs.argument_size_in_bytes, theirs.temp_size_in_bytes) == (m.argument, m.temporaries)
    # The split of the arguments: parameters, Adam's two moments (+ step counts), the batch's shard.
    assert m.parameters + m.optimizer_state + m.batch == m.argument
    assert m.optimizer_state == pytest.approx(2 * m.parameters, abs=64)
    assert m.batch == 16 // len(jax.devices()) * 128 * 4 * 5
    assert m.total == m.argument + m.output - m.alias + m.temporaries + m.generated_code


def test_the_trainer_refuses_a_step_too_big_for_its_devices_before_any_state(tmp_path, byte_dataset, capsys):
    """Replicated parameters (mesh data=8) larger than a device's share of this host's memory:
    refused at compile time, exit 2 (retrying cannot help), naming the numbers and the knobs."""
    capacity = device_memory(jax.devices()[0])
    vocab = 128 * math.ceil(capacity / (2 * 64 * 4) / 128)  # untied embedding + head, float32: > capacity
    tree = {**TINY, "model": {"preset": "tiny", "vocab_size": vocab, "tie_embeddings": False},
            "data": {**TINY["data"], "path": str(byte_dataset)}, "checkpoint": {"directory": str(tmp_path / "ck")},
            "progress": False}
    code = pretrain.main([write(tmp_path / "run.yaml", tree)])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR
    assert f"each of the 8 cpu devices has {capacity / 2**30:.2f} GiB" in err
    assert "parameters" in err and "mesh.fsdp" in err and "compute.remat" in err and "data.batch_size" in err
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_gpu_host_without_its_gpus_is_an_estimate_that_says_so():
    cfg = load_config(tree={**TINY, "model": "llama3.1-8b", "mesh": {"data": 1, "fsdp": -1},
                            "data": {"seq_len": 2048, "batch_size": 8}}, schema=TrainConfig)
    plan = plan_step(cfg, get_target("h100x8"))
    params = cfg.model.num_params()
    assert plan.how == "estimate (no GPU here)" and plan.devices == 8 and plan.fits
    assert plan.memory.parameters == pytest.approx(4 * params / 8, rel=1e-3)  # float32, fully sharded over 8
    assert plan.memory.optimizer_state == pytest.approx(2 * plan.memory.parameters, rel=1e-3)
    with pytest.raises(ConfigError, match=r"--target h100x8: mesh data=1 .*fsdp=3 .* does not fit its 8 devices"):
        plan_step(cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"fsdp": 3, "data": 1})}),
                  get_target("h100x8"))


# --------------------------------------------------------------------------- llama3.1-8b on TPU slices


def pipeline_8b(tmp_path) -> str:
    return write(tmp_path / "pipeline.yaml", {
        "name": "plan8b", "store": str(tmp_path / "store"),
        "stages": {
            "tokenize": {"task": "tokenize", "config": {
                "sources": [{"format": "text", "path": "{stdlib}/a*.py", "name": "stdlib-a"}],
                "tokenizer": {"vocab_size": 512}}},
            "pretrain": {"task": "pretrain", "inputs": {"dataset": "tokenize"}, "config": {
                "model": "llama3.1-8b", "mesh": {"data": 1, "fsdp": -1},
                "data": {"seq_len": 2048, "batch_size": 16}}}}})


@needs_libtpu
def test_llama3_8b_does_not_fit_a_v5e_8_and_trainflow_plan_says_what_would(tmp_path, capsys):
    """16 GiB chips: float32 parameters and Adam moments over 8 chips leave too little for the
    step; the TPU compiler refuses it and the plan reports its figures and exits 1."""
    code = cli.main(["plan", pipeline_8b(tmp_path), "--target", "v5e-8"])
    out, err = capsys.readouterr()
    assert code == EXIT_FAILED
    assert "stage pretrain on v5e-8: 8 x TPU v5e (topology v5e:2x4)" in out and "refused by the compiler" in out
    assert "DOES NOT FIT" in out and "exceeds available HBM" in out
    # 8.03e9 float32 parameters over 8 chips; Adam's two moments twice that; the compiler's temporaries.
    rows = {line[:30].strip(): float(line[30:44]) for line in out.splitlines() if line.startswith("    ")}
    assert rows["parameters"] == pytest.approx(4 * 8.03e9 / 8 / 2**30, rel=2e-3)
    assert rows["optimizer state"] == pytest.approx(2 * rows["parameters"], abs=0.01)
    temporaries = float(re.search(r"HLO temporaries \(([\d.]+)G\)", out).group(1))
    assert rows["gradients"] + rows["activations, other temps"] == pytest.approx(temporaries, abs=0.011)
    assert "error: stage pretrain does not fit v5e-8" in err and "of 16.00" in err
    assert "mesh.fsdp" in err and "data.batch_size" in err and "compute.param_dtype" in err
