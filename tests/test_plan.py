"""The preflight (`trainflow plan`, `python -m engine.train CONFIG --plan`): what it reports is
the compiled step's memory analysis, a step too big for the target is refused naming the
numbers and the knobs, and the trainer refuses one too big for its devices before any state
exists. The tiny model compiles for TPU topologies through libtpu on this CPU host (and
llama3.1-8b for a v5e-8, where the compiler refuses it at once)."""

import importlib.util
import math
import os
import re

import jax
import pytest
import yaml

from engine.config import ConfigError, load_config
from engine.contract import EXIT_CONFIG_ERROR, EXIT_FAILED
from engine.train import pretrain
from engine.train.config import TrainConfig
from engine.train.memory import device_memory
from engine.train.plan import DoesNotFit, buffer_assignment, dump_options, plan_step, report
from engine.train.targets import get_target
from engine.train.trainer import Trainer, lm_batch
from flows import cli
from flows.spec import Pipeline, load_plan
from tasks.launch.run import StageConfigError
from tasks.plan import plan_pipeline
from tasks.runner import execute_stage
from tests.conftest import child_xla_flags

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
    assert (m.argument, m.output, m.alias, m.generated_code) == (
        analysis.argument_size_in_bytes,
        analysis.output_size_in_bytes,
        analysis.alias_size_in_bytes,
        analysis.generated_code_size_in_bytes,
    )
    # On CPU the temporaries are XLA's one preallocated block (its memory analysis' temp size,
    # or, where the analysis states its buffer assignment's total, that less the live buffers).
    assert m.temporaries == pytest.approx(analysis.temp_size_in_bytes, abs=1024)
    assert theirs.argument_size_in_bytes == m.argument and theirs.temp_size_in_bytes == analysis.temp_size_in_bytes
    # The split of the arguments: parameters, Adam's two moments (+ step counts), the batch's shard.
    assert m.parameters + m.optimizer_state + m.batch == m.argument
    assert m.optimizer_state == pytest.approx(2 * m.parameters, abs=64)
    assert m.batch == 16 // len(jax.devices()) * 128 * 4 * 5
    assert m.total == m.argument + m.output - m.alias + m.temporaries + m.generated_code


@pytest.mark.parametrize("target", ["local", "v5p-8"])
def test_the_plans_total_is_the_compilers_buffer_assignment_within_2_percent(target, tmp_path):
    """What the plan (and the trainer's check_fits, the same Memory) counts, less the program,
    against the buffer assignment the compiler dumps for the step (every allocation in device
    memory): within 2% on CPU and, through libtpu, on a TPU slice, where temp_size_in_bytes
    overstates it."""
    if target != "local" and importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu (the test extra)")
    # A shape no other test compiles: the persistent compilation cache's key leaves the dump
    # options out, and an executable loaded from it is not compiled, so dumps nothing.
    tree = {**TINY, "data": {"seq_len": 56, "batch_size": 8}}
    plan = plan_step(
        load_config(tree=tree, schema=TrainConfig), get_target(target), compiler_options=dump_options(str(tmp_path))
    )
    analysis = plan.compiled.memory_analysis()
    if target != "local" and not hasattr(analysis, "total_allocation_bytes"):
        pytest.skip(f"jax {jax.__version__}'s memory analysis states no buffer-assignment total (jax >= 0.11 does)")
    assigned = buffer_assignment(str(tmp_path))
    m = plan.memory
    assert m.total - m.generated_code == pytest.approx(assigned["total"], rel=0.02)
    assert m.temporaries == pytest.approx(assigned["total"] - (m.argument + m.output - m.alias), rel=0.02)
    if target != "local":  # the sum of every temporary buffer: more than the assignment holds at once
        assert analysis.temp_size_in_bytes > 1.2 * m.temporaries


