"""lm-evaluation-harness over the engine (engine/evaluate/harness.py): the `trainflow` model's
log-likelihoods equal lm-eval's `hf` model's on the Hugging Face export of the same checkpoint,
the `lm_eval` command line runs it, and an evaluate stage records harness metrics.

Everything is local: three task YAMLs (multiple choice, rolling perplexity, generation) over
JSONL files, read by `datasets`' json builder; no hub access.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from tests.deps import need

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = need("lm_eval")
transformers = need("transformers")

from flax import nnx  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model, model_registry  # noqa: E402
from lm_eval.evaluator import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from engine.config import ConfigError  # noqa: E402
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer  # noqa: E402
from engine.evaluate.config import EvalConfig, HarnessConfig  # noqa: E402
from engine.evaluate.evaluate import run_evaluate  # noqa: E402
from engine.evaluate.harness import TrainflowLM, harness_metrics, prepare_harness  # noqa: E402
from engine.evaluate.harness_cli import ENTRY_POINT_GROUP  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.models.config import ComputeConfig, ModelConfig  # noqa: E402
from engine.models.transformer import Transformer  # noqa: E402
from engine.train.checkpoint import save_params  # noqa: E402
from flows.spec import Pipeline  # noqa: E402
from tasks.runner import RAN, execute_stage  # noqa: E402
from tasks.store.records import read_manifest  # noqa: E402
from tests.conftest import child_xla_flags  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "the quick brown fox jumps over the lazy dog. " * 10,
    "Question: what colour is the sky? Answer: blue. The grass is green and the sun is yellow. " * 5,
]
QUESTIONS = [
    {"question": "What colour is the sky?", "choices": [" blue", " green", " red"], "label": 0},
    {"question": "What colour is the grass?", "choices": [" blue", " green", " yellow"], "label": 1},
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " fence", " moon"], "label": 0},
    {"question": "What colour is the sun?", "choices": [" yellow", " blue"], "label": 0},
]
DOCUMENTS = [  # the second is longer than max_length: several rolling windows
    {"text": "the lazy dog sleeps."},
    {"text": "the quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long."},
]
MAX_LENGTH = 24
# Child processes on one device (compiles faster); the adapter's sharding is tested in-process.
ONE_DEVICE_ENV = {"XLA_FLAGS": child_xla_flags()}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint artifact (checkpoint/ + tokenizer/) of a random model, its Hugging Face
    export, and three local harness tasks."""
    root = tmp_path_factory.mktemp("harness")
    artifact = root / "model"
    bundle = train_tokenizer(TokenizerConfig(vocab_size=300), TEXTS, add_bos=True)
    save_tokenizer(bundle, artifact / "tokenizer")
    cfg = ModelConfig(
        vocab_size=bundle.vocab_size,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=48,
        max_seq_len=64,
        init_std=0.25,  # peaked distributions: greedy choices and generations are not near-ties
    )
    # Initialised under jit: one compilation, where eager NNX init runs op by op.
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]))()
    meta = {"step": 0, "model": cfg.model_dump(mode="json"), "compute": ComputeConfig().model_dump(mode="json")}
    save_params(artifact / "checkpoint", 0, _numpy(params), meta)
    export_hf(artifact / "checkpoint", root / "hf")
    tasks = root / "tasks"
    tasks.mkdir()
    write_tasks(tasks, root / "data", root / "datasets-cache")
    return {"artifact": artifact, "hf": root / "hf", "tasks": tasks, "root": root}


def _numpy(tree):
    """The params as nested dicts of numpy arrays (save_params writes what it is given)."""
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def docs_task() -> dict:
    """The task YAML docs/evaluation.md shows (its data file is the test's)."""
    text = (REPO / "docs/evaluation.md").read_text()
    start = text.index("# harness_tasks/colours.yaml")
    return yaml.safe_load(text[start : text.index("```", start)])


def write_tasks(tasks: Path, data: Path, cache: Path) -> None:
    data.mkdir()
    for name, rows in (("questions", QUESTIONS), ("documents", DOCUMENTS)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def dataset(name):  # absolute paths: `datasets` reads data_files relative to the working directory
        return {
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data / f"{name}.jsonl")}, "cache_dir": str(cache)},
            "test_split": "test",
        }

    specs = {
        "tf_choice": {**docs_task(), **dataset("questions")},  # docs/evaluation.md's example
        "tf_perplexity": {
            **dataset("documents"),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ],
        },
        "tf_generate": {
            **dataset("questions"),
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{choices[label]}}",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 6, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
    }
    for name, spec in specs.items():
        (tasks / f"{name}.yaml").write_text(yaml.safe_dump({**spec, "task": name}))


