"""Evaluation of one or more checkpoints: held-out loss, generation accuracy, a report.

For every model: loss and perplexity on a token dataset's held-out split, and for every
generation task the completions of its prompts scored by the same reward functions GRPO
uses (engine/posttrain/rewards.py): accuracy (the share of prompts whose `correct` reward is at
least `correct_threshold`), pass@k (the unbiased estimator of Chen et al. 2021) and the
mean of each reward; and for `harness:` the lm-evaluation-harness tasks it names, run on the
model in this process (harness.py), as `harness/<task>/<metric>`.

The output directory holds the report (report.py). `python -m engine.evaluate JOB.yaml OUT_DIR`
runs it alone (__main__.py).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from engine.config import ConfigError
from engine.data import urls
from engine.data.pipeline import make_dataset
from engine.data.tokenizer import load_saved
from engine.evaluate.config import EvalConfig, GenerationTask
from engine.evaluate.report import write_report
from engine.inference.sample import Sampler, decode_completions, encode_prompts, left_pad, tokenizer_dir_for
from engine.posttrain.rewards import compute_rewards, load_reward, nan_stats
from engine.progress import Eta, format_duration
from engine.train.checkpoint import load_params, stored_configs
from engine.train.config import TrainConfig
from engine.train.hooks import log_to_stderr
from engine.train.metrics import MetricsWriter, flat_params
from engine.train.trainer import Trainer

try:  # the `eval` extra: lm-evaluation-harness tasks; without it a config naming them is refused
    from engine.evaluate.harness import HarnessTasks, LoadedModel, prepare_harness, run_harness
except ModuleNotFoundError as missing:
    if missing.name != "lm_eval" and not (missing.name or "").startswith("lm_eval."):
        raise
    prepare_harness = None  # type: ignore[assignment]


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, c of them correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def load_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """The records of a JSONL file, a local one or one at a bucket URL (a stage on a bucket store)."""
    path = str(path)
    if not (urls.exists(path) if urls.is_url(path) else Path(path).is_file()):
        raise ConfigError(f"evaluation prompts not found: {path}")
    records = []
    for number, line in enumerate(urls.read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if limit and len(records) >= limit:
            break
    if not records:
        raise ConfigError(f"{path}: no prompts")
    return records


class Progress:
    """`evaluate: <model> (2/3): arithmetic 256/500 prompts | 45%, ETA 32s`: a line per batch,
    the share of all batches of all models done and the time left at the pace so far (the
    evaluate stage reads the share as its progress)."""

    def __init__(self, total_batches: int, models: int, log: Callable[[str], None]):
        self.total, self.done, self.models = total_batches, 0, models
        self.model, self.index = "", 0
        self.log = log
        self.eta = Eta(total_batches)  # paced from the first batch done: compilation is not in it

    def start_model(self, name: str) -> None:
        self.model, self.index = name, self.index + 1

    def advance(self, batches: int, what: str) -> None:
        self.done += batches
        left = self.eta.update(self.done)
        tail = f"{100 * self.done / max(self.total, 1):.0f}%"
        if left is not None:
            tail += f", ETA {format_duration(left)}"
        self.log(f"evaluate: {self.model} ({self.index}/{self.models}): {what} | {tail}")


def batches_of(cfg: EvalConfig) -> int:
    """The batches one model's evaluation takes (the harness's tasks count as one)."""
    prompts = [(len(load_jsonl(path, task.limit)), task.batch_size) for task in cfg.tasks if (path := task.path)]
    return (cfg.loss_batches if cfg.data_path else 0) + sum(-(-n // size) for n, size in prompts) + bool(cfg.harness)


def _generation_metrics(
    task: GenerationTask, model_cfg, params, bundle, sampler, progress: Progress
) -> tuple[dict, list[dict]]:
    assert task.path is not None  # the tasks a run evaluates by generation name their file
    records = load_jsonl(task.path, task.limit)
    for i, r in enumerate(records):
        if task.prompt_field not in r:
            raise ConfigError(f"{task.path}: record {i + 1} has no field '{task.prompt_field}'")
    rewards = [(*load_reward(spec), spec) for spec in task.rewards]
    names = [name for name, _, _ in rewards]
    correct_name = task.correct or names[0]
    if correct_name not in names:
        raise ConfigError(f"tasks.{task.name}.correct: '{correct_name}' is not one of its rewards ({', '.join(names)})")
    correct_index = names.index(correct_name)
    prompts = [r[task.prompt_field] for r in records]
    prompt_ids = encode_prompts(bundle, prompts)
    if max(map(len, prompt_ids)) + task.max_new_tokens > model_cfg.max_seq_len:
        raise ConfigError(
            f"tasks.{task.name}: prompts plus max_new_tokens exceed the model's max_seq_len ({model_cfg.max_seq_len})"
        )
    n = task.samples
    scores = np.zeros((len(records), n, len(rewards)))
    samples: list[dict] = []
    pad = bundle.pad_id or 0
    for start in range(0, len(records), task.batch_size):
        chunk = list(range(start, min(start + task.batch_size, len(records))))
        rows = [i for i in chunk for _ in range(n)]
        tokens, mask = left_pad([prompt_ids[i] for i in rows], pad_id=pad)
        output = sampler(
            params,
            tokens,
            mask,
            seed=task.seed + start,
            max_new_tokens=task.max_new_tokens,
            temperature=task.temperature,
            top_k=task.top_k,
            top_p=task.top_p,
            eos_ids=(bundle.eos_id,),
            pad_id=pad,
        )
        texts = decode_completions(bundle, output)
        columns = {k: [records[i].get(k) for i in rows] for k in records[chunk[0]] if k != task.prompt_field}
        values = compute_rewards(
            rewards,
            prompts=[prompts[i] for i in rows],
            completions=texts,
            completion_ids=[row[m].tolist() for row, m in zip(output.tokens, output.mask)],
            columns=columns,
            max_completion_length=task.max_new_tokens,
            step=0,
        )
        scores[chunk[0] : chunk[-1] + 1] = values.reshape(len(chunk), n, len(rewards))
        for j, i in enumerate(rows):
            samples.append(
                {
                    "task": task.name,
                    "prompt": prompts[i],
                    "completion": texts[j],
                    "rewards": dict(zip(names, map(_finite_or_none, values[j]))),
                    "correct": bool(np.nan_to_num(values[j][correct_index], nan=-math.inf) >= task.correct_threshold),
                    "reference": {k: v for k, v in records[i].items() if k != task.prompt_field},
                }
            )
        progress.advance(1, f"{task.name} {min(start + task.batch_size, len(records))}/{len(records)} prompts")
    correct = np.nan_to_num(scores[:, :, correct_index], nan=-math.inf) >= task.correct_threshold
    metrics = {f"{task.name}/accuracy": float(correct[:, 0].mean())}
    for k in task.pass_at:
        if k <= n:
            metrics[f"{task.name}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(1)]))
    for j, name in enumerate(names):
        metrics[f"{task.name}/reward/{name}"] = nan_stats(scores[:, :, j].ravel())[0]
    metrics[f"{task.name}/prompts"] = len(records)
    return metrics, samples


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def evaluate_model(
    cfg: EvalConfig,
    checkpoint_dir: str | Path,
    log: Callable[[str], None],
    harness: HarnessTasks | None = None,
    progress: Progress | None = None,
) -> tuple[dict, list[dict]]:
    """Every metric of one checkpoint (a directory holding Orbax steps), computed as it was saved;
    `harness`: cfg.harness's tasks, prepared once for all models (prepare_harness)."""
    checkpoint_dir = str(checkpoint_dir)  # a local path, or a bucket URL that Path would fold into s3:/
    if progress is None:
        progress = Progress(batches_of(cfg), 1, log)
        progress.start_model(checkpoint_dir.rstrip("/").rsplit("/", 1)[-1])
    model_cfg, compute = stored_configs(checkpoint_dir)
    train_cfg = TrainConfig.model_validate(
        {
            "model": model_cfg.model_dump(),
            "compute": compute.model_dump(),
            "mesh": cfg.mesh.model_dump(),
            "data": {
                "path": cfg.data_path,
                "seq_len": min(cfg.seq_len, model_cfg.max_seq_len),
                "batch_size": cfg.batch_size,
                "shuffle": False,
            },
            "progress": False,
        }
    )
    trainer = Trainer(train_cfg)
    _, params, step = load_params(checkpoint_dir, trainer.abstract_params)
    metrics: dict[str, Any] = {"step": step, "num_params": model_cfg.num_params()}
    if cfg.data_path:
        t0 = time.perf_counter()
        seq_len = train_cfg.data.seq_len
        rows = iter(
            make_dataset(
                cfg.data_path, cfg.split, seq_len=seq_len, batch_size=cfg.batch_size, shuffle=False, repeat=True
            )
        )
        held_out = trainer.held_out_loss(params, (next(rows) for _ in range(cfg.loss_batches)))
        metrics.update({k: held_out[k] for k in ("eval_loss", "eval_perplexity")})
        progress.advance(
            cfg.loss_batches, f"held-out loss {metrics['eval_loss']:.4f} ({time.perf_counter() - t0:.1f} s)"
        )
    samples: list[dict] = []
    if not (cfg.tasks or harness):
        return metrics, samples
    tokenizer_dir = tokenizer_dir_for(checkpoint_dir)
    if tokenizer_dir is None:
        raise ConfigError(f"no tokenizer/ next to {checkpoint_dir}: generation and harness tasks need one")
    bundle = load_saved(tokenizer_dir)
    if cfg.tasks:
        sampler = Sampler(model_cfg, compute, trainer.mesh, trainer.param_shardings)
        for task in cfg.tasks:
            t0 = time.perf_counter()
            task_metrics, task_samples = _generation_metrics(task, model_cfg, params, bundle, sampler, progress)
            metrics.update(task_metrics)
            metrics[f"{task.name}/seconds"] = time.perf_counter() - t0
            samples.extend(task_samples)
    if harness:
        t0 = time.perf_counter()
        loaded = LoadedModel(model_cfg, compute, params, bundle, trainer.mesh, trainer.param_shardings, step)
        metrics.update(run_harness(harness, loaded, log))
        metrics["harness/seconds"] = time.perf_counter() - t0
        progress.advance(1, f"harness tasks ({metrics['harness/seconds']:.1f} s)")
    return metrics, samples


