"""The import rules of docs/design.md ("Layout") and engine/__init__.py, enforced.

Layering, package direction and acyclicity are import-linter contracts (CONTRACTS, the one
copy), checked by its `lint-imports` CLI in a subprocess: the CLI puts its working
directory first on sys.path, so the same check runs on this checkout or on a doctored copy
of it without touching this process's imports. The contracts see `if TYPE_CHECKING:`
imports too (a cycle through annotations is still a cycle to a reader), and they see
dynamic imports: `importlib.import_module("a.project.module")` is written into a copy of
the tree as the static import it stands for, and the contracts run on that copy. A dynamic
import of a name that is not a literal (a user's `module:function`, a pipeline's
`imports:`) is allowed only in the registries that resolve such names (REGISTRIES).
"Imports at the top" is an AST walk. No JAX is imported; the whole file takes seconds.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tasks", "flows")

# Read by import-linter as a pyproject-style TOML file. Layers are listed highest first;
# `|` separates independent siblings, `:` siblings that may import each other.
CONTRACTS = """
[tool.importlinter]
root_packages = ["engine", "tasks", "flows"]
include_external_packages = true
# `if TYPE_CHECKING:` imports count: an annotation that names a higher layer or closes a
# cycle is a dependency a reader has to follow all the same.
exclude_type_checking_imports = false

[[tool.importlinter.contracts]]
id = "engine-layers"
name = "engine: a lower layer never imports a higher one"
type = "layers"
layers = [
    "engine.evaluate",
    "engine.posttrain",
    "engine.interop",
    "engine.inference",
    "engine.train",
    "engine.parallel",
    "engine.models",
    "engine.ops | engine.data",
    "engine.config : engine.contract : engine.compat : engine.progress : engine.flat_keys",
]

[[tool.importlinter.contracts]]
id = "interop-under-posttrain"
name = "engine.interop (other tools' formats) imports nothing of engine.posttrain, not even through another module"
type = "forbidden"
source_modules = ["engine.interop"]
forbidden_modules = ["engine.posttrain"]

[[tool.importlinter.contracts]]
id = "families-config"
name = "engine.models.config never imports the families (they import ModelConfig; it reads family_registry)"
type = "forbidden"
source_modules = ["engine.models.config"]
forbidden_modules = ["engine.models.families"]

[[tool.importlinter.contracts]]
id = "engine-without-prefect"
name = "engine never imports Prefect (it runs in a notebook, a cluster job, a test)"
type = "forbidden"
source_modules = ["engine"]
forbidden_modules = ["prefect"]
allow_indirect_imports = true

[[tool.importlinter.contracts]]
id = "package-direction"
name = "flows -> tasks -> engine, never the other way"
type = "layers"
layers = ["flows", "tasks", "engine"]

[[tool.importlinter.contracts]]
id = "acyclic"
name = "no import cycles among the modules and subpackages of each package"
type = "acyclic_siblings"
ancestors = ["engine", "tasks", "flows"]
"""

# Function-level imports allowed only at the documented boundary (Prefect and JAX load
# only for the CLI commands that need them) and for the optional extras.
IMPORT_BOUNDARY = {"flows/cli.py"}
# Modules that import modules named at run time (a stage kind's `module:Class`, a pipeline's
# `imports:`, a user's `module:function`): the registries. Anywhere else an import_module
# must name a literal module, which the contracts then see as an import.
REGISTRIES = {
    "tasks/registry.py",
    "flows/spec.py",
    "engine/posttrain/registry.py",
    "engine/posttrain/rewards.py",
    "engine/posttrain/environments.py",
    "engine/posttrain/openenv_env.py",  # an OpenEnv server's Environment and models, by module:Class
}
OPTIONAL_EXTRAS = {
    "tensorflow",
    "tensorflow_datasets",
    "transformers",
    "boto3",
    "botocore",
    "mlflow",
    "wandb",
    "lm_eval",
    "reasoning_gym",
    "openenv",
    "uvicorn",
}
OPTIONAL_MODULES = {"tasks.launch.ray_launcher"}
"""trainflow's modules that import an optional extra (Ray) at their top: imported where they are used."""