@pytest.fixture(scope="module")
def trainflow_lm(model) -> TrainflowLM:
    """The adapter on 8 devices: rows over data=2, params over fsdp=2 x tensor=2."""
    return TrainflowLM(checkpoint=str(model["artifact"]), max_length=MAX_LENGTH, batch_size=8, data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def hf_lm(model):
    """lm-eval's own `hf` model on the checkpoint's Hugging Face export."""
    return get_model("hf")(pretrained=str(model["hf"]), dtype="float32", device="cpu", max_length=MAX_LENGTH)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_the_hf_backend_on_the_export(trainflow_lm, hf_lm):
    hf = hf_lm
    pairs = [(q["question"], c) for q in QUESTIONS for c in q["choices"]]
    pairs += [("", " the lazy dog"), ("What colour is the sky? " * 4, " blue")]  # empty context; truncated
    ours = trainflow_lm.loglikelihood(requests("loglikelihood", pairs))
    theirs = hf.loglikelihood(requests("loglikelihood", pairs), disable_tqdm=True)
    np.testing.assert_allclose([o[0] for o in ours], [t[0] for t in theirs], atol=1e-4)
    assert [o[1] for o in ours] == [t[1] for t in theirs]
    assert len({round(o[0], 3) for o in ours}) > len(ours) // 2  # a real model: the scores differ

    documents = [(d["text"],) for d in DOCUMENTS]
    assert len(trainflow_lm.tok_encode(DOCUMENTS[1]["text"])) > MAX_LENGTH  # two windows
    ours = trainflow_lm.loglikelihood_rolling(requests("loglikelihood_rolling", documents))
    theirs = hf.loglikelihood_rolling(requests("loglikelihood_rolling", documents), disable_tqdm=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)

    # Greedy generation: the same text as HF's generate, cut at the stop string.
    gen = [(q["question"], {"until": ["."], "max_gen_toks": 6, "do_sample": False}) for q in QUESTIONS]
    assert trainflow_lm.generate_until(requests("generate_until", gen)) == hf.generate_until(
        requests("generate_until", gen), disable_tqdm=True
    )


def test_harness_tasks_score_as_with_the_hf_backend(model, trainflow_lm, hf_lm):
    """Whole tasks through simple_evaluate: the same metrics from either model."""
    manager = TaskManager(include_path=str(model["tasks"]), include_defaults=False)
    names = ["tf_choice", "tf_perplexity", "tf_generate"]
    ours = simple_evaluate(model=trainflow_lm, tasks=names, task_manager=manager, bootstrap_iters=0)
    theirs = simple_evaluate(model=hf_lm, tasks=names, task_manager=manager, bootstrap_iters=0)
    ours, theirs = harness_metrics(ours), harness_metrics(theirs)
    assert (
        set(ours)
        == set(theirs)
        >= {
            "harness/tf_choice/acc",
            "harness/tf_perplexity/word_perplexity",
            "harness/tf_generate/exact_match",
            "harness/tf_choice/samples",
        }
    )
    for key in ours:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-4, err_msg=key)
    assert ours["harness/tf_choice/samples"] == len(QUESTIONS)


def docs_command(**values: str) -> list[str]:
    """docs/evaluation.md's `python -m engine.evaluate.harness_cli` command, with the values of
    its options (and of its model arguments) replaced by `values` where given."""
    text = (REPO / "docs/evaluation.md").read_text()
    start = text.index("python -m engine.evaluate.harness_cli --model trainflow")
    argv = shlex.split(text[start : text.index("```", start)].replace("\\\n", " "))
    for i, word in enumerate(argv):
        if word.startswith("--") and word[2:] in values:
            argv[i + 1] = values[word[2:]]
    i = argv.index("--model_args")
    model_args = dict(pair.split("=", 1) for pair in argv[i + 1].split(","))
    argv[i + 1] = ",".join(f"{k}={values.get(k, v)}" for k, v in model_args.items())
    return [sys.executable, *argv[1:]]