def test_the_trainer_refuses_a_step_too_big_for_its_devices_before_any_state(tmp_path, byte_dataset, capsys):
    """Replicated parameters (mesh data=8) larger than a device's share of this host's memory:
    refused at compile time, exit 2 (retrying cannot help), naming the numbers and the knobs."""
    capacity = device_memory(jax.devices()[0])
    vocab = 128 * math.ceil(capacity / (2 * 64 * 4) / 128)  # untied embedding + head, float32: > capacity
    tree = {
        **TINY,
        "model": {"preset": "tiny", "vocab_size": vocab, "tie_embeddings": False},
        "data": {**TINY["data"], "path": str(byte_dataset)},
        "checkpoint": {"directory": str(tmp_path / "ck")},
        "progress": False,
    }
    code = pretrain.main([write(tmp_path / "run.yaml", tree)])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR
    assert f"each of the 8 cpu devices has {capacity / 2**30:.2f} GiB" in err
    assert "parameters" in err and "mesh.fsdp" in err and "compute.remat" in err and "data.batch_size" in err
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_a_pipeline_stage_too_big_for_its_devices_fails_before_any_state_naming_the_numbers(tmp_path):
    """What `trainflow run` does per stage (tasks.runner.execute_stage): the engine child exits 2
    before any state exists and the stage fails with its sentence (a config error: not retried)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # one CPU device: all of it
    vocab = 128 * math.ceil(host / (2 * 64 * 4) / 128)
    p = Pipeline("too-big", store=tmp_path / "store")
    p.stage(
        "problems",
        task="arithmetic",
        config={"max_number": 20, "pretrain_problems": 300, "sft_problems": 10, "rl_problems": 10, "eval_problems": 10},
    )
    p.stage(
        "tokenize",
        task="tokenize",
        inputs={"corpus": "problems"},
        config={
            "sources": [{"format": "text", "path": "{input:corpus}/pretrain.txt", "unit": "line"}],
            "tokenizer": {"vocab_size": 300},
            "validation_fraction": 0.05,
            "workers": 1,
        },
    )
    p.stage(
        "pretrain",
        task="pretrain",
        inputs={"dataset": "tokenize"},
        launcher={"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}},
        config={
            "model": {"preset": "tiny", "vocab_size": vocab, "tie_embeddings": False},
            "steps": 2,
            "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 0},
        },
    )
    plan = p.plan()
    for name in ("problems", "tokenize"):
        execute_stage(plan.stages[name].job, plan.store)
    with pytest.raises(StageConfigError) as refused:
        execute_stage(plan.stages["pretrain"].job, plan.store)
    message = str(refused.value)
    assert f"each of the 1 cpu devices has {host / 2**30:.2f} GiB" in message
    needed = float(re.search(r"the training step needs ([\d.]+) GiB per device", message).group(1))
    assert needed > host / 2**30 and "mesh.fsdp" in message and "compute.remat" in message
    out = plan.store.artifact_dir("pretrain", plan.stages["pretrain"].job.artifact_id)
    assert not list((out / "checkpoint").glob("[0-9]*"))


def test_a_gpu_host_without_its_gpus_is_an_estimate_that_says_so():
    cfg = load_config(
        tree={
            **TINY,
            "model": "llama3.1-8b",
            "mesh": {"data": 1, "fsdp": -1},
            "data": {"seq_len": 2048, "batch_size": 8},
        },
        schema=TrainConfig,
    )
    plan = plan_step(cfg, get_target("h100x8"))
    params = cfg.model.num_params()
    assert plan.how == "estimate (no GPU here)" and plan.devices == 8 and plan.fits
    assert plan.memory.parameters == pytest.approx(4 * params / 8, rel=1e-3)  # float32, fully sharded over 8
    assert plan.memory.optimizer_state == pytest.approx(2 * plan.memory.parameters, rel=1e-3)
    with pytest.raises(ConfigError, match=r"--target h100x8: mesh data=1 .*fsdp=3 .* does not fit its 8 devices"):
        plan_step(
            cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"fsdp": 3, "data": 1})}), get_target("h100x8")
        )
    # fsdp 4 x context 2: the same parameters and tokens per device (rows split 4 ways, each
    # row's positions 2 ways), so the same estimate, with twice the batch rows per device.
    split = plan_step(
        cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"fsdp": 4, "context": 2})}), get_target("h100x8")
    )
    assert split.mesh["context"] == 2 and split.memory.parameters == plan.memory.parameters
    assert split.memory.temporaries == plan.memory.temporaries and split.memory.batch == 2 * plan.memory.batch


# --------------------------------------------------------------------------- llama3.1-8b on TPU slices


def pretrain_pipeline(tmp_path, name: str, **stages) -> str:
    """A pipeline of pretraining stages (name -> config) on one tokenized dataset."""
    return write(
        tmp_path / "pipeline.yaml",
        {
            "name": name,
            "store": str(tmp_path / "store"),
            "stages": {
                "tokenize": {
                    "task": "tokenize",
                    "config": {
                        "sources": [{"format": "text", "path": "{stdlib}/a*.py", "name": "stdlib-a"}],
                        "tokenizer": {"vocab_size": 512},
                    },
                },
                **{
                    stage: {"task": "pretrain", "inputs": {"dataset": "tokenize"}, "config": config}
                    for stage, config in stages.items()
                },
            },
        },
    )


def two_model_pipeline(tmp_path) -> str:
    """Two pretraining stages on one dataset: llama3.1-8b (float32 parameters, fully sharded) and
    the tiny model."""
    return pretrain_pipeline(
        tmp_path,
        "plan8b",
        small=TINY,
        big={"model": "llama3.1-8b", "mesh": {"data": 1, "fsdp": -1}, "data": {"seq_len": 2048, "batch_size": 16}},
    )


@pytest.fixture(scope="module")
def v5e_8_plans(tmp_path_factory):
    """One compile of each stage for a v5e-8 slice (8 chips of 16 GiB), shared by the tests."""
    path = two_model_pipeline(tmp_path_factory.mktemp("plan"))
    plans, _ = plan_pipeline(load_plan(path), "v5e-8")
    return {p.stage: p for p in plans}, path


@needs_libtpu
def test_on_a_v5e_8_the_tiny_model_fits_with_the_compiled_figures_and_llama3_8b_does_not(v5e_8_plans):
    plans, _ = v5e_8_plans
    small, big = plans["small"], plans["big"]
    analysis = small.compiled.memory_analysis()
    assert small.how == "compiled" and small.fits and small.devices == 8 and small.device_kind.startswith("TPU v5")
    assert (small.memory.argument, small.memory.generated_code) == (
        analysis.argument_size_in_bytes,
        analysis.generated_code_size_in_bytes,
    )
    # The temporaries the buffer assignment holds at once (Memory.of: its total allocation, or
    # under jax 0.10 the heap peak), not temp_size_in_bytes, which libtpu 0.0.42 reads as 0 here.
    held = getattr(analysis, "total_allocation_bytes", 0) or analysis.peak_memory_in_bytes
    assert small.memory.temporaries > 0
    assert small.memory.total - small.memory.generated_code == pytest.approx(held, rel=0.02)
    assert small.memory.total == (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + small.memory.temporaries
        + analysis.generated_code_size_in_bytes
    )
    # 8.03e9 float32 parameters over 8 chips, Adam's moments twice that: the compiler refuses the
    # step and the plan carries the compiler's figure, all it would put in HBM (arguments too).
    assert big.how == "refused by the compiler" and not big.fits and big.capacity == 16 * 2**30
    assert big.memory.parameters == pytest.approx(4 * 8.03e9 / 8, rel=2e-3)
    assert big.memory.optimizer_state == pytest.approx(2 * big.memory.parameters, rel=1e-6)
    temporaries = float(re.search(r"HLO temporaries \(([\d.]+)G\)", big.compiler_message).group(1))
    assert big.memory.total == pytest.approx(temporaries * 2**30)
    assert big.memory.temporaries == pytest.approx(temporaries * 2**30 - big.memory.argument)
    assert big.memory.temporaries > 0
    assert big.memory.total > big.capacity


@needs_libtpu
def test_trainflow_plan_exits_1_naming_the_stage_that_does_not_fit_its_numbers_and_the_knobs(v5e_8_plans, capsys):
    plans, path = v5e_8_plans
    with pytest.raises(DoesNotFit) as refused:
        report(list(plans.values()))
    out = capsys.readouterr().out
    big = plans["big"]
    assert "stage big on v5e-8: 8 x TPU v5e (topology v5e:2x4)" in out and "refused by the compiler" in out
    assert "stage small on v5e-8" in out and "fits (0%)" in out and "DOES NOT FIT" in out
    message = str(refused.value)
    assert message.startswith(f"stage big does not fit v5e-8: {big.memory.total / 2**30:.2f} GiB per device of 16.00")
    assert "small" not in message
    # remat is already full for this preset: the sentence names only what the run does not do yet.
    assert "mesh.fsdp" in message and "data.batch_size" in message and "compute.param_dtype" in message
    assert "compute.remat" not in message
    # The command: the same report, exit 1, the sentence on stderr.
    code = cli.main(["plan", path, "--target", "v5e-8", "small.steps=5"])
    out, err = capsys.readouterr()
    assert code == EXIT_FAILED and err.strip() == f"error: {message}" and "stage big on v5e-8" in out


@needs_libtpu
def test_on_a_v5p_8_a_step_that_fits_is_planned_from_its_compiled_figures(tmp_path, capsys):
    """The tiny model on a v5p-8 (4 chips of 95 GiB), where every stage fits: the plan is the
    compiled step's memory analysis, its total the compiler's own figure of what it holds at
    once, below the sum of temporaries, and the report raises nothing. The same code plans
    llama3.1-8b; that compile (about 120 s of CPU) is docs/engine.md's worked example, and
    `python -m bench.compiled_step` its benchmark, not a test."""
    path = pretrain_pipeline(tmp_path, "planv5p", small=TINY)
    (plan,) = plan_pipeline(load_plan(path), "v5p-8")[0]
    analysis = plan.compiled.memory_analysis()
    assert plan.how == "compiled" and plan.fits and plan.devices == 4 and plan.capacity == 95 * 2**30
    assert (plan.memory.argument, plan.memory.generated_code) == (
        analysis.argument_size_in_bytes,
        analysis.generated_code_size_in_bytes,
    )
    # The compiler's own figure of what it holds at once (its buffer assignment's total, or
    # under jax 0.10 its peak), within 2%; temp_size_in_bytes, the sum, overstates it.
    held = getattr(analysis, "total_allocation_bytes", 0) or analysis.peak_memory_in_bytes
    assert plan.memory.total - plan.memory.generated_code == pytest.approx(held, rel=0.02)
    assert plan.memory.temporaries < analysis.temp_size_in_bytes
    assert plan.memory.optimizer_state == pytest.approx(2 * plan.memory.parameters, abs=64)
    assert plan.capacity > plan.memory.total > plan.memory.parameters + plan.memory.optimizer_state
    summaries = report([plan])  # no DoesNotFit: the stage fits
    out = capsys.readouterr().out
    assert set(summaries) == {"small"} and "stage small on v5p-8: 4 x TPU v5" in out
    assert "DOES NOT FIT" not in out and f"{plan.memory.total / 2**20:.2f}   of 97280.00: fits" in out  # MiB
    # Under jax < 0.11 the plan says its figure is an older compiler's heap peak, and by how much
    # that compiler's own temporaries figure was measured to overstate; under jax >= 0.11 it is
    # the buffer assignment itself and nothing is said.
    older = [line for line in out.splitlines() if "compiler (jax < 0.11)" in line]
    if hasattr(analysis, "total_allocation_bytes"):
        assert older == [] and plan.compiler_note is None
    else:
        (line,) = older
        assert line.startswith("  compiler: ") and "heap peak" in line
        assert f"temp_size_in_bytes, {analysis.temp_size_in_bytes / 2**20:.2f} MiB here" in line
        assert "heap peak, which for llama3.1-8b on a v5p-8 (8 rows, remat full) came within 0.4%" in line
        assert "17.86 GiB per chip against the assignment's 13.96 at 4,096 positions (+28%)" in line
        assert "23.65 against 17.43 at 8,192 (+36%)" in line


@needs_libtpu
def test_a_mixture_of_experts_with_an_expert_axis_compiles_for_a_tpu_slice(tmp_path):
    """The dropless expert-parallel step as XLA's TPU compiler lowers it: the grouped matmuls
    as ragged-dots (the tiled products are CPU-only), the tokens exchanged by all-to-all over
    the expert axis, and the plan's figures from that compile."""
    path = pretrain_pipeline(
        tmp_path,
        "planmoe",
        moe={
            "model": "tiny-qwen3-moe",
            "mesh": {"data": 1, "expert": 2, "fsdp": -1},
            "data": {"seq_len": 256, "batch_size": 16},
            "steps": 3,
        },
    )
    (plan,) = plan_pipeline(load_plan(path), "v5e-8")[0]
    assert plan.how == "compiled" and plan.fits and plan.devices == 8
    hlo = plan.compiled.as_text()
    assert "ragged-dot" in hlo and "all-to-all" in hlo
    assert plan.memory.argument == plan.compiled.memory_analysis().argument_size_in_bytes


