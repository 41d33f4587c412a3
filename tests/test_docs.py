"""Every code block of README.md and docs/*.md checked against the code, so docs cannot drift.

- Python blocks compile; every `import` resolves (module and name); every free name a block
  calls or spells like a class or constant is bound by the block, an earlier block of the
  same page, a builtin, or a top-level name of engine/, tasks/ or flows/; an attribute read
  on an object of a known class (`p = Pipeline(...)` then `p.run()`, a parameter annotated
  `ctx: StageContext`, `self` in a subclass) exists on that class; a class attribute a
  subclass sets (a hook such as `pipeline_owned`) exists on its base. Modules named `my_*`
  are the reader's own: a page's `@register_stage` blocks are executed as that module, so
  the pipelines that import it are validated too.
- YAML blocks: a pipeline (`stages:`, or stages alone, or `defaults:` / `launcher:`) is
  validated as `trainflow status` validates it; a fragment whose inputs name stages it does
  not define is set into configs/pipelines/quickstart.yaml first. Other blocks are config
  fragments: the first schema (a stage kind's, ModelConfig, LauncherSpec) whose fields hold
  every key validates them, with only required keys allowed to be missing.
- Shell lines: `trainflow ...` parses with flows.cli's own parser (a usage line with
  placeholders: its command and options exist); a runnable one's pipeline and key=value
  overrides are validated; `python -m MODULE` names a module of this checkout.

Nothing trains or starts a server; the imports (JAX, Prefect) are most of its few seconds.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import copy
import dataclasses
import importlib
import inspect
import re
import shlex
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("engine", "tasks", "flows")
QUICKSTART = ROOT / "configs/pipelines/quickstart.yaml"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
PLACEHOLDER = re.compile(r"[\[\]|<>]|\.\.\.|^[A-Z][A-Z_]+(\.yaml)?$|^[A-Z_]+=")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    text = page.read_text() if text is None else text
    return [
        Block(page, text[: m.start()].count("\n") + 1, m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)
    ]


# --------------------------------------------------------------------------- the code's names


def project_index() -> dict[str, str]:
    """Top-level name -> module, for every module of engine/, tasks/ and flows/ (by AST, no import)."""
    index: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.parse(path.read_text()).body:
                names = []
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names = [node.name]
                elif isinstance(node, ast.Assign):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names = [node.target.id]
                for name in names:
                    index.setdefault(name, module)
    return index


def has_member(cls: type, name: str) -> bool:
    """`name` is something instances of `cls` have: an attribute, a field, or `self.name = ...`."""
    if hasattr(cls, name):
        return True
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "model_fields", {}):
            return True
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]+)?=", source):
            return True
    return False


def bound_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


class PythonChecker:
    """The Python blocks of one page, in order (later blocks may use earlier blocks' names)."""

    def __init__(self, index: dict[str, str]):
        self.index = index
        self.scope: dict[str, object] = {}  # name -> its object (None: bound, object unknown)
        self.problems: list[str] = []

    def resolve(self, name: str) -> object:
        """The object a free name stands for, or None."""
        if name in self.scope:
            return self.scope[name]
        if name in self.index:
            return getattr(importlib.import_module(self.index[name]), name, None)
        return getattr(builtins, name, None)

    def check(self, block: Block) -> None:
        try:
            tree = ast.parse(block.text, block.where)
        except SyntaxError as e:
            self.problems.append(f"{block.where}: does not compile: {e}")
            return
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.check_import(block, node)
        bound = bound_names(tree)
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
                continue
            if node.id in bound or node.id in self.scope or hasattr(builtins, node.id):
                continue
            if (id(node) in called or node.id[0].isupper()) and node.id not in self.index:
                self.problems.append(
                    f"{block.where}:{node.lineno - 1}: `{node.id}` is neither defined by the docs "
                    f"nor a top-level name of {', '.join(PACKAGES)}"
                )
        for name in bound:
            self.scope.setdefault(name, None)
        self.check_attributes(block, tree)

    def check_import(self, block: Block, node: ast.Import | ast.ImportFrom) -> None:
        where = f"{block.where}:{node.lineno - 1}: `{ast.unparse(node)}`"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("my_"):
                    module = self.import_module(alias.name, where)
                    self.scope[(alias.asname or alias.name).split(".")[0]] = module if alias.asname else None
            return
        if not node.module or node.module.startswith("my_"):
            return
        module = self.import_module(node.module, where)
        for alias in node.names:
            value = getattr(module, alias.name, None) if module else None
            if module is not None and value is None:
                try:
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    self.problems.append(f"{where}: {node.module} has no `{alias.name}`")
            self.scope[alias.asname or alias.name] = value

    def import_module(self, name: str, where: str) -> types.ModuleType | None:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            self.problems.append(f"{where}: {e}")
            return None

    def check_attributes(self, block: Block, tree: ast.Module) -> None:
        """Attributes of objects whose class is known, and hooks a subclass sets on its base."""
        typed: dict[str, type] = {}  # variable -> its class, in this block

        def class_of(expr: ast.expr) -> type | None:
            if isinstance(expr, ast.Name):
                value = self.resolve(expr.id)
                return value if isinstance(value, type) else None
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                cls = class_of(node.value.func)
                for target in node.targets:
                    if cls is not None and isinstance(target, ast.Name):
                        typed[target.id] = cls
            elif isinstance(node, ast.arg) and node.annotation is not None:
                cls = class_of(node.annotation)
                if cls is not None:
                    typed[node.arg] = cls
            elif isinstance(node, ast.ClassDef):
                bases = [cls for cls in map(class_of, node.bases) if cls is not None]
                if not bases:
                    continue
                own = bound_names(ast.Module(body=node.body, type_ignores=[]))
                self_cls = types.new_class(node.name, tuple(bases))
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else []
                    for target in targets:
                        if not isinstance(target, ast.Name) or target.id.startswith("__"):
                            continue
                        if not any(issubclass(base, BaseModel) for base in bases) and not any(
                            has_member(base, target.id) for base in bases
                        ):
                            self.problems.append(
                                f"{block.where}:{item.lineno - 1}: class {node.name} sets `{target.id}`, "
                                f"which none of its bases ({', '.join(b.__name__ for b in bases)}) has"
                            )
                for inner in ast.walk(node):
                    if (
                        isinstance(inner, ast.Attribute)
                        and isinstance(inner.value, ast.Name)
                        and inner.value.id == "self"
                        and inner.attr not in own
                        and not has_member(self_cls, inner.attr)
                    ):
                        self.problems.append(
                            f"{block.where}:{inner.lineno - 1}: `self.{inner.attr}`: {node.name}'s bases "
                            f"({', '.join(b.__name__ for b in bases)}) have no `{inner.attr}`"
                        )
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            name, attr = node.value.id, node.attr
            cls = typed.get(name)
            if cls is not None and not has_member(cls, attr):
                self.problems.append(
                    f"{block.where}:{node.lineno - 1}: `{name}.{attr}`: {cls.__module__}.{cls.__qualname__} "
                    f"has no `{attr}`"
                )
            elif cls is None and name not in typed:
                value = self.scope.get(name)
                if isinstance(value, (type, types.ModuleType)) and not has_member_or_submodule(value, attr):
                    self.problems.append(f"{block.where}:{node.lineno - 1}: `{name}.{attr}`: {name} has no `{attr}`")


def has_member_or_submodule(value: type | types.ModuleType, attr: str) -> bool:
    if isinstance(value, type):
        return has_member(value, attr)
    if hasattr(value, attr):
        return True
    try:
        importlib.import_module(f"{value.__name__}.{attr}")
        return True
    except ImportError:
        return False


# --------------------------------------------------------------------------- YAML


def load_blocks_yaml(block: Block) -> dict:
    """The block's mapping; a line `...` (an abridged block) is left out."""
    text = "\n".join(line for line in block.text.splitlines() if line.strip() != "...")
    tree = yaml.safe_load(text)
    assert isinstance(tree, dict), f"{block.where}: a YAML block that is not a mapping"
    return tree


def is_stage(value: object) -> bool:
    return isinstance(value, dict) and "task" in value


def referenced_stages(stages: dict) -> set[str]:
    refs = set()
    for stage in stages.values():
        for ref in (stage.get("inputs") or {}).values():
            if isinstance(ref, str):
                refs.add(re.split(r"[\[@]", ref)[0])
    return refs


def pipeline_of(tree: dict) -> dict | None:
    """The pipeline a YAML block is, or stands in: itself, or set into the quickstart."""
    if "stages" in tree and isinstance(tree["stages"], dict):
        stages, rest = tree["stages"], {k: v for k, v in tree.items() if k != "stages"}
    elif tree and all(is_stage(value) for value in tree.values()):
        stages, rest = tree, {}
    elif tree and set(tree) <= {"defaults", "launcher"}:  # a stage's launcher: every stage's
        defaults = dict(tree.get("defaults") or {})
        defaults.update({"launcher": tree["launcher"]} if "launcher" in tree else {})
        stages, rest = {}, {"defaults": defaults}
    else:
        return None
    stages = {name: stage for name, stage in stages.items() if stage is not None}
    if "name" in rest and not referenced_stages(stages) - set(stages):
        return {**rest, "stages": stages}
    quickstart = yaml.safe_load(QUICKSTART.read_text())
    merged = {**quickstart, **{k: v for k, v in rest.items() if k != "defaults"}}
    merged["defaults"] = deep_merge(quickstart.get("defaults", {}), rest.get("defaults", {}))
    merged["stages"] = deep_merge(quickstart["stages"], stages)  # a stage's fragment refines its namesake
    return merged


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# What a pipeline in the docs may name that only the reader has: their data files, model
# directories and modules. A refusal for any other reason is a problem of the docs.
READERS_OWN = re.compile(
    r"matches no files|does not exist|is not a Hugging Face model directory|"
    r"cannot import 'my_|cannot find module 'my_"
)


def validate_pipeline(tree: dict, where: str, store: Path, overrides: list[str] | None = None) -> str | None:
    """What `trainflow status` says of the pipeline `tree`, if it refuses it."""
    from engine.config import ConfigError
    from flows.inspection import status_rows
    from flows.spec import load_plan

    path = store / "pipeline.yaml"
    tree = copy.deepcopy(tree)
    tree["store"] = str(store / "artifacts")
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    try:
        status_rows(load_plan(path, overrides, store / "artifacts"))
    except ConfigError as e:
        wrong = [line for line in str(e).splitlines() if not READERS_OWN.search(line)]
        return f"{where}: `trainflow status` refuses it:\n  " + "\n  ".join(wrong) if wrong else None
    return None


def config_schemas() -> list[type[BaseModel]]:
    """Every schema a config fragment may belong to: the stage kinds' and the nested ones users write."""
    from engine.models.config import ModelConfig
    from tasks.launch.run import LauncherSpec
    from tasks.registry import get_stage_kind, stage_kind_names

    schemas = [get_stage_kind(task).config_schema for task in stage_kind_names()]
    return [*dict.fromkeys(schemas), ModelConfig, LauncherSpec]


def validate_fragment(tree: dict, where: str) -> str | None:
    """A config fragment: the first schema with every key validates it, bar missing keys."""
    from engine.config import resolve_model_preset
    from engine.models.config import ModelConfig
    from engine.train.config import TrainConfig

    if "compute" in tree and set(tree) - {"compute"} <= {*ModelConfig.model_fields, *ModelConfig.FLAT_KEYS}:
        # A model preset (configs/models/*.yaml): the architecture with its compute defaults.
        tree = {"model": {k: v for k, v in tree.items() if k != "compute"}, "compute": tree["compute"]}
        candidates: list[type[BaseModel]] = [TrainConfig]
    else:
        candidates = [  # a model's fields may be written flat (engine/flat_keys.py)
            schema
            for schema in config_schemas()
            if set(tree) <= {*schema.model_fields, *getattr(schema, "FLAT_KEYS", ())}
        ]
    if not candidates:
        return f"{where}: no config schema has all of the keys {sorted(tree)} (nor is it a pipeline)"
    refusals = []
    for schema in candidates:
        fragment = copy.deepcopy(tree)
        if "model" in schema.model_fields:
            resolve_model_preset(fragment, where)
        try:
            schema.model_validate(fragment)
            return None
        except ValidationError as e:
            wrong = [err for err in e.errors() if err["type"] != "missing"]
            if not wrong:
                return None
            reasons = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in wrong)
            refusals.append(f"{schema.__name__}: {reasons}")
    return f"{where}: no config schema takes this fragment (" + " | ".join(refusals) + ")"