def run_evaluate(
    cfg: EvalConfig,
    checkpoints: dict[str, str | Path],
    out_dir: str | Path,
    *,
    curves: dict[str, str | Path] | None = None,
    about: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Evaluate every named checkpoint; write the report into out_dir; return report.json's content.
    `about`: what the inputs are, for the report to say what each metric was measured on
    (report.measured_on)."""
    log = log or log_to_stderr
    if not checkpoints:
        raise ConfigError("evaluate: no checkpoints to evaluate")
    for task in cfg.tasks:
        if not task.path:
            raise ConfigError(f"tasks.{task.name}.path is required")
        if max(task.pass_at) > task.samples:
            raise ConfigError(f"tasks.{task.name}: pass_at {max(task.pass_at)} needs samples >= {max(task.pass_at)}")
    harness = None
    if cfg.harness:
        if prepare_harness is None:
            raise ConfigError("harness: lm-eval is not installed; pip install 'trainflow[eval]'")
        harness = prepare_harness(cfg.harness)  # bad task names fail here, before any model loads
    models, samples = {}, {}
    progress = Progress(batches_of(cfg) * len(checkpoints), len(checkpoints), log)
    for name, directory in checkpoints.items():
        log(f"evaluate: model '{name}' ({directory})")
        progress.start_model(name)
        models[name], samples[name] = evaluate_model(cfg, directory, log, harness, progress)
    primary = jax.process_index() == 0  # one report, however many ranks
    write_to_sinks(Path(out_dir), cfg, models, primary, log)
    return write_report(
        Path(out_dir),
        cfg,
        models,
        samples,
        {k: str(v) for k, v in checkpoints.items()},
        curves or {},
        about=about,
        write=primary,
    )


def write_to_sinks(
    out_dir: Path, cfg: EvalConfig, models: dict[str, dict], primary: bool, log: Callable[[str], None]
) -> None:
    """Each model's results to metrics.jsonl and the sinks (TensorBoard by default) as
    eval/<model>/<metric> at the step its checkpoint was saved at."""
    writer = MetricsWriter(
        out_dir,
        enabled=primary,
        sinks=cfg.metrics,
        warn=log,
        params=flat_params(cfg.model_dump(mode="json", exclude={"metrics"})),
    )
    try:
        for name, metrics in models.items():
            writer.write(
                int(metrics.get("step") or 0),
                {
                    f"eval/{name}/{key}": value
                    for key, value in metrics.items()
                    if key not in ("step", "num_params") and isinstance(value, (int, float))
                },
            )
    finally:
        writer.close()