@needs_libtpu
def test_context_parallelism_compiles_for_a_tpu_slice(tmp_path):
    """Two rows of 4,096 positions on a v5e-8, which without a context axis could use only 2 of
    its chips for them: context=4 x fsdp=2 compiles for TPU with the splash kernel per context
    shard (its mask tables split by query rows, the keys and values all-gathered, each chip's
    queries an early and a late half-chunk) and fits, with the plan's figures from that
    compile."""
    path = pretrain_pipeline(
        tmp_path,
        "plancp",
        long={
            "model": {"preset": "tiny", "max_seq_len": 4096},
            "mesh": {"data": 1, "context": 4, "fsdp": -1},
            "data": {"seq_len": 4096, "batch_size": 2},
            "steps": 3,
        },
    )
    (plan,) = plan_pipeline(load_plan(path), "v5e-8")[0]
    assert plan.how == "compiled" and plan.fits and plan.mesh["context"] == 4 and plan.mesh["fsdp"] == 2
    hlo = plan.compiled.as_text()
    assert "collective-permute" in hlo  # the load-balanced layout's exchange of half-chunks
    kernels = [line for line in hlo.splitlines() if "tpu_custom_call" in line]
    # Each chip's kernel: its 1,024 of the 4,096 query rows (4 heads of 16), the key and value
    # gradients over all 4,096 positions (2 kv heads) before they are reduce-scattered.
    forward = [line for line in kernels if line.lstrip().startswith("%splash_mha_fwd")]
    dkv = [line for line in kernels if line.lstrip().startswith("%splash_mha_dkv")]
    assert forward and all("f32[4,1024,16]" in line for line in forward)
    assert dkv and all("f32[2,4096,16]" in line for line in dkv)
    assert plan.memory.argument == plan.compiled.memory_analysis().argument_size_in_bytes