# --------------------------------------------------------------------------- shell


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, `$ ` prompts and comments dropped,
    `a && b` split."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        command: list[str] = []
        for token in [*tokens, "&&"]:
            if token in ("&&", "||", ";", "|"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(token)
    return commands


def trainflow_parser() -> argparse.ArgumentParser:
    from flows.cli import build_parser

    return build_parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def check_trainflow(argv: list[str], where: str, store: Path) -> str | None:
    parser = trainflow_parser()
    commands = subparsers(parser)
    if argv and argv[0].startswith("--"):
        return None if argv[0] in ("--version", "--help", "-h") else f"{where}: trainflow has no option {argv[0]}"
    if not argv or argv[0] not in commands:
        return f"{where}: `trainflow {' '.join(argv[:1])}`: no such command; commands: {', '.join(commands)}"
    sub = commands[argv[0]]
    options = {option for action in sub._actions for option in action.option_strings}
    for token in argv[1:]:
        if token.startswith("-") and token.split("=")[0].rstrip("]") not in options and not PLACEHOLDER.search(token):
            return f"{where}: `trainflow {argv[0]}` has no option {token}"
    if any(PLACEHOLDER.search(token) for token in argv[1:]):
        return None  # a usage line: its command and options exist
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        return f"{where}: `trainflow {' '.join(argv)}` does not parse"
    if any(a.startswith("-") or "=" not in a or not hasattr(args, "overrides") for a in extra):
        return f"{where}: `trainflow {' '.join(argv)}`: unrecognized arguments {extra}"
    pipeline = getattr(args, "pipeline", None)
    if pipeline and (ROOT / pipeline).is_file():
        tree = yaml.safe_load((ROOT / pipeline).read_text())
        return validate_pipeline(tree, where, store, [*args.overrides, *extra])
    return None


def check_python_m(argv: list[str], where: str) -> str | None:
    module = argv[argv.index("-m") + 1]
    path = ROOT / module.replace(".", "/")
    if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
        return None
    if module.split(".")[0] in (*PACKAGES, "bench", "tests"):
        return f"{where}: `python -m {module}`: no such module in this checkout"
    return None  # another program's module (pytest, pip, venv)


# --------------------------------------------------------------------------- the checks


@dataclass
class Report:
    problems: list[str]
    counts: dict[str, int]


def check_pages(pages: dict[Path, str], store: Path) -> Report:
    """Every problem of the code blocks of `pages` (path -> text)."""
    index = project_index()
    problems: list[str] = []
    counts = {"python": 0, "yaml": 0, "command": 0}
    registered: list[str] = []
    try:
        for page, text in pages.items():
            blocks = blocks_of(page, text)
            checker = PythonChecker(index)
            for block in blocks:
                if block.lang in ("python", "py"):
                    counts["python"] += 1
                    checker.check(block)
            problems += checker.problems
            registered += register_doc_stages(page, [b for b in blocks if b.lang in ("python", "py")], problems)
            for block in blocks:
                if block.lang in ("yaml", "yml"):
                    counts["yaml"] += 1
                    try:
                        tree = load_blocks_yaml(block)
                    except (yaml.YAMLError, AssertionError) as e:
                        problems.append(f"{block.where}: not YAML: {e}")
                        continue
                    pipeline = pipeline_of(tree)
                    problem = (
                        validate_pipeline(pipeline, block.where, store)
                        if pipeline is not None
                        else validate_fragment(tree, block.where)
                    )
                    problems += [problem] if problem else []
                elif block.lang in ("", "bash", "sh", "shell", "console", "text"):
                    for offset, command in enumerate_commands(block):
                        where = f"{block.where}:{offset}"
                        problem = None
                        if Path(command[0]).name == "trainflow":
                            counts["command"] += 1
                            problem = check_trainflow(command[1:], where, store)
                        elif Path(command[0]).name.startswith("python") and "-m" in command[1:-1]:
                            counts["command"] += 1
                            problem = check_python_m(command, where)
                        problems += [problem] if problem else []
    finally:
        from tasks.registry import unregister_stage

        for task in registered:
            unregister_stage(task)
        sys.modules.pop("my_stages", None)
    return Report(problems, counts)


def enumerate_commands(block: Block) -> list[tuple[int, list[str]]]:
    out = []
    for offset, line in enumerate(block.text.replace("\\\n", "\\ \n").splitlines(), 1):
        for command in shell_commands(line.rstrip("\\")):
            out.append((offset, command))
    return out


def register_doc_stages(page: Path, blocks: list[Block], problems: list[str]) -> list[str]:
    """A page's `@register_stage` blocks executed, in order, as the reader's module `my_stages`
    (the module its pipelines import); the stage kinds they registered."""
    from tasks.registry import stage_kind_names

    stage_blocks = [b for b in blocks if "@register_stage" in b.text]
    if not stage_blocks:
        return []
    before = set(stage_kind_names())
    module = types.ModuleType("my_stages")
    sys.modules["my_stages"] = module
    for block in stage_blocks:
        try:
            exec(compile(block.text, block.where, "exec"), module.__dict__)
        except Exception as e:  # the page's example is broken: say where
            problems.append(f"{block.where}: running the example raised {type(e).__name__}: {e}")
            break
    return [task for task in stage_kind_names() if task not in before]


@pytest.fixture(scope="module")
def pages() -> dict[Path, str]:
    return {page: page.read_text() for page in PAGES}


def test_every_code_block_of_the_docs_matches_the_code(pages, tmp_path):
    report = check_pages(pages, tmp_path)
    assert not report.problems, "docs out of step with the code:\n" + "\n".join(report.problems)
    # The check saw the blocks it is meant to see (a broken fence regex would pass vacuously).
    assert report.counts["python"] >= 10 and report.counts["yaml"] >= 20 and report.counts["command"] >= 30, report


def test_a_renamed_function_fails_the_docs_check(pages, tmp_path, monkeypatch):
    import engine.config
    import flows.pipeline

    # The code renames what the docs name: load_config (docs/engine.md) and Pipeline.run
    # (docs/pipelines.md), as a rename without a docs edit would leave them.
    monkeypatch.setattr(engine.config, "load_configuration", engine.config.load_config, raising=False)
    monkeypatch.delattr(engine.config, "load_config")
    monkeypatch.delattr(flows.pipeline.Pipeline, "run")
    named = {page: text for page, text in pages.items() if page.name in ("engine.md", "pipelines.md")}
    report = check_pages(named, tmp_path)
    assert any("engine.config has no `load_config`" in problem for problem in report.problems), report.problems
    assert any("`p.run`" in problem and "Pipeline has no `run`" in problem for problem in report.problems), report


def test_a_doctored_page_fails_the_docs_check(tmp_path):
    page = ROOT / "docs/pipelines.md"
    text = page.read_text()
    assert "pretrain.steps=400" in text and "task: pretrain" in text
    doctored = text.replace("pretrain.steps=400", "pretrain.stepz=400").replace("task: pretrain", "task: pretrian")
    report = check_pages({page: doctored}, tmp_path)
    joined = "\n".join(report.problems)
    assert "unknown key 'stepz'" in joined and "unknown task kind 'pretrian'" in joined, joined
