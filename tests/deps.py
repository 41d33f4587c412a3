"""Optional test dependencies: the parity references and servers a test file needs.

`need("torch")` imports a module the way `pytest.importorskip` does, but a missing one is
not allowed to vanish quietly where it matters: under CI (the `CI` variable set, as
.ci/run sets it) it fails the test file naming the package and the extra that installs it,
so an install that lost transformers cannot pass with every parity test skipped. Locally
the file is skipped and the reason names the extra.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# Top-level module -> the pyproject extra that installs it.
EXTRAS = {
    "torch": "parity",
    "transformers": "parity",
    "peft": "parity",
    "trl": "parity",
    "tensorflow": "tf",
    "tensorflow_datasets": "tf",
    "lm_eval": "eval",
    "moto": "test",
    "boto3": "s3",
    "s3fs": "s3",
    "gcsfs": "gcs",
    "gcp_storage_emulator": "test",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "ray": "ray",
    "sentencepiece": "test",
    "reasoning_gym": "envs",
}


def need(module: str) -> ModuleType:
    """The imported `module`; skipped locally, an error under CI, when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        extra = EXTRAS.get(module.split(".")[0], "test")
        message = f"{module} is not installed ({error}): pip install -e '.[{extra}]'"
        if os.environ.get("CI"):
            pytest.fail(f"CI needs every test dependency: {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)
