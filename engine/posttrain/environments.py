"""Environments for multi-turn GRPO: what a policy talks to between its turns, and the tools.

An environment is a class (one instance per episode, as TRL's `environment_factory` makes
one per rollout) with two methods:

    reset(row: dict) -> str | list[message]     the dataset row -> the first observation,
                                                 the prompt: text, or chat messages rendered
                                                 with the tokenizer's chat template
    step(turn: str) -> Step                      the model's turn (decoded, special tokens
                                                 dropped) -> observation, reward, done

and optionally `tools` (OpenAI-style function schemas, passed to the chat template's `tools`
variable as `tokenizer.apply_chat_template(tools=...)` does) and `observation_role` (the
chat role an observation is rendered with; default "tool") and `close()` (called when the
episode ends, however it ends: a server's session let go). A config names it
`module:Class` (importable from the working directory or PYTHONPATH) or a built-in:

    tools             ToolEnvironment: tool calls in the Hermes format Qwen's and Hermes'
                      templates teach, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
                      a turn without one is the final answer, scored against the row's answer
    arithmetic_tool   ArithmeticToolTask: a two-turn task a tiny model learns on CPU
    openenv           an OpenEnv environment server's sessions (engine/posttrain/openenv_env.py)

The runner (engine/posttrain/multiturn.py) owns the budgets: `max_turns` model turns,
`max_turn_tokens` new tokens per turn, and GRPO's `max_completion_length` for the whole
episode after the prompt (model and environment tokens together, as in TRL). An episode's
reward is the sum of its steps' rewards (per-turn rewards, e.g. for a well-formed call, and
the final one).

Built-in tools: `calculator` (arithmetic on numbers, evaluated from the syntax tree, no
eval) and `python` (the code runs in engine/posttrain/sandbox.py; its stdout is the result).
A sandboxed call's failure (a limit, a crash, a hang) is that call's error observation; its
kind is counted in `Step.tool_failures`, which the runner sums into `env/tool_failures/<kind>`.
An environment that runs a sandbox says which isolation in `sandbox_isolation` (the runner
records `env/tool_sandbox_weaker`: 1 for the opted-in namespaces mode).
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import operator
import random
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from engine.config import ConfigError, Strict
from engine.posttrain.env_protocol import Environment, Prompt, Step
from engine.posttrain.openenv_env import OpenEnvEnvironment
from engine.posttrain.rewards import numeric_match
from engine.posttrain.sandbox import SandboxLimits, check_sandbox, run_python


class EnvironmentConfig(Strict):
    """GRPO's `environment:` section: episodes against an environment instead of one completion."""

    factory: str
    """A built-in (tools, arithmetic_tool) or `module:Class`: called with `kwargs` once per episode."""
    max_turns: int = Field(4, gt=0)
    """Model turns per episode; an episode still going after them is truncated."""
    max_turn_tokens: int = Field(64, gt=0)
    """New tokens per model turn. The whole episode after the prompt (model and environment
    tokens) has max_completion_length: an observation that does not fit truncates it."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory, e.g. {tools: [calculator], answer_field: answer}."""
    step_workers: int = Field(4, gt=0)
    """Episodes whose steps run at once, in threads (a sandboxed tool call is a child process,
    so they overlap); each episode has its own environment instance. 1: one after another,
    for an environment whose instances share state."""


class EnvironmentFailure(RuntimeError):
    """Every episode of a rollout batch failed (an environment that cannot run); names it."""


# --------------------------------------------------------------------------- tools


class ToolError(Exception):
    """A tool could not do what it was asked; the message is the model's observation. `kind`:
    a sandboxed call's failure kind (sandbox.FAILURE_KINDS), counted in Step.tool_failures."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# CPython 3.11's ast.parse is not safe in concurrent threads ("AST constructor recursion depth
# mismatch"), and the episodes' steps run in threads (multiturn.py, step_workers).
_PARSE_LOCK = threading.Lock()
MAX_MAGNITUDE = 1e100  # beyond this an integer power or product is refused (no 9**9**9 hang)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > 100:
                raise ToolError(f"{left} ** {right} is too large")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
                raise ToolError("the result is not a real number of manageable size")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ToolError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses)")

    if not isinstance(expression, str) or len(expression) > 500:
        raise ToolError("expression must be text of at most 500 characters")
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


@dataclass
class Tool:
    """A function the model can call: its name, a description and JSON schema for the chat
    template, and `run(**arguments) -> str` (raising ToolError for a failure it reports)."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        """The OpenAI function format chat templates read from `tools`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _object(**properties: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": "string", "description": d} for k, d in properties.items()},
        "required": list(properties),
    }


