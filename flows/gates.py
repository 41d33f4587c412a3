"""Gates (`when:`) and selections (`select:`): decisions over upstream metrics and configs.

    export:
      task: export
      inputs: {checkpoint: grpo}
      when: 'evaluate.metrics["grpo/arithmetic/accuracy"] > 0.55 and grpo.config.steps >= 100'
    grpo:
      task: grpo
      inputs: {checkpoint: {select: {from: "sft[*]", by: metrics.eval_loss, best: min}}}

A gate is a Python expression parsed with `ast` and checked node by node, never evaluated
by Python: it may hold comparisons (== != < <= > >= in, not in), `and` / `or` / `not`,
numbers, strings, True / False / None, tuples of those, and references
`<stage>.metrics[...]` / `<stage>.metrics.NAME` / `<stage>.config.a.b[...]`, read from the
stage's complete manifest. Anything else (calls, arithmetic, names that are not stages) is
refused when the pipeline is loaded.

A gate that is false skips its stage as `skipped (condition)`: a record beside where the
artifact would be (`<store>/<stage>/<id>.condition.json`) holds the expression and the
values it saw, `trainflow status` shows it, and the stages that read it are skipped too.
A gate that is true, and a selection, are recorded in the manifest of the stage they let
run (`decisions`), so `trainflow lineage` shows why it ran and which point it took.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from tasks.store.base import ArtifactStore
from tasks.store.records import now_iso

SKIPPED_CONDITION = "skipped (condition)"
CONDITION_SUFFIX = ".condition.json"
_ROOTS = ("metrics", "config")
_COMPARE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn)
_WHAT = (
    "a gate may use comparisons, and/or/not, numbers, strings and <stage>.metrics[...] / <stage>.config... references"
)


@dataclass(frozen=True)
class Reference:
    """`evaluate.metrics["a/b"]` as (stage, ("metrics", "a/b")), with its text."""

    stage: str
    path: tuple[Any, ...]
    text: str


def _reference(node: ast.AST, where: str) -> Reference:
    """The chain Name.(metrics|config)(.attr | [const])* under `node`, else ConfigError."""
    path: list[Any] = []
    current = node
    while not isinstance(current, ast.Name):
        if isinstance(current, ast.Attribute):
            path.append(current.attr)
            current = current.value
        elif isinstance(current, ast.Subscript) and isinstance(current.slice, ast.Constant):
            path.append(current.slice.value)
            current = current.value
        else:
            raise ConfigError(f"{where}: '{ast.unparse(node)}' is not a reference; {_WHAT}")
    path.reverse()
    if not path or path[0] not in _ROOTS:
        raise ConfigError(
            f"{where}: '{ast.unparse(node)}': after the stage name comes .metrics or .config "
            f'(e.g. {current.id}.metrics["eval_loss"])'
        )
    return Reference(current.id, tuple(path), ast.unparse(node))


class Gate:
    """A parsed, checked `when:` expression."""

    def __init__(self, text: str, where: str):
        self.text, self.where = text, where
        try:
            self.tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as e:
            raise ConfigError(f"{where}: '{text}' is not an expression ({e.msg}); {_WHAT}") from None
        self.references: list[Reference] = []
        self._check(self.tree.body)

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            self._check(node.operand)
        elif isinstance(node, ast.Compare):
            bad = [op for op in node.ops if not isinstance(op, _COMPARE)]
            if bad:
                raise ConfigError(f"{self.where}: '{ast.unparse(node)}' uses '{type(bad[0]).__name__}'; {_WHAT}")
            for part in (node.left, *node.comparators):
                self._check(part)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, str, bool, type(None))):
                raise ConfigError(f"{self.where}: constant {node.value!r} is not a number or string; {_WHAT}")
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                self._check(element)
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            self.references.append(_reference(node, self.where))
        elif isinstance(node, ast.Name):
            raise ConfigError(
                f"{self.where}: '{node.id}' alone is not a value; write {node.id}.metrics[\"NAME\"] "
                f"or {node.id}.config.KEY"
            )
        else:
            raise ConfigError(f"{self.where}: '{ast.unparse(node)}' is a {type(node).__name__}; {_WHAT}")

    @property
    def stage_names(self) -> set[str]:
        return {ref.stage for ref in self.references}

    def check_stages(self, stages: list[str]) -> list[str]:
        """Problems with the stages it names (one sentence each)."""
        problems = []
        for name in sorted(self.stage_names - set(stages)):
            match = difflib.get_close_matches(name, stages, n=1)
            hint = f"; did you mean '{match[0]}'?" if match else f"; stages are: {', '.join(stages)}"
            problems.append(f"{self.where}: names stage '{name}', which is not in the pipeline{hint}")
        return problems

    def evaluate(self, manifest_of: Callable[[str], dict | None], stages: dict[str, str]) -> tuple[bool, dict]:
        """(result, {reference text: value seen}); `stages` maps a name as written to the
        concrete stage it means, `manifest_of` reads that stage's complete manifest."""
        seen: dict[str, Any] = {}
        values = {ref.text: read_reference(ref, manifest_of, stages, self.where) for ref in self.references}
        seen.update(values)

        def value(node: ast.AST) -> Any:
            if isinstance(node, ast.BoolOp):
                results = (value(v) for v in node.values)
                return all(results) if isinstance(node.op, ast.And) else any(results)
            if isinstance(node, ast.UnaryOp):
                operand = value(node.operand)
                return (
                    not operand
                    if isinstance(node.op, ast.Not)
                    else (-operand if isinstance(node.op, ast.USub) else operand)
                )
            if isinstance(node, ast.Compare):
                left = value(node.left)
                for op, right_node in zip(node.ops, node.comparators):
                    right = value(right_node)
                    try:
                        ok = _compare(op, left, right)
                    except TypeError:
                        raise ConfigError(
                            f"{self.where}: cannot compare {left!r} with {right!r} in '{ast.unparse(node)}'"
                        ) from None
                    if not ok:
                        return False
                    left = right
                return True
            if isinstance(node, ast.Constant):
                return node.value
            if isinstance(node, (ast.Tuple, ast.List)):
                return tuple(value(e) for e in node.elts)
            return values[ast.unparse(node)]

        return bool(value(self.tree.body)), seen


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool:
    if isinstance(op, ast.Eq):
        return left == right
    if isinstance(op, ast.NotEq):
        return left != right
    if isinstance(op, ast.Lt):
        return left < right
    if isinstance(op, ast.LtE):
        return left <= right
    if isinstance(op, ast.Gt):
        return left > right
    if isinstance(op, ast.GtE):
        return left >= right
    if isinstance(op, ast.In):
        return left in right
    return left not in right


