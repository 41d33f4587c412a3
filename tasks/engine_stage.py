"""The base of stage kinds that run an engine entry point in child processes.

An engine stage writes the resolved engine config into its artifact, carries its input's
tokenizer along, launches `python -m <entry point>` through the stage's launcher and reads
the final metrics back (the child's `{"result": ...}` line, else metrics.jsonl). Keys that
the pipeline sets from inputs and the artifact directory (`pipeline_owned`) are refused in
a stage's config. `FineTuneStage` adds what SFT and GRPO share.

A training stage resuming over an earlier attempt's checkpoints first checks each step
against the digests the engine recorded when it committed it. The engine resumes from the
newest intact step, deleting the failing ones after it, or refuses when no step is intact;
the stage deletes the failing steps before it. So the manifest written at the end only
ever covers verified or freshly written checkpoints. A resumed run that has no step left to
train still reports the final metrics (from metrics.jsonl).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from engine.config import ConfigError, resolve_model_preset, to_yaml, validate
from engine.contract import (
    CHECKPOINT_CADENCE_FIELDS,
    METRICS_FILE,
    NON_SEMANTIC_FIELDS,
    TOKENIZER_DIR,
)
from tasks.launch.run import run_child
from tasks.registry import MODEL_KINDS, Input, StageContext, StageKind, has_input_ref
from tasks.store.consume import sha256_file
from tasks.store.objects import list_url_dirs, remove_url_tree, write_url
from tasks.store.urls import is_url


def get_dotted(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def with_dotted(model: BaseModel, dotted: str, value: Any) -> BaseModel:
    """A copy of a pydantic model with the field at `a.b.c` set to `value`."""
    head, _, rest = dotted.partition(".")
    if rest:
        value = with_dotted(getattr(model, head), rest, value)
    return model.model_copy(update={head: value})


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def last_metrics(path: Path) -> dict:
    """The last value of every key in a metrics.jsonl (what a child that died left)."""
    final: dict = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                final.update(json.loads(line))
            except json.JSONDecodeError:
                pass
    return final


def scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, type(None)))}


def with_logged_finals(result: dict, metrics_file: Path) -> dict:
    """The child's final metrics. A child resumed at its last step trains nothing and
    reports no loss: the last values in metrics.jsonl fill the gaps (final_loss = last loss)."""
    if result.get("final_loss") is not None:
        return result
    logged = last_metrics(metrics_file)
    logged.pop("step", None)
    filled = {**logged, **{k: v for k, v in result.items() if v is not None}}
    if logged.get("loss") is not None:
        filled["final_loss"] = logged["loss"]
    return filled


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The steps of an Orbax checkpoint directory or URL. Locally an unfinished save is not
    a digit; at a URL it is (Orbax commits there with a file), and fails verification."""
    if is_url(str(directory)):
        return sorted(int(name) for name in list_url_dirs(str(directory)) if name.isdigit())
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def remove_step(directory: str | Path, step: int) -> None:
    if is_url(str(directory)):
        remove_url_tree(f"{directory}/{step}")
    else:
        shutil.rmtree(Path(directory) / str(step))


# Runs in a child: engine.train.checkpoint loads Orbax and JAX, which the pipeline process
# keeps out so that validating a pipeline and `trainflow status` answer at once.
_VERIFY_STEPS = (
    "import json, sys\n"
    "from engine.train.checkpoint import verify_step\n"
    "print(json.dumps({'result': {s: verify_step(sys.argv[1], int(s)) for s in sys.argv[2:]}}))\n"
)


def drop_unverified_steps(ctx: StageContext, directory: str | Path) -> list[int]:
    """Delete the steps older than the newest intact one whose files no longer match the
    digests recorded when they were committed (engine.train.checkpoint.verify_step); returns
    them. The engine resumes from the newest intact step and itself removes the failing steps
    newer than it (or refuses when none is intact), but never reads the older ones, which
    the manifest would otherwise cover unverified."""
    steps = checkpoint_steps(directory)
    if not steps:
        return []
    checked = (
        run_child(
            [sys.executable, "-c", _VERIFY_STEPS, str(directory), *map(str, steps)],
            log=ctx.log,
            what=f"stage '{ctx.stage}': verifying {directory}",
        ).result
        or {}
    )
    problems = {step: checked.get(str(step), ["not verified"]) for step in steps}
    intact = [step for step in steps if not problems[step]]
    dropped = [step for step in steps if intact and step < intact[-1] and problems[step]]
    for step in dropped:
        shown = ", ".join(problems[step][:3]) + (
            f" and {len(problems[step]) - 3} more" if len(problems[step]) > 3 else ""
        )
        ctx.log(
            f"checkpoint step {step} in {directory} differs from the digests recorded when it was committed "
            f"({shown}): deleted"
        )
        remove_step(directory, step)
    return dropped


