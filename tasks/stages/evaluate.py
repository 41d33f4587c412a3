"""The evaluate stage: checkpoints in, an eval_report artifact out.

    <out>/report.json, report.md, loss_curves.png, metrics.png, samples.jsonl  (engine/evaluate)
    <out>/evaluate.yaml                                                          the resolved config

Inputs: `dataset` (optional; held-out loss on its validation split), `corpus` (optional;
files named as `{input:corpus}/...` in generation tasks) and any number of checkpoints,
each under the name it gets in the report:

    evaluate:
      task: evaluate
      inputs: {dataset: tokenize, corpus: problems, pretrain: pretrain, sft: sft, grpo: grpo}

The loss curves are those of every training stage in the models' lineage. `harness:` in the
config runs lm-evaluation-harness tasks on every model too (docs/evaluation.md); their metrics
land in the artifact's as `<model>/harness/<task>/<metric>`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from engine.config import ConfigError, validate
from engine.contract import CHECKPOINT_DIR, MANIFEST, METRICS_FILE
from engine.evaluate.config import EvalConfig
from tasks.engine_stage import EngineStage, named_run
from tasks.registry import MODEL_KINDS, Input, StageContext
from tasks.store.records import ArtifactRef


def _ancestors(ref_path: Path, store_root: Path) -> list[tuple[str, Path]]:
    """(stage, artifact dir) of an artifact and all its ancestors, oldest first, no repeats."""
    seen: dict[Path, str] = {}

    def visit(path: Path) -> None:
        manifest_path = path / MANIFEST
        if path in seen or not manifest_path.is_file():
            return
        manifest = json.loads(manifest_path.read_text())
        for parent in manifest.get("parents", []):
            visit(store_root / parent["path"])
        seen[path] = manifest.get("stage", path.parent.name)

    visit(ref_path)
    return [(stage, path) for path, stage in seen.items()]


def about_inputs(inputs: dict[str, ArtifactRef], split: str, ancestors: list[tuple[str, Path]]) -> dict:
    """What the report says its data is (engine.evaluate.report.measured_on): the dataset by
    stage and id, and which training stages learned from the rest of it (held-out loss on the
    text pretraining read is not a measure of the tasks); the inputs' directories (and URLs) by name."""
    about: dict[str, Any] = {  # a bucket's input by its staging copy and by its URL, where its files are read
        "paths": {
            where: f"{ref.stage}/{ref.id[:8]}" for ref in inputs.values() for where in (str(ref.path), ref.url) if where
        }
    }
    dataset = inputs.get("dataset")
    if dataset is None:
        return about
    sources = [s.get("name") or s.get("path") for s in (dataset.manifest.get("config") or {}).get("sources", [])]
    trained = []
    for stage, path in ancestors:
        manifest = json.loads((path / MANIFEST).read_text())
        if any(p.get("id") == dataset.id for p in manifest.get("parents", [])) and stage not in trained:
            trained.append(stage)
    data = f"dataset {dataset.stage}/{dataset.id[:8]}"
    if sources:
        data += f" (sources: {', '.join(map(str, sources))})"
    if trained:
        data += f", held out from the text that {' and '.join(trained)} trained on, not the tasks' prompts"
    about.update(data=data, data_label=f"{dataset.stage}:{split}")
    return about


def _trained(path: Path) -> bool:
    """Whether the artifact at `path` holds a checkpoint (at the URL of a bucket store, its
    manifest lists the files)."""
    manifest = json.loads((path / MANIFEST).read_text())
    files = manifest.get("files", {})
    return (path / CHECKPOINT_DIR).is_dir() or any(rel.startswith(CHECKPOINT_DIR + "/") for rel in files)


_PROGRESS = re.compile(r"^evaluate: .* \| (\d+)%")


class EvaluateStage(EngineStage):
    task = "evaluate"
    entry_point = "engine.evaluate"
    output = "eval_report"
    inputs = {
        "dataset": Input("dataset", required=False, doc="token dataset for held-out loss"),
        "corpus": Input(
            "corpus", required=False, doc="files that tasks name as {input:corpus}/...", through_paths=True
        ),
    }
    other_inputs = Input(MODEL_KINDS, doc="a model (checkpoint or adapter) to evaluate, named by its input name")
    config_schema = EvalConfig
    version = 2  # 2: the report says what each metric was measured on, merges equal columns
    pipeline_owned = {"data_path": "input 'dataset'"}
    non_semantic = ("metrics",)

    def resolve_config(self, raw: dict, source: str) -> EvalConfig:
        self.reject_pipeline_owned(raw, source)
        return validate(EvalConfig, raw, source)

    def run(self, ctx: StageContext) -> dict[str, Any]:
        out = ctx.out_dir
        models = {name: ref for name, ref in ctx.inputs.items() if name not in self.inputs}
        if not models:
            raise ConfigError(f"stage '{ctx.stage}': no checkpoint inputs to evaluate")
        tree = named_run(ctx.config, ctx.stage).model_dump(mode="json")
        if "dataset" in ctx.inputs:
            tree["data_path"] = ctx.inputs["dataset"].data_dir  # the shards at the bucket's URL, or here
        for task in tree["tasks"]:  # `{input:corpus}/...`: read by every rank, at the input's URL where it has one
            if task.get("path"):
                task["path"] = ctx.for_ranks(task["path"])
        store_root = next(iter(models.values())).path.parent.parent
        curves, ancestors = {}, []
        for ref in models.values():
            for stage, path in _ancestors(ref.path, store_root):
                ancestors.append((stage, path))
                if (path / METRICS_FILE).is_file() and _trained(path):
                    curves[stage] = str(path / METRICS_FILE)
        job = {
            "config": tree,
            "checkpoints": {name: ref.checkpoint_dir for name, ref in models.items()},
            "curves": curves,
            "about": about_inputs(ctx.inputs, ctx.config.split, ancestors),
        }
        (out / "evaluate.yaml").write_text(yaml.safe_dump(job, sort_keys=False))

        def on_line(line: str) -> None:  # `evaluate: sft (2/3): ... | 45%, ETA 32s`
            match = _PROGRESS.search(line)
            if match:
                ctx.hooks.progress(int(match.group(1)) / 100)

        argv = [sys.executable, "-m", self.entry_module(ctx), str(out / "evaluate.yaml"), str(out)]
        ctx.launch(argv, on_line=on_line)
        report = json.loads((out / "report.json").read_text())
        ctx.log("\n".join(line for line in (out / "report.md").read_text().splitlines() if line.startswith("|")))
        return {
            f"{name}/{key}": value
            for name, metrics in report["models"].items()
            for key, value in metrics.items()
            if isinstance(value, (int, float))
        }
