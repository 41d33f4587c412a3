"""`python -m engine.evaluate.harness_cli [lm_eval arguments]`: lm-eval's own command line
(every subcommand and flag of `lm_eval`) with the `trainflow` model registered:

    python -m engine.evaluate.harness_cli --model trainflow --model_args checkpoint=ARTIFACT \\
        --tasks my_task --include_path tasks/ --limit 10

lm-eval 0.4 (0.4.13) discovers no third-party models: its registry accepts entry points as
lazy targets but never reads them (lm_eval/api/registry.py: `get_model` fills an empty
registry from lm_eval/models/__init__.py's fixed MODEL_MAPPING only; nothing in the package
calls importlib.metadata.entry_points), `--include_path` names task directories, and the
only user code it imports is a task YAML's `!function` (lm_eval/tasks/_yaml_loader.py). So a
bare `lm_eval --model trainflow` cannot see an installed adapter, and no clean hook makes it
(upstream's PR #4013 adds entry-point discovery, in no release yet). This module is that
discovery: it imports the adapter (its `register_model` decorator) and registers every other
`lm_eval.models` entry point installed (pyproject.toml declares trainflow's), then hands
over to lm-eval's CLI.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import model_registry

import engine.evaluate.harness  # noqa: F401  (registers `trainflow`)

ENTRY_POINT_GROUP = "lm_eval.models"


def register_entry_points() -> list[str]:
    """Register the installed `lm_eval.models` entry points lm-eval does not know yet, as
    the lazy targets its registry loads on first use; their names."""
    added = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in model_registry:
            model_registry.register(point.name, target=point)
            added.append(point.name)
    return added


def main() -> None:
    register_entry_points()
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