def named_run(cfg: Any, stage: str) -> Any:
    """`cfg` with `metrics.run_name` set to the stage's name unless the stage set one, so the
    run is `stage` in TensorBoard, MLflow and W&B rather than an artifact id."""
    if cfg.metrics.run_name:
        return cfg
    return cfg.model_copy(update={"metrics": cfg.metrics.model_copy(update={"run_name": stage})})


class EngineStage(StageKind):
    """A stage kind whose work is one engine entry point (`entry_point`)."""

    launches_child = True
    entry_point: ClassVar[str]
    pipeline_owned: ClassVar[dict[str, str]] = {}
    """Dotted config keys the stage sets (from an input or its directory) -> where from."""

    def resolve_config(self, raw: dict, source: str) -> BaseModel:
        self.reject_pipeline_owned(raw, source)
        return super().resolve_config(raw, source)

    def reject_pipeline_owned(self, raw: dict, source: str) -> None:
        for key, owner in self.pipeline_owned.items():
            if get_dotted(raw, key) is not None:
                raise ConfigError(f"{source}: key '{key}' is set by the pipeline (from {owner}); remove it")

    @staticmethod
    def carry_tokenizer(ctx: StageContext, artifact: Path) -> bool:
        """Copy an input artifact's tokenizer/ into this one (a checkpoint carries its tokenizer)."""
        if not (artifact / TOKENIZER_DIR).is_dir():
            return False
        shutil.copytree(artifact / TOKENIZER_DIR, ctx.out_dir / TOKENIZER_DIR, dirs_exist_ok=True)
        return True

    def entry_module(self, ctx: StageContext) -> str:
        """The module the children run: `entry_point`, unless the stage's config picks another."""
        return self.entry_point

    def launch_engine(
        self, ctx: StageContext, *args: str, metrics_file: Path | None = None, total_steps: int | None = None
    ) -> dict[str, Any]:
        """Run `python -m <entry point> ARGS...`; the child's `{"result": ...}` (else the last
        metrics it logged)."""
        result = ctx.launch(
            [sys.executable, "-m", self.entry_module(ctx), *args],
            metrics_file=metrics_file,
            total_steps=total_steps,
        )
        return result.result or (last_metrics(metrics_file) if metrics_file else {})

    def train(self, ctx: StageContext, cfg: BaseModel, config_name: str, steps: int) -> dict[str, Any]:
        """Write `cfg` as the child's YAML and run the training entry point on it."""
        out = ctx.out_dir
        cfg = named_run(cfg, ctx.stage)
        (out / config_name).write_text(to_yaml(cfg))
        config_arg = str(out / config_name)
        if ctx.artifact_url:  # a bucket store: every rank, on any host, reads the config at the URL
            config_arg = f"{ctx.artifact_url}/{config_name}"
            write_url(config_arg, (out / config_name).read_bytes())
        if ctx.resumed:  # files of an earlier attempt: trusted only where their digests match
            drop_unverified_steps(ctx, ctx.checkpoint_dir)
            saved = checkpoint_steps(ctx.checkpoint_dir)
            if saved:
                shown = ", ".join(map(str, saved[-3:]))
                ctx.log(f"resuming from the checkpoints in {ctx.checkpoint_dir} (steps {shown})")
            else:
                ctx.log(f"an earlier attempt saved no checkpoint in {ctx.checkpoint_dir}: starting at step 0")
        result = self.launch_engine(ctx, config_arg, metrics_file=out / METRICS_FILE, total_steps=steps)
        return scalars(with_logged_finals(result, out / METRICS_FILE))


# --------------------------------------------------------------------------- fine-tuning


def file_digests(path: str | None) -> dict[str, str]:
    """sha256 of a data file, or of each *.jsonl file of a directory (by name)."""
    if not path or has_input_ref(path):  # inside an input artifact: its id covers the bytes
        return {}
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    return {f.name: sha256_file(f) for f in files}


def absolute_data_path(value: str | None, key: str, source: str) -> str | None:
    if value is None or has_input_ref(value):
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{source}: key '{key}': {value} does not exist")
    return str(path.absolute())


