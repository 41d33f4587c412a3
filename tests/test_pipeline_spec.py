"""Pipeline specs: validation errors name the stage and key; artifact ids follow the DAG."""

import subprocess
import sys
import textwrap

import pytest
import yaml

import tests.pipeline_toys  # noqa: F401  (registers the toy stage kinds)
from engine.config import ConfigError
from flows.spec import Pipeline, load_plan
from tests.conftest import REPO


def plan_of(stages: dict, **top):
    tree = {"name": "t", "store": "unused", "stages": stages, **top}
    p = Pipeline(tree["name"])
    p.tree = tree
    return p.plan()


def error_of(stages: dict, **top) -> str:
    with pytest.raises(ConfigError) as e:
        plan_of(stages, **top)
    return str(e.value)


TOKENIZE_PRETRAIN = {
    "data": {"task": "toy-source"},
    "train": {"task": "pretrain", "inputs": {"dataset": "data"}, "config": {"model": "tiny", "steps": 5}},
}


def test_unknown_task_kind_suggests_the_closest():
    msg = error_of({"train": {"task": "pretrian"}})
    assert "stages.train.task: unknown task kind 'pretrian'; did you mean 'pretrain'?" in msg


def test_input_referencing_a_missing_stage():
    msg = error_of({"data": {"task": "toy-source"}, "sum": {"task": "toy-sum", "inputs": {"a": "dta"}}})
    assert "stages.sum.inputs.a: references stage 'dta', which is not in the pipeline; did you mean 'data'?" in msg


@pytest.mark.parametrize("name", ["eval*", "sft(v2)", "a?"])
def test_a_stage_name_with_glob_characters_is_refused_in_one_sentence(name):
    """A stage's store folder is named after it (a sweep point's brackets as parentheses,
    tasks/store/names.py), and Orbax globs inside checkpoint directories."""
    msg = error_of({name: {"task": "toy-source"}})
    assert f"stage name '{name}' may not contain any of ( ) * ?" in msg


def test_cycle_is_spelled_out():
    msg = error_of(
        {
            "a": {"task": "toy-sum", "inputs": {"a": "c"}},
            "b": {"task": "toy-sum", "inputs": {"a": "a"}},
            "c": {"task": "toy-sum", "inputs": {"a": "b"}},
        }
    )
    assert "stages form a cycle: a -> c -> b -> a" in msg


def test_input_of_the_wrong_kind():
    # pretrain needs a dataset; a toy-sum stage produces a checkpoint.
    msg = error_of(
        {
            "data": {"task": "toy-source"},
            "ckpt": {"task": "toy-sum", "inputs": {"a": "data"}},
            "train": {"task": "pretrain", "inputs": {"dataset": "ckpt"}, "config": {"model": "tiny"}},
        }
    )
    assert (
        "stages.train.inputs.dataset: stage 'ckpt' (toy-sum) produces a checkpoint, "
        "but input 'dataset' of task 'pretrain' needs a dataset"
    ) in msg


def test_unknown_and_missing_inputs():
    msg = error_of(
        {
            "data": {"task": "toy-source"},
            "train": {"task": "pretrain", "inputs": {"data": "data"}, "config": {"model": "tiny"}},
        }
    )
    assert "stages.train.inputs.data: task 'pretrain' has no input 'data' (its inputs: dataset, init)" in msg
    assert "stages.train.inputs: task 'pretrain' needs input 'dataset' (a dataset artifact)" in msg


def test_bad_stage_config_names_stage_and_key():
    stages = {**TOKENIZE_PRETRAIN}
    stages["train"] = {**stages["train"], "config": {"model": "tiny", "stepz": 5}}
    assert "stages.train.config: unknown key 'stepz'; did you mean 'steps'?" in error_of(stages)
    stages["train"]["config"] = {"model": "tiny", "optimizer": {"learning_rate": -1}}
    assert "stages.train.config: key 'optimizer.learning_rate': Input should be greater than 0" in error_of(stages)
    stages["train"]["config"] = {"model": "tiny", "data": {"path": "/elsewhere"}}
    assert "stages.train.config: key 'data.path' is set by the pipeline (from input 'dataset')" in error_of(stages)


def test_every_error_is_reported_at_once():
    msg = error_of(
        {
            "a": {"task": "nope"},
            "b": {"task": "toy-sum", "inputs": {"a": "missing"}},
            "c": {"task": "toy-source", "config": {"valu": 1}},
        }
    )
    assert len(msg.splitlines()) == 3, msg


def test_spec_level_errors():
    assert "unknown key 'stagez'; did you mean 'stages'?" in error_of({}, stagez={})
    assert "key 'stages': Value error, a pipeline needs at least one stage" in error_of({})
    msg = error_of({"data": {"task": "toy-source", "launcher": "local"}})
    assert "stages.data.launcher: task 'toy-source' runs in-process" in msg
    msg = error_of({"c": {"task": "toy-child", "launcher": {"kind": "command", "template": "srun"}}})
    assert "stages.c.launcher: launcher kind 'command' needs a template containing '{command}'" in msg


def _ids(stages):
    return {name: p.job.artifact_id for name, p in plan_of(stages).stages.items()}


DIAMOND = {
    "a": {"task": "toy-source", "config": {"value": 1}},
    "b": {"task": "toy-source", "config": {"value": 2}},
    "ab": {"task": "toy-sum", "inputs": {"a": "a", "b": "b"}},
    "abb": {"task": "toy-sum", "inputs": {"a": "b", "b": "ab"}},
}