def read_reference(ref: Reference, manifest_of: Callable[[str], dict | None], stages: dict[str, str], where: str):
    stage = stages.get(ref.stage, ref.stage)
    manifest = manifest_of(stage)
    if manifest is None:
        raise ConfigError(f"{where}: '{ref.text}': stage '{stage}' has no complete artifact to read")
    node: Any = manifest.get(ref.path[0]) or {}
    for depth, key in enumerate(ref.path[1:], start=1):
        if isinstance(node, dict) and key in node:
            node = node[key]
            continue
        if isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node):
            node = node[key]
            continue
        so_far = ".".join(str(k) for k in ref.path[:depth])
        valid = list(node) if isinstance(node, dict) else []
        match = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"it has: {', '.join(map(str, valid)) or 'nothing'}"
        what = "metric" if ref.path[0] == "metrics" and depth == 1 else "key"
        raise ConfigError(f"{where}: '{ref.text}': {stage}.{so_far} has no {what} '{key}' ({hint})")
    return node


def by_reference(by: str, where: str) -> Reference:
    """A selection's `by` (`metrics.eval_loss`, `metrics["a/b"]`, `config.lora.rank`)."""
    try:
        ref = _reference(ast.parse(f"_.{by.strip()}", mode="eval").body, where)
        return Reference(ref.stage, ref.path, by)
    except (SyntaxError, ConfigError):
        root, dot, rest = by.partition(".")
        if root in _ROOTS and dot and rest:
            return Reference("_", (root, rest), by)
        raise ConfigError(
            f"{where}: '{by}' names no metric or config value (e.g. metrics.eval_loss, "
            f'metrics["arithmetic/accuracy"], config.lora.rank)'
        ) from None


def select_best(
    candidates: tuple[str, ...], by: str, best: str, manifest_of: Callable[[str], dict | None], where: str
) -> tuple[str, dict]:
    """(the chosen stage, the record: every candidate's value, the rule)."""
    ref = by_reference(by, where)
    values = {}
    for stage in candidates:
        value = read_reference(ref, manifest_of, {"_": stage}, where)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{by}' of {stage} is {value!r}, not a number")
        values[stage] = value
    pick = min if best == "min" else max
    chosen = pick(candidates, key=lambda s: values[s])  # ties: the first in grid order
    return chosen, {"from": list(candidates), "by": by, "best": best, "values": values, "chosen": chosen}


# --------------------------------------------------------------------------- records


def record_condition(store: ArtifactStore, stage: str, artifact_id: str, record: dict) -> None:
    """A false gate: what it saw, beside where the artifact would be."""
    record = {**record, "stage": stage, "id": artifact_id, "status": SKIPPED_CONDITION, "decided_at": now_iso()}
    store.write_record(stage, f"{artifact_id}{CONDITION_SUFFIX}", record)


def read_condition(store: ArtifactStore, stage: str, artifact_id: str) -> dict | None:
    return store.read_record(stage, f"{artifact_id}{CONDITION_SUFFIX}")


def clear_condition(store: ArtifactStore, stage: str, artifact_id: str) -> None:
    store.remove_record(stage, f"{artifact_id}{CONDITION_SUFFIX}")


def record_decisions(store: ArtifactStore, stage: str, artifact_id: str, decisions: dict) -> None:
    """The gate and selections that let a complete artifact be made, into its manifest
    (`decisions`; not part of its files or id). Written atomically, local copy and bucket."""
    manifest = store.manifest(stage, artifact_id)
    if manifest is None or manifest.get("decisions") == decisions:
        return
    manifest["decisions"] = decisions
    store.write_manifest(stage, artifact_id, manifest)