@pytest.fixture(scope="module")
def contracts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("importlinter") / "contracts.toml"
    path.write_text(CONTRACTS)
    return path


def broken_contracts(root: Path, contracts: Path, *ids: str) -> str | None:
    """None if the packages under `root` keep the contracts `ids`, else lint-imports' report."""
    # What the `lint-imports` script runs; no cache, so nothing is written into `root`.
    cli = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    args = [str(contracts), "--no-cache", "--no-logo", *(f"--contract={i}" for i in ids)]
    env = {k: v for k, v in os.environ.items() if k != "FORCE_COLOR"} | {"COLUMNS": "250", "NO_COLOR": "1"}
    run = subprocess.run(
        [sys.executable, "-c", cli, *args], check=False, cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    return None if run.returncode == 0 else run.stdout + run.stderr


def dynamic_imports(source: str, filename: str) -> tuple[list[str], list[str]]:
    """(project modules imported by a literal `importlib.import_module`/`__import__`,
    `file:line` of each such call whose module is not a literal)."""
    literal, computed = [], []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if arg.value.split(".")[0] in PACKAGES:
                literal.append(arg.value)
        else:
            computed.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return literal, computed


def tree_with_dynamic_imports(root: Path, out: Path) -> Path:
    """A copy of the packages under `root` in which each literal dynamic import of a project
    module is also a static import at the end of its module, for the contracts to see."""
    for package in PACKAGES:
        shutil.copytree(root / package, out / package, ignore=shutil.ignore_patterns("__pycache__"))
        for path in sorted((out / package).rglob("*.py")):
            literal, _ = dynamic_imports(path.read_text(), str(path))
            if literal:
                lines = [f"import {module}  # dynamic: importlib.import_module" for module in literal]
                path.write_text(path.read_text() + "\n" + "\n".join(lines) + "\n")
    return out


def function_level_imports(source: str, filename: str) -> list[str]:
    """`file:line: import` for each import in a function or method body, bar the optional extras."""
    tree = ast.parse(source, filename)
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    # A set: an import in a nested function is inside its outer function too.
    nested = {
        node for function in functions for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    found = []
    for node in sorted(nested, key=lambda node: node.lineno):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            modules = ["." * node.level + (node.module or "")]
        if not all(module.split(".")[0] in OPTIONAL_EXTRAS or module in OPTIONAL_MODULES for module in modules):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.fixture(scope="module")
def dynamic_tree(tmp_path_factory) -> Path:
    return tree_with_dynamic_imports(ROOT, tmp_path_factory.mktemp("dynamic"))


def test_engine_layers(contracts, dynamic_tree):
    report = broken_contracts(dynamic_tree, contracts, "engine-layers", "families-config")
    assert report is None, report


def test_interop_imports_nothing_of_posttrain(contracts, dynamic_tree):
    """GRPO takes its vLLM sampler through its own seam (engine/posttrain/vllm_rollout.py): the
    formats of other tools sit below training and never reach back into it."""
    report = broken_contracts(dynamic_tree, contracts, "interop-under-posttrain")
    assert report is None, report


def test_interop_check_reports_an_import_of_posttrain(contracts, tmp_path):
    # The import the vLLM sampler once made: engine.interop.vllm_server -> engine.posttrain.grpo.
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    server = tmp_path / "engine/interop/vllm_server.py"
    server.write_text(server.read_text() + "\nfrom engine.posttrain.grpo import run_grpo\n")

    report = broken_contracts(tmp_path, contracts, "interop-under-posttrain")
    assert report is not None and "engine.interop.vllm_server -> engine.posttrain.grpo" in report, report


def test_flows_import_tasks_import_engine_never_back(contracts, dynamic_tree):
    report = broken_contracts(dynamic_tree, contracts, "package-direction")
    assert report is None, report


def test_no_import_cycles(contracts, dynamic_tree):
    report = broken_contracts(dynamic_tree, contracts, "acyclic")
    assert report is None, report


def test_modules_named_at_run_time_are_imported_only_by_registries():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            filename = path.relative_to(ROOT).as_posix()
            _, computed = dynamic_imports(path.read_text(), filename)
            if filename not in REGISTRIES:
                found += computed
    assert not found, (
        "import_module of a computed name outside the registries (name the module, or resolve it in one):\n"
        + "\n".join(found)
    )


def test_cycle_check_sees_a_dynamic_import(contracts, tmp_path):
    # The cycle the launchers once had: tasks.launch.run loaded tasks.launch.ray_launcher with
    # import_module, and ray_launcher imported its spec back from tasks.launch.run.
    tree = tmp_path / "src"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    ray_launcher = tree / "tasks/launch/ray_launcher.py"
    ray_launcher.write_text(ray_launcher.read_text() + "\nfrom tasks.launch.run import StageFailed as _StageFailed\n")
    run = tree / "tasks/launch/run.py"
    run.write_text(
        run.read_text().replace("import tasks.launch.ray_launcher as ray_launcher  #", "ray_launcher = None  #")
        + '\n\ndef _load_ray_launcher():\n    return importlib.import_module("tasks.launch.ray_launcher")\n'
        + "\n\nimport importlib  # noqa: E402\n"
    )
    assert broken_contracts(tree, contracts, "acyclic") is None  # unseen without the rewrite

    report = broken_contracts(tree_with_dynamic_imports(tree, tmp_path / "dynamic"), contracts, "acyclic")
    assert report is not None and "tasks" in report and "launch" in report, report


def test_cycle_check_sees_a_type_checking_import(contracts, tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "engine/models/config.py"
    config.write_text(
        config.read_text()
        + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.models import families\n"
    )
    report = broken_contracts(tmp_path, contracts, "families-config", "acyclic")
    assert report is not None and "engine.models.config -> engine.models.families" in report, report


def test_imports_at_the_top():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            filename = path.relative_to(ROOT).as_posix()
            if filename not in IMPORT_BOUNDARY:
                found += function_level_imports(path.read_text(), filename)
    assert not found, "function-level imports (move them to the top of the module):\n" + "\n".join(found)


def test_layer_check_reports_an_upward_import(contracts, tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    attention = tmp_path / "engine/ops/attention.py"
    lines = attention.read_text().splitlines() + ["from engine.train.trainer import Trainer"]
    attention.write_text("\n".join(lines) + "\n")
    line = len(lines)

    report = broken_contracts(tmp_path, contracts, "engine-layers")
    assert report is not None and f"engine.ops.attention -> engine.train.trainer (l.{line})" in report, report


def test_import_check_reports_an_import_in_a_function():
    filename = "engine/ops/attention.py"
    lines = (ROOT / filename).read_text().splitlines() + [
        "def late():",
        "    from engine.train.trainer import Trainer",  # caught
        "    import transformers.models",  # an optional extra: allowed
        "    return Trainer",
        "class Late:",
        "    def method(self):",
        "        import jax.numpy as jnp",  # caught
    ]

    found = function_level_imports("\n".join(lines) + "\n", filename)
    assert f"{filename}:{len(lines) - 5}: from engine.train.trainer import Trainer" in found
    assert f"{filename}:{len(lines)}: import jax.numpy as jnp" in found
    assert not any("transformers" in entry for entry in found)


def test_no_module_of_flows_shadows_the_standard_library():
    """Prefect puts the directory of a flow's entrypoint (flows/) first on sys.path when it loads
    it, and processes spawned from there inherit that path: a flows/inspect.py would be imported
    as the standard library's inspect (numpy's import then fails), a flows/gc.py as gc."""
    shadows = sorted(p.name for p in (ROOT / "flows").glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not shadows, f"flows/ modules named as standard-library modules: {shadows}"