def test_the_docs_lm_eval_command_runs_the_trainflow_model(model, tmp_path):
    """As docs/evaluation.md writes it (batch_size among the model arguments, which lm-eval
    also passes from its own --batch_size), on the test's checkpoint and task."""
    out = tmp_path / "results"
    command = docs_command(
        checkpoint=str(model["artifact"]),
        tasks="tf_choice",
        include_path=str(model["tasks"]),
        limit="3",
        output_path=str(out),
    )
    assert "batch_size=16" in command[command.index("--model_args") + 1]
    run = subprocess.run(
        command, cwd=REPO, env={**os.environ, **ONE_DEVICE_ENV}, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tf_choice" in run.stdout and "acc" in run.stdout  # lm-eval's results table
    (results,) = out.rglob("results_*.json")
    scored = json.loads(results.read_text())
    assert scored["config"]["model"] == "trainflow" and scored["n-samples"]["tf_choice"]["effective"] == 3
    assert 0.0 <= scored["results"]["tf_choice"]["acc,none"] <= 1.0


def test_the_model_arguments_batch_size_wins_over_lm_evals_own(model):
    """lm-eval hands every model its --batch_size (1 unless given) beside --model_args."""
    args = f"checkpoint={model['artifact']},batch_size=5"
    lm = TrainflowLM.create_from_arg_string(args, {"batch_size": 1, "max_batch_size": None, "device": None})
    assert lm.batch_size == 5
    lm = TrainflowLM.create_from_arg_string(f"checkpoint={model['artifact']}", {"batch_size": 3, "device": "cpu"})
    assert lm.batch_size == 3


def test_an_evaluate_stage_records_harness_metrics(model, tmp_path):
    """convert (the export, back to a checkpoint artifact) -> evaluate with harness tasks."""
    pipeline = Pipeline("harness", store=tmp_path / "store")
    base = pipeline.stage("base", task="convert", config={"source": str(model["hf"])})
    harness = {
        "tasks": ["tf_choice", "tf_perplexity"],
        "include_path": str(model["tasks"]),
        "builtin_tasks": False,
        "num_fewshot": 0,
        "limit": 3,
    }
    pipeline.stage(
        "evaluate",
        task="evaluate",
        inputs={"base": base},
        config={"harness": harness},
        launcher={"kind": "local", "env": ONE_DEVICE_ENV},
    )
    plan = pipeline.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN, RAN]
    out = plan.store.artifact_dir("evaluate", plan.stages["evaluate"].job.artifact_id)
    metrics = read_manifest(out)["metrics"]
    assert metrics["base/harness/tf_choice/samples"] == 3 and metrics["base/harness/tf_perplexity/samples"] == 2
    assert 0.0 <= metrics["base/harness/tf_choice/acc"] <= 1.0
    assert metrics["base/harness/tf_perplexity/word_perplexity"] > 1.0
    assert "harness/tf_choice/acc" in (out / "report.md").read_text()  # a column of the report's table


def test_bad_harness_input_is_one_sentence_naming_the_key(model, tmp_path):
    with pytest.raises(ConfigError, match=r"^harness.include_path: .*missing is not a directory"):
        prepare_harness(HarnessConfig(tasks=["tf_choice"], include_path=str(tmp_path / "missing")))
    # Through the evaluation itself (what `python -m engine.evaluate` turns into exit 2): before any model loads.
    cfg = EvalConfig(harness={"tasks": ["tf_choise"], "include_path": str(model["tasks"]), "builtin_tasks": False})
    with pytest.raises(ConfigError, match=r"^harness.tasks: 'tf_choise' is not among the tasks under "):
        run_evaluate(cfg, {"model": tmp_path / "no-such-checkpoint"}, tmp_path / "out")
    with pytest.raises(
        ConfigError, match=r"^harness.tasks: 'tf_choise' is not among the tasks under .*; did you mean 'tf_choice'\?$"
    ):
        prepare_harness(HarnessConfig(tasks=["tf_choise"], include_path=str(model["tasks"]), builtin_tasks=False))
    with pytest.raises(ConfigError, match=r"model argument 'checkpont' .* did you mean 'checkpoint'"):
        TrainflowLM(checkpont=str(model["artifact"]))


def test_the_entry_point_pyproject_declares_loads_the_adapter_through_lm_evals_registry():
    """What `python -m engine.evaluate.harness_cli` does with each installed `lm_eval.models`
    entry point: registered as a lazy target, lm-eval's registry loads the adapter from it."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    point = EntryPoint(name="trainflow-entry-point", value=declared["trainflow"], group=ENTRY_POINT_GROUP)
    model_registry.register(point.name, target=point)
    assert get_model(point.name) is TrainflowLM is get_model("trainflow")
