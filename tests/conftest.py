"""Shared test set-up. 8 simulated CPU devices, so sharding is tested without accelerators."""

import os

from engine import compat

# Must be set before jax is imported anywhere in the test session. The suite's tiny models
# spend far more time compiling than running, so XLA:CPU compiles them the cheap way:
# - LLVM's optimisation level 0 for the generated kernels: about half the compile time of -O2;
# - fusions emitted by XLA's older loop emitter, not the MLIR fusion emitters (which jax 0.10
#   turns on): on six MoE and context-parallel tests, 22.4-25.1 s of backend compile instead
#   of 47.1-48.4, 57-63 CPU s instead of 102 (docs/development.md).
# Both are how XLA:CPU generates code, not what it computes: the optimised HLO holds the same
# operations (a tiny model's training step: 138 loop fusions with the loop emitter; 136 and 29
# single operations wrapped as fusions with the MLIR emitters), and products run in YNNPACK
# either way. The quickstart test runs on XLA's defaults, as a user runs it. jax 0.12's XLA
# has dropped the loop emitter and its flag (an unknown flag aborts the process), so the
# flag is passed only to an XLA that knows it (engine/compat.py, read without importing jax).
FAST_COMPILE = " ".join(["--xla_backend_optimization_level=0", *compat.cpu_loop_emitter_flags()])
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import atexit  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def child_xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for an engine process a test starts: `devices` simulated CPU devices (this
    process has 8), compiled at LLVM -O0 as this process compiles. A child given an XLA_FLAGS
    without the level compiles at XLA's default -O2 (one SFT child: 18.9 CPU s against 12.8)."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def stdlib_files(limit: int | None = None) -> list[str]:
    """Python standard-library sources: a real text corpus present on every machine."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return files[:limit] if limit else files


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory) -> Path:
    """The stdlib as byte-level tokens (ids 0-255, eos 256): real text, no tokenizer needed."""
    from engine.data.shards import write_dataset

    out = tmp_path_factory.mktemp("byte_dataset")
    docs = []
    for path in stdlib_files(240):
        raw = np.frombuffer(Path(path).read_bytes(), np.uint8).astype(np.int32)
        docs.append(np.concatenate([raw, [256]]))
    write_dataset(out, {"train": docs[:-16], "validation": docs[-16:]}, vocab_size=257, eos_id=256)
    return out


@pytest.fixture(scope="session")
def bpe_dataset(tmp_path_factory) -> Path:
    """The stdlib tokenized with a 512-token byte-level BPE trained on it (HF `tokenizers`)."""
    from tokenizers import ByteLevelBPETokenizer

    from engine.data.shards import write_dataset

    out = tmp_path_factory.mktemp("bpe_dataset")
    texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in stdlib_files(240)]
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=512, min_frequency=2, special_tokens=["<eos>"], show_progress=False)
    eos = tokenizer.token_to_id("<eos>")
    # Long files are cut into 512-token documents (as tokenize's max_document_tokens does),
    # so the global document shuffle mixes files within a batch.
    encoded = tokenizer.encode_batch(texts)

    def pieces(files):
        return [np.array(e.ids[i : i + 512] + [eos], np.int32) for e in files for i in range(0, len(e.ids), 512)]

    write_dataset(
        out,
        {"train": pieces(encoded[:-16]), "validation": pieces(encoded[-16:])},
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos,
    )
    return out


# --------------------------------------------------------------------------- Prefect

# Prefect keeps its profile, local results and SQLite database under PREFECT_HOME; tests
# use a throwaway one (set before anything imports prefect).
if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="trainflow-prefect-home-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)

# JAX's persistent compilation cache, fresh for each test session and shared by every engine
# process the tests start (children inherit the environment): the same tiny model is
# compiled by dozens of stages, and a cached executable is the very program XLA would build
# (the key covers the computation, devices and XLA flags).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainflow-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_server():
    """A real local Prefect server (SQLite in a temp dir), one per test session.

    Yields its API URL. Flows run in the test process report to it, and so do `trainflow`
    subprocesses, which inherit PREFECT_API_URL. Query it with prefect.get_client().
    """
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        url = PREFECT_API_URL.value()
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous


# --------------------------------------------------------------------------- xdist workers


def _exit_quietly(signum, frame):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pytest_sessionfinish(session):
    """An xdist worker still shutting down 5 s after the controller asked (freeing a test
    file's compiled programs and arrays takes that long on 2 loaded cores) gets a SIGINT from
    execnet; landing in JAX's gc callback, it printed an unraisable KeyboardInterrupt
    traceback at the end of the suite's output. Every result is reported by then: such a
    SIGINT ends the worker quietly instead (the controller, not a worker, cleans up the
    session's temporary directories)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        signal.signal(signal.SIGINT, _exit_quietly)


# --------------------------------------------------------------------------- file order

# Each file's recorded seconds (.ci/durations writes them from a JUnit report).
_DURATIONS = REPO / "tests" / "durations.json"


def pytest_configure(config):
    """xdist's `--no-loadscope-reorder`: whole files go out in collection order (below)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The test files longest first, each file's tests in their own order. Under
    `-n 2 --dist loadfile` xdist hands out whole files in collection order (pytest_configure
    turns off its own order, most tests first, which put the one-test end-to-end
    files last, so that the suite ended with one worker on a 200-second file and the other
    idle). Longest first is the classic greedy schedule: the files left at the end are
    short ones. A file with no figure yet counts as a middling one."""
    recorded = json.loads(_DURATIONS.read_text()) if _DURATIONS.is_file() else {}
    middling = float(np.median(list(recorded.values()))) if recorded else 0.0
    weight = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weight.setdefault(path, recorded.get(path, middling))
    first_seen = {path: i for i, path in enumerate(weight)}
    items.sort(key=lambda item: (-weight[p := item.nodeid.split("::", 1)[0]], first_seen[p]))
