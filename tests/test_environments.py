"""Environments and tools: the calculator, Hermes tool calls and their errors, the tools in the
chat template, the environment section of a GRPO config, and the shipped example pipeline."""

from pathlib import Path

import pytest

from engine.config import ConfigError, load_config
from engine.data.chat import render
from engine.data.tokenizer import TokenizerBundle
from engine.posttrain import openenv_env
from engine.posttrain.config import GRPOConfig
from engine.posttrain.environments import (
    ArithmeticToolTask,
    Environment,
    ToolEnvironment,
    ToolError,
    arithmetic_tool_rows,
    calculate,
)
from flows.spec import load_plan
from tasks.stages.grpo import GRPOStage, environment_records
from tasks.store.consume import sha256_file
from tasks.store.records import code_version
from tests.test_multiturn import char_bundle

REPO = Path(__file__).resolve().parent.parent


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_the_calculator_does_arithmetic_and_refuses_everything_else():
    assert calculate("(12 + 7) * 3") == "57"
    assert calculate("7 / 2") == "3.5" and calculate("2 ** 10") == "1024" and calculate("-3 // 2") == "-2"
    for bad, message in [
        ("__import__('os').system('true')", "not arithmetic"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("1 +", "cannot parse"),
        ("x" * 501, "at most 500 characters"),
    ]:
        with pytest.raises(ToolError, match=message):
            calculate(bad)


def test_tool_calls_are_run_and_their_failures_are_observations_not_crashes():
    env = ToolEnvironment(tools=["calculator"], call_reward=0.1)
    assert isinstance(env, Environment)
    assert env.reset({"prompt": "What is 19 * 3?", "answer": "57"}) == "What is 19 * 3?"
    step = env.step("Let me compute. " + call("calculator", expression="19 * 3"))
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 0
    assert step.observation == "\n<tool_response>\n57\n</tool_response>\n"  # text mode: Hermes' tags
    assert step.reward == pytest.approx(0.1)  # a per-turn reward for the well-formed call
    # Two calls in one turn, one of them failing in each way a call can fail.
    turn = call("calculator", expression="1/0") + call("search", query="x") + "<tool_call>{oops</tool_call>"
    turn += call("calculator", formula="1")
    step = env.step(turn)
    assert step.tool_calls == 4 and step.tool_errors == 4 and step.reward == 0.0
    lines = step.observation.strip().splitlines()[1:-1]
    assert lines[0] == "error: division by zero"
    assert lines[1] == "error: no tool named 'search'; tools: calculator"
    assert lines[2].startswith("error: a tool call must be JSON with a name and arguments")
    assert lines[3].startswith("error: bad arguments for calculator")
    # No call: the final answer, scored against the row's answer.
    assert env.step("The answer is 57.").reward == 1.0
    assert env.step("The answer is 56.").reward == 0.0 and env.step("57").done


def test_the_tools_are_declared_to_the_chat_templates_tools_variable():
    """A Hermes-style template lists `tools` in the system turn; the environment's schemas
    are what it renders (the default template ignores them)."""
    template = (
        "{% if tools %}<|system|>{% for tool in tools %}{{ tool['function']['name'] }}:"
        "{{ tool['function']['parameters']['required'] | join(',') }};{% endfor %}<eos>{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    bundle = char_bundle()
    bundle = TokenizerBundle(bundle.tokenizer, eos_token="<eos>", pad_token="<pad>", chat_template=template)
    env = ToolEnvironment(tools=["calculator", "python"])
    messages = [{"role": "user", "content": "hi"}]
    text = render(bundle, messages, add_generation_prompt=True, tools=env.tools)
    assert text == "<|system|>calculator:expression;python:code;<eos><|user|>hi<eos><|assistant|>"
    assert render(bundle, messages) == "<|user|>hi<eos>"


def test_the_arithmetic_task_pays_one_call_and_the_right_answer():
    env = ArithmeticToolTask()
    assert env.reset({"question": "3+4", "answer": "7"}) == "3+4="
    step = env.step("c")
    assert (step.observation, step.reward, step.done, step.tool_calls) == ("7", 0.5, False, 1)
    assert env.step("7").reward == 1.0
    env.reset({"question": "3+4", "answer": "7"})
    env.step("c")
    assert env.step("c").reward == -0.5  # calling again takes the call's reward back
    env.reset({"question": "3+4", "answer": "7"})
    assert env.step("7").done and ArithmeticToolTask().reset({"question": "1+1"}) == "1+1="
    rows = arithmetic_tool_rows(50, seed=1)
    assert all(eval(r["question"]) == int(r["answer"]) <= 9 for r in rows)  # noqa: S307 - the test's own rows


def grpo_tree(**extra):
    return {"checkpoint": {"init_from": "ck", "directory": "out"}, "data": {"path": "rows.jsonl"}, **extra}


def test_a_grpo_config_takes_an_environment_section_and_checks_it():
    cfg = load_config(tree=grpo_tree(environment={"factory": "arithmetic_tool", "max_turns": 2}), schema=GRPOConfig)
    assert cfg.environment.factory == "arithmetic_tool" and cfg.environment.max_turn_tokens == 64 and not cfg.rewards
    with pytest.raises(ConfigError, match="missing required key 'rewards'"):  # as before, without one
        load_config(tree=grpo_tree(), schema=GRPOConfig)
    with pytest.raises(ConfigError, match="rewards: give at least one reward term"):
        load_config(tree=grpo_tree(rewards=[]), schema=GRPOConfig)
    with pytest.raises(ConfigError, match="unknown key 'environment.max_turn'; did you mean 'max_turns'"):
        load_config(tree=grpo_tree(environment={"factory": "tools", "max_turn": 2}), schema=GRPOConfig)
    # Rollout workers run the episodes too (tests/test_multiturn.py: bitwise at staleness 0).
    cfg = load_config(
        tree=grpo_tree(environment={"factory": "tools"}, rollout_workers=1, max_staleness=1), schema=GRPOConfig
    )
    assert cfg.rollout_workers == 1 and cfg.environment.factory == "tools"


def test_the_shipped_tools_pipeline_validates_with_its_environment():
    plan = load_plan(REPO / "configs" / "pipelines" / "tools.yaml")
    grpo = plan.stages["grpo"].job.config
    assert grpo.environment.factory == "tools"
    assert grpo.environment.kwargs["tools"] == ["calculator", "python"]


def test_a_user_environments_module_is_checked_at_validation_and_part_of_the_stage_id(tmp_path, monkeypatch):
    stage = GRPOStage()
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1"}\n')  # data files are checked first
    raw = {"data": {"path": str(tmp_path / "rows.jsonl")}, "environment": {"factory": "my_tool_env_xyz:Env"}}
    with pytest.raises(ConfigError, match="key 'environment.factory': cannot find module 'my_tool_env_xyz'"):
        stage.resolve_config(raw, "p.yaml")
    (tmp_path / "my_tool_env_xyz.py").write_text("class Env: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = stage.resolve_config(raw, "p.yaml")
    before = stage.fingerprint(cfg)["environment_source"]
    (tmp_path / "my_tool_env_xyz.py").write_text("class Env:  # changed\n    ...\n")
    assert before and stage.fingerprint(cfg)["environment_source"] != before


def test_the_manifest_names_each_environment_its_version_and_config_and_only_libraries_join_the_id(
    tmp_path, monkeypatch
):
    stage = GRPOStage()
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1"}\n')
    (tmp_path / "my_env_abc.py").write_text("class Env: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for factory, version in (
        ("tools", code_version()["version"]),  # a built-in: trainflow's code
        ("my_env_abc:Env", f"sha256:{sha256_file(tmp_path / 'my_env_abc.py')}"),
    ):
        raw = {"data": {"path": str(tmp_path / "rows.jsonl")}, "environment": {"factory": factory}}
        cfg = stage.resolve_config(raw, "p.yaml")
        assert environment_records(cfg) == [
            {"name": factory, "version": version, "config": cfg.environment.model_dump(mode="json")}
        ]
        assert "environment_versions" not in stage.fingerprint(cfg)  # ids made before stay as they were
    raw = {"environment": {"factory": "openenv", "kwargs": {"url": "http://127.0.0.1:1"}}, "data": raw["data"]}
    if openenv_env.package_version() is not None:  # a library's installed version is part of the id
        cfg = stage.resolve_config(raw, "p.yaml")
        assert stage.fingerprint(cfg)["environment_versions"] == {"openenv-core": openenv_env.package_version()}
        bad = {**raw, "environment": {"factory": "openenv", "kwargs": {"url": "http://x", "serve": {"init": "e"}}}}
        with pytest.raises(ConfigError, match="p.yaml: key 'environment.kwargs': give url .* or serve"):
            stage.resolve_config(bad, "p.yaml")