def test_changed_config_changes_that_stage_and_its_descendants_only():
    before = _ids(DIAMOND)
    assert len(set(before.values())) == 4
    changed = {**DIAMOND, "a": {"task": "toy-source", "config": {"value": 5}}}
    after = _ids(changed)
    assert after["b"] == before["b"]
    assert all(after[s] != before[s] for s in ("a", "ab", "abb"))


def test_non_semantic_fields_and_stage_options_keep_the_id():
    before = _ids(DIAMOND)
    noisy = {**DIAMOND, "a": {"task": "toy-source", "config": {"value": 1, "sleep": 3, "trace": "x"}, "retries": 4}}
    assert _ids(noisy) == before
    # pretrain: log cadence, checkpoint cadence and progress bars are not part of the result
    base = _ids(TOKENIZE_PRETRAIN)["train"]
    cosmetic = {
        **TOKENIZE_PRETRAIN,
        "train": {
            **TOKENIZE_PRETRAIN["train"],
            "config": {
                "model": "tiny",
                "steps": 5,
                "log_every": 1,
                "progress": False,
                "checkpoint": {"every_steps": 2, "keep": 9},
            },
        },
    }
    assert _ids(cosmetic)["train"] == base
    semantic = {**TOKENIZE_PRETRAIN, "train": {**TOKENIZE_PRETRAIN["train"], "config": {"model": "tiny", "steps": 6}}}
    assert _ids(semantic)["train"] != base


def test_a_field_added_since_artifacts_were_made_keeps_their_ids_at_its_default():
    """mesh.context came after stores held finished stages: at 1 it is not in the id (their
    stages are still skipped as done); any other value is."""
    from engine.config import load_config
    from engine.train.config import TrainConfig
    from tasks.stages.pretrain import PretrainStage

    def mesh_of(**mesh):
        return PretrainStage().fingerprint(load_config(tree={"model": "tiny", "mesh": mesh}, schema=TrainConfig))[
            "mesh"
        ]

    assert mesh_of() == {"data": -1, "fsdp": 1, "tensor": 1, "expert": 1}
    assert mesh_of(context=2)["context"] == 2
    base = _ids(TOKENIZE_PRETRAIN)["train"]
    split = {
        **TOKENIZE_PRETRAIN,
        "train": {
            **TOKENIZE_PRETRAIN["train"],
            "config": {**TOKENIZE_PRETRAIN["train"]["config"], "mesh": {"context": 2}},
        },
    }
    assert _ids(split)["train"] != base


def test_model_preset_is_resolved_into_the_fingerprint():
    from engine.config import load_yaml

    tiny = load_yaml(REPO / "configs" / "models" / "tiny.yaml")
    by_name = _ids(TOKENIZE_PRETRAIN)["train"]
    spelled = {**TOKENIZE_PRETRAIN, "train": {**TOKENIZE_PRETRAIN["train"], "config": {"model": tiny, "steps": 5}}}
    assert _ids(spelled)["train"] == by_name
    wider = {**tiny, "d_model": tiny["d_model"] * 2}
    spelled["train"]["config"] = {"model": wider, "steps": 5}
    assert _ids(spelled)["train"] != by_name


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "p",
                "store": str(tmp_path / "store"),
                "imports": ["tests.pipeline_toys"],
                "defaults": {"retries": 2, "retry_delay_seconds": 1, "config": {"toy-source": {"value": 7}}},
                "stages": {
                    "a": {"task": "toy-source"},
                    "b": {"task": "toy-source", "config": {"value": 3}, "retries": 0},
                },
            }
        )
    )
    plan = load_plan(path, ["a.value=9", "stages.b.retries=1"])
    assert plan.stages["a"].job.config.value == 9
    assert plan.stages["b"].job.config.value == 3
    assert plan.stages["a"].retries == 2 and plan.stages["a"].retry_delays == [1.0, 2.0]
    assert plan.stages["b"].retries == 1
    with pytest.raises(
        ConfigError, match="override 'stpes.a=1': 'stpes' is neither a stage nor a pipeline key; did you mean 'stages'?"
    ):
        load_plan(path, ["stpes.a=1"])


def test_shipped_pipelines_validate():
    for path in sorted((REPO / "configs" / "pipelines").glob("*.yaml")):
        plan = load_plan(path)
        assert plan.stages, path


def test_cli_reports_a_bad_pipeline_in_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent("""
        name: bad
        stages:
          train: {task: pretrain, inputs: {dataset: tokenise}, config: {model: tiny}}
    """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "status", str(path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {path}: stages.train.inputs.dataset: references stage 'tokenise', "
        f"which is not in the pipeline; stages are: train"
    )


def test_inspection_commands_do_not_import_prefect_or_jax():
    """status / ls / lineage / verify answer at once: no Prefect or JAX start-up."""
    code = (
        "import sys, flows.cli, flows.spec, tasks.stages.tokenize, tasks.stages.pretrain; "
        "print(sorted(m for m in ('prefect', 'jax') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_the_quickstart_ids_are_the_readmes_so_new_config_fields_keep_finished_stages(tmp_path):
    """A field added to a stage's schema (e.g. `lora`, `mesh.context`) is left out of artifact
    ids at its default (engine.contract.ADDED_AT_DEFAULT): the ids the README shows for the
    quickstart stay those a store already holds, and its finished stages are skipped."""
    plan = load_plan(str(REPO / "configs" / "pipelines" / "quickstart.yaml"), store=str(tmp_path))
    readme = (REPO / "README.md").read_text()
    for name, stage in plan.stages.items():
        assert f"{name}/{stage.job.artifact_id}" in readme, (name, stage.job.artifact_id)