class FineTuneStage(EngineStage):
    """What the SFT and GRPO stages share: a checkpoint (and optionally a corpus) in, a
    checkpoint out, a JSONL `data.path`, and the stage's entry point in a child process."""

    output = "checkpoint"
    pipeline_owned = {
        "checkpoint.directory": "the artifact directory",
        "checkpoint.init_from": "input 'checkpoint'",
        "metrics_dir": "the artifact directory",
        "tokenizer": "input 'checkpoint' (its tokenizer/)",
    }
    non_semantic = (*NON_SEMANTIC_FIELDS, *CHECKPOINT_CADENCE_FIELDS, *pipeline_owned)
    data_doc: ClassVar[str]
    """What data.path holds, for the error when it is missing."""
    data_files: ClassVar[dict[str, str]] = {"data.path": "data_files", "data.eval_path": "eval_files"}
    """Dotted keys of the data files the engine reads -> the fingerprint entry that holds their
    bytes' digests. Resolved to absolute paths when planned, identified by their bytes (a path
    inside an input, `{input:corpus}/...`, by the input's id and the path), and moved to an
    input's URL where it has one when run."""

    possible_outputs: ClassVar[tuple[str, ...]] = ("adapter",)

    def output_kind(self, config) -> str:
        return "adapter" if getattr(config, "lora", None) is not None else "checkpoint"

    @staticmethod
    def checkpoint_inputs(doc: str) -> dict[str, Input]:
        return {
            "checkpoint": Input(MODEL_KINDS, doc=doc),
            "corpus": Input(
                "corpus", required=False, doc="files that data paths name as {input:corpus}/...", through_paths=True
            ),
        }

    def validate_raw(self, raw: dict, source: str):
        """The config validated, with data.path required; pipeline-owned keys refused."""
        self.reject_pipeline_owned(raw, source)
        resolve_model_preset(raw, source)
        cfg = validate(self.config_schema, raw, source)
        if not self.has_data(cfg):
            raise ConfigError(f"{source}: missing required key 'data.path' ({self.data_doc})")
        return cfg

    def has_data(self, cfg) -> bool:
        """Whether the config says where its examples come from (a stage with other sources than
        data.path says so here)."""
        return bool(cfg.data.path)

    def resolve_config(self, raw: dict, source: str) -> Any:
        cfg = self.validate_raw(raw, source)
        for key in self.data_files:
            cfg = with_dotted(cfg, key, absolute_data_path(get_dotted(cfg.model_dump(), key), key, source))
        return cfg

    def fingerprint(self, config: Any) -> dict:
        """The config's fingerprint, where each data file outside the store counts by its bytes
        (the `data_files` entries), not by where it lies."""
        fp = super().fingerprint(config)
        for key, entry in self.data_files.items():
            path = get_dotted(fp, key)
            if not has_input_ref(path or ""):
                parent, _, leaf = key.rpartition(".")
                (get_dotted(fp, parent) if parent else fp).pop(leaf, None)
            fp[entry] = file_digests(path)
        return fp

    def run(self, ctx: StageContext) -> dict[str, Any]:
        out, checkpoint_input = ctx.out_dir, ctx.inputs["checkpoint"]
        if not self.carry_tokenizer(ctx, checkpoint_input.path):
            raise ConfigError(f"stage '{ctx.stage}': input checkpoint {checkpoint_input.path} has no {TOKENIZER_DIR}/")
        tree = ctx.config.model_dump(mode="json")
        for key, value in {
            "checkpoint.directory": ctx.checkpoint_dir,
            "checkpoint.init_from": checkpoint_input.checkpoint_dir,
            "metrics_dir": str(out),  # written by rank 0 only, which runs beside this process
            # Read by every rank: at the input's URL on a bucket store, else the copy carried here.
            "tokenizer": checkpoint_input.for_ranks(str(checkpoint_input.path / TOKENIZER_DIR))
            if checkpoint_input.url
            else str(out / TOKENIZER_DIR),
        }.items():
            set_dotted(tree, key, value)
        for key in self.data_files:  # `{input:corpus}/...`: a file of an input, at its URL where it has one
            if isinstance(get_dotted(tree, key), str):
                set_dotted(tree, key, ctx.for_ranks(get_dotted(tree, key)))
        tree["progress"] = False  # progress reaches the pipeline log through metrics.jsonl
        cfg: Any = self.config_schema.model_validate(tree)  # a training schema: it has `steps`
        return self.train(ctx, cfg, f"{self.task}.yaml", cfg.steps)