def python_tool(limits: SandboxLimits) -> Tool:
    def run(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("code must be text")
        result = run_python(code, limits)
        if not result.ok:  # the limit or exception, the end of its traceback, what it printed first
            tail = result.stderr.strip().splitlines()[-3:]
            printed = ["output before it failed:", result.stdout.rstrip()] if result.stdout.strip() else []
            raise ToolError("\n".join([str(result.error), *tail, *printed]), kind=result.failure)
        return result.observation()

    return Tool(
        "python",
        f"Run a Python script (no network, {limits.wall_seconds:g} s, {limits.memory_mb} MB); returns its stdout.",
        _object(code="the script; print what you want to see"),
        run,
    )


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression.", _object(expression="e.g. (12 + 7) * 3"), calculate)


TOOLS: dict[str, Callable[[SandboxLimits], Tool]] = {
    "calculator": lambda limits: calculator_tool(),
    "python": python_tool,
}


# --------------------------------------------------------------------------- built-in environments

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolEnvironment:
    """A tool-using episode on a dataset row: the model calls tools (each call's result comes
    back as an observation) until it answers without one; the answer is scored against the
    row's `answer_field` (numeric_match: the last number, within `tolerance`).

    Rewards: `call_reward` per well-formed call (a per-turn reward; 0 by default), and
    `correct_reward` for a correct final answer. Subclasses change the call syntax
    (`parse_calls`), the observation text (`format_results`) or the scoring (`score`)."""

    observation_role = "tool"

    def __init__(
        self,
        tools: Sequence[str] = ("calculator", "python"),
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        answer_pattern: str | None = None,
        tolerance: float = 1e-6,
        call_reward: float = 0.0,
        correct_reward: float = 1.0,
        max_calls_per_turn: int = 4,
        observation_role: str = "tool",
        sandbox: dict[str, Any] | None = None,
    ):
        try:
            limits = SandboxLimits.model_validate(sandbox or {})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ConfigError(f"environment.kwargs.sandbox.{where}: {first['msg']}") from None
        unknown = [t for t in tools if t not in TOOLS]
        if unknown:
            raise ConfigError(f"environment.kwargs.tools: unknown tool(s) {unknown}; built-ins: {', '.join(TOOLS)}")
        self.sandbox_isolation = limits.isolation if "python" in tools else None
        """The python tool's isolation (None: no sandboxed tool); the runner records it."""
        if self.sandbox_isolation is not None:
            check_sandbox(limits)  # bwrap missing or refused: one sentence, before any episode
        self.tool_failures: Counter[str] = Counter()
        self.toolbox = {name: TOOLS[name](limits) for name in tools}
        self.tools = [tool.schema() for tool in self.toolbox.values()]
        self.prompt_field, self.answer_field, self.answer_pattern = prompt_field, answer_field, answer_pattern
        self.tolerance, self.call_reward, self.correct_reward = tolerance, call_reward, correct_reward
        self.max_calls_per_turn, self.observation_role = max_calls_per_turn, observation_role
        self.row: dict[str, Any] = {}
        self.text_mode = False

    def reset(self, row: dict[str, Any]) -> Prompt:
        if self.prompt_field not in row:
            raise KeyError(f"the row has no '{self.prompt_field}' (prompt_field); it has {sorted(row)}")
        self.row = row
        self.text_mode = isinstance(row[self.prompt_field], str)
        return row[self.prompt_field]

    def parse_calls(self, turn: str) -> list[tuple[str, Any]] | None:
        """[(tool name, arguments)] of the turn's calls; None if it makes none (its answer).
        A call that is not JSON with a name comes back as (None, the reason)."""
        blocks = TOOL_CALL.findall(turn)
        if not blocks:
            return None
        calls = []
        for block in blocks[: self.max_calls_per_turn]:
            try:
                call = json.loads(block)
                calls.append((call["name"], call.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                calls.append((None, f"a tool call must be JSON with a name and arguments, got {block[:100]!r}"))
        return calls

    def call(self, name: str | None, arguments: Any) -> tuple[str, bool]:
        """(result text, failed) of one call."""
        if name is None:
            return f"error: {arguments}", True
        tool = self.toolbox.get(name)
        if tool is None:
            return f"error: no tool named {name!r}; tools: {', '.join(self.toolbox)}", True
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name} must be a JSON object", True
        try:
            return tool.run(**arguments), False
        except ToolError as e:
            if e.kind is not None:
                self.tool_failures[e.kind] += 1
            return f"error: {e}", True
        except TypeError as e:  # wrong argument names
            return f"error: bad arguments for {name}: {e}", True

    def format_results(self, results: list[str]) -> str:
        """Chat mode: the results, one per line (the template wraps the tool message). Text
        mode: in Hermes' <tool_response> tags, where the model reads them next."""
        text = "\n".join(result.rstrip() for result in results)
        return f"\n<tool_response>\n{text}\n</tool_response>\n" if self.text_mode else text

    def score(self, answer: str) -> float:
        if self.answer_field not in self.row:
            return 0.0
        right = numeric_match(
            [answer], pattern=self.answer_pattern, tolerance=self.tolerance, answer=[self.row[self.answer_field]]
        )[0]
        return self.correct_reward * right

    def step(self, turn: str) -> Step:
        calls = self.parse_calls(turn)
        if calls is None:
            return Step(reward=self.score(turn), done=True)
        results, errors = [], 0
        self.tool_failures.clear()
        for name, arguments in calls:
            text, failed = self.call(name, arguments)
            results.append(text)
            errors += failed
        reward = self.call_reward * (len(calls) - errors)
        return Step(
            self.format_results(results),
            reward,
            tool_calls=len(calls),
            tool_errors=errors,
            tool_failures=dict(self.tool_failures),
        )


class ArithmeticToolTask(ToolEnvironment):
    """Two turns, learnable by a tiny model on CPU in a few dozen GRPO steps: the row asks
    `question` (e.g. "3+4"); the model either answers at once or calls the calculator by
    writing `call_word` alone, which evaluates the question, and answers after seeing the
    result. The answer is right if it is the row's `answer` exactly (reward 1); the call earns
    `call_reward` (a per-turn reward, paid for the episode's one call; a second `call_word`
    ends the episode and takes it back, so calling cannot be farmed), without which a random
    policy almost never sees the call pay off (it must call and then copy the result).

    The call takes its argument from the question, so a randomly initialised model only has
    to learn two things (to call, then to copy the observed result) instead of copying an
    expression; with `ToolEnvironment`'s JSON calls the same task is one for a real model.
    Text prompts: the prompt is `question + prompt_suffix`, the observation `result +
    observation_suffix`; with `chat: true` they are user and `observation_role` messages."""

    def __init__(
        self,
        question_field: str = "question",
        answer_field: str = "answer",
        call_word: str = "c",
        prompt_suffix: str = "=",
        observation_suffix: str = "",
        chat: bool = False,
        observation_role: str = "tool",
        call_reward: float = 0.5,
    ):
        super().__init__(
            tools=["calculator"],
            prompt_field=question_field,
            answer_field=answer_field,
            observation_role=observation_role,
            call_reward=call_reward,
        )
        self.call_word, self.chat = call_word, chat
        self.prompt_suffix, self.observation_suffix = prompt_suffix, observation_suffix

    def reset(self, row: dict[str, Any]) -> Prompt:
        self.called = False
        question = str(super().reset(row))
        return [{"role": "user", "content": question}] if self.chat else question + self.prompt_suffix

    def parse_calls(self, turn: str) -> list[tuple[str, Any]] | None:
        if turn.strip() != self.call_word or self.called:
            return None
        self.called = True
        return [("calculator", {"expression": str(self.row[self.prompt_field])})]

    def score(self, answer: str) -> float:
        if self.called and answer.strip() == self.call_word:  # calling again: the call's reward is taken back
            return -self.call_reward
        return float(answer.strip() == str(self.row[self.answer_field]).strip())

    def format_results(self, results: list[str]) -> str:
        return "\n".join(results) + ("" if self.chat else self.observation_suffix)


def arithmetic_tool_rows(count: int, seed: int = 0, max_sum: int = 9) -> list[dict[str, str]]:
    """`count` rows {question: "a+b", answer: "a+b's value"} with a + b <= max_sum."""
    pairs = [(a, b) for a in range(max_sum + 1) for b in range(max_sum + 1 - a)]
    order = random.Random(seed).choices(pairs, k=count)
    return [{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in order]


BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "tools": ToolEnvironment,
    "arithmetic_tool": ArithmeticToolTask,
    "openenv": OpenEnvEnvironment,  # an OpenEnv server's episodes (engine/posttrain/openenv_env.py)
}


def load_environment(cfg: EnvironmentConfig) -> Callable[[], Environment]:
    """A factory of fresh environments (no arguments); a bad reference or bad kwargs is a
    ConfigError naming `environment.factory` or `environment.kwargs`."""
    spec = cfg.factory
    cls: Any
    if spec in BUILTIN_ENVIRONMENTS:
        cls = BUILTIN_ENVIRONMENTS[spec]
    else:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(
                f"environment.factory: '{spec}' is neither a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}) "
                "nor of the form module:Class"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"environment.factory: cannot import module '{module_name}' for '{spec}': {e}") from None
        cls = getattr(module, attr, None)
        if not callable(cls):
            raise ConfigError(f"environment.factory: module '{module_name}' has no class or function '{attr}'")
    try:
        probe = cls(**cfg.kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"environment.kwargs: {spec} does not take these arguments: {e}") from None
    if not isinstance(probe, Environment):
        raise ConfigError(f"environment.factory: {spec} does not make an environment (it needs reset and step)")
    return lambda: cls(**cfg.kwargs)