def test_a_stage_fed_by_a_checkpoint_step_is_planned_with_the_upstream_stages_model(tmp_path):
    """`inputs: {checkpoint: pretrain@2}`: the sft stage trains pretrain's model (a one-layer
    tiny here, which only pretrain's config names), as it would from a plain `pretrain`."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "completion": "{i + 1}"}}\n' for i in range(8)))
    path = pretrain_pipeline(
        tmp_path,
        "planstep",
        pretrain={
            "model": {"preset": "tiny", "num_layers": 1},
            "data": {"seq_len": 32, "batch_size": 8},
            "steps": 4,
            "checkpoint": {"every_steps": 2},
        },
    )
    tree = yaml.safe_load(open(path))
    tree["stages"]["sft"] = {
        "task": "sft",
        "inputs": {"checkpoint": "pretrain@2"},
        "config": {"data": {"path": str(data), "seq_len": 32, "batch_size": 8}, "steps": 2},
    }
    write(tmp_path / "pipeline.yaml", tree)
    plans, _ = plan_pipeline(load_plan(path), "local")
    by_stage = {p.stage: p for p in plans}
    assert set(by_stage) == {"pretrain", "sft"} and by_stage["sft"].how == "compiled" and by_stage["sft"].fits
    # The same parameters as pretrain's one-layer model (the preset's two layers would be more).
    assert by_stage["sft"].memory.parameters == by_stage["pretrain"].memory.parameters
