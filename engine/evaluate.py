"""Evaluation of one or more checkpoints: held-out loss, generation accuracy, a report.

For every model: loss and perplexity on a token dataset's held-out split, and for every
generation task the completions of its prompts scored by the same reward functions GRPO
uses (engine/rewards.py): accuracy (the share of prompts whose `correct` reward is at
least `correct_threshold`), pass@k (the unbiased estimator of Chen et al. 2021) and the
mean of each reward.

Output directory:

    report.json        {"models": {name: metrics}, "tasks": [...], "checkpoints": {...}}
    report.md          one table comparing the models, the curves, sample completions
    loss_curves.png    training loss of every training stage given in `curves`
    metrics.png        each headline metric per model
    samples.jsonl      every prompt's completions and rewards, per model
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from pydantic import Field

from engine.config import ConfigError, MeshConfig, Strict
from engine.rewards import RewardSpec


class GenerationTask(Strict):
    """Prompts from a JSONL file, completed by each model and scored by reward functions."""

    name: str = "generation"
    path: str | None = None
    """JSONL with a prompt column and the columns the rewards read (e.g. `answer`)."""
    prompt_field: str = "prompt"
    limit: int | None = Field(None, gt=0)
    """Use the first `limit` prompts (None: all)."""
    rewards: list[RewardSpec] = Field(min_length=1)
    correct: str | None = None
    """Which reward decides correctness (its name); default: the first."""
    correct_threshold: float = 1.0
    samples: int = Field(1, gt=0)
    """Completions per prompt; pass@k needs samples >= k."""
    pass_at: list[int] = [1]
    temperature: float = Field(0.0, ge=0)
    """0: greedy decoding."""
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, gt=0)
    batch_size: int = Field(128, gt=0)
    seed: int = 0


class EvalConfig(Strict):
    """What to measure for every model."""

    data_path: str | None = None
    """Token dataset (engine/data.py) for held-out loss; None skips it."""
    split: str = "validation"
    loss_batches: int = Field(8, ge=1)
    seq_len: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0)
    tasks: list[GenerationTask] = []
    mesh: MeshConfig = MeshConfig()
    samples_in_report: int = Field(3, ge=0)
    """Example completions per model shown in report.md."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, c of them correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def load_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"evaluation prompts not found: {path}")
    records = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
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


def _generation_metrics(task: GenerationTask, model_cfg, params, bundle, sampler, log) -> tuple[dict, list[dict]]:
    from engine.rewards import compute_rewards, load_reward, nan_stats
    from engine.sample import decode_completions, encode_prompts, left_pad

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
        raise ConfigError(f"tasks.{task.name}: prompts plus max_new_tokens exceed the model's max_seq_len "
                          f"({model_cfg.max_seq_len})")
    n = task.samples
    scores = np.zeros((len(records), n, len(rewards)))
    samples: list[dict] = []
    pad = bundle.pad_id or 0
    for start in range(0, len(records), task.batch_size):
        chunk = list(range(start, min(start + task.batch_size, len(records))))
        rows = [i for i in chunk for _ in range(n)]
        tokens, mask = left_pad([prompt_ids[i] for i in rows], pad_id=pad)
        output = sampler(params, tokens, mask, seed=task.seed + start, max_new_tokens=task.max_new_tokens,
                         temperature=task.temperature, top_k=task.top_k, top_p=task.top_p,
                         eos_ids=(bundle.eos_id,), pad_id=pad)
        texts = decode_completions(bundle, output)
        columns = {k: [records[i].get(k) for i in rows] for k in records[chunk[0]] if k != task.prompt_field}
        values = compute_rewards(
            rewards, prompts=[prompts[i] for i in rows], completions=texts,
            completion_ids=[row[m].tolist() for row, m in zip(output.tokens, output.mask)],
            columns=columns, max_completion_length=task.max_new_tokens, step=0)
        scores[chunk[0]:chunk[-1] + 1] = values.reshape(len(chunk), n, len(rewards))
        for j, i in enumerate(rows):
            samples.append({"task": task.name, "prompt": prompts[i], "completion": texts[j],
                            "rewards": dict(zip(names, map(_finite_or_none, values[j])))})
        log(f"evaluate: {task.name}: {min(start + task.batch_size, len(records))}/{len(records)} prompts")
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


def evaluate_model(cfg: EvalConfig, checkpoint_dir: str | Path, log: Callable[[str], None]) -> tuple[dict, list[dict]]:
    """Every metric of one checkpoint (a directory holding Orbax steps)."""
    from engine.checkpoint import load_params, read_meta
    from engine.config import ModelConfig, TrainConfig
    from engine.sample import Sampler, tokenizer_dir_for
    from engine.tokenizer import load_saved
    from engine.train import Trainer

    checkpoint_dir = Path(checkpoint_dir)
    _, meta = read_meta(checkpoint_dir)
    model_cfg = ModelConfig.model_validate(meta["model"])
    train_cfg = TrainConfig.model_validate({
        "model": model_cfg.model_dump(), "mesh": cfg.mesh.model_dump(),
        "data": {"path": cfg.data_path, "seq_len": min(cfg.seq_len, model_cfg.max_seq_len),
                 "batch_size": cfg.batch_size, "shuffle": False},
        "progress": False,
    })
    trainer = Trainer(train_cfg)
    _, params, step = load_params(checkpoint_dir, trainer.abstract_params)
    metrics: dict[str, Any] = {"step": step, "num_params": model_cfg.num_params()}
    if cfg.data_path:
        t0 = time.perf_counter()
        metrics.update(trainer.evaluate(params, cfg.data_path, cfg.split, cfg.loss_batches))
        log(f"evaluate: held-out loss {metrics['eval_loss']:.4f} ({time.perf_counter() - t0:.1f} s)")
    samples: list[dict] = []
    if cfg.tasks:
        tokenizer_dir = tokenizer_dir_for(checkpoint_dir)
        if tokenizer_dir is None:
            raise ConfigError(f"no tokenizer/ next to {checkpoint_dir}: generation tasks need one")
        bundle = load_saved(tokenizer_dir)
        sampler = Sampler(model_cfg, trainer.mesh, trainer.param_shardings)
        for task in cfg.tasks:
            t0 = time.perf_counter()
            task_metrics, task_samples = _generation_metrics(task, model_cfg, params, bundle, sampler, log)
            metrics.update(task_metrics)
            metrics[f"{task.name}/seconds"] = time.perf_counter() - t0
            samples.extend(task_samples)
    return metrics, samples


# --------------------------------------------------------------------------- report


def headline_metrics(models: dict[str, dict]) -> list[str]:
    keys: list[str] = []
    for metrics in models.values():
        for key in metrics:
            if key not in keys and (key in ("eval_loss", "eval_perplexity") or key.endswith("/accuracy")
                                    or "/pass@" in key or "/reward/" in key):
                keys.append(key)
    return keys


def markdown_table(models: dict[str, dict], keys: list[str]) -> str:
    def fmt(value):
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) < 100 else f"{value:,.1f}"
        return str(value)

    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, metrics in models.items():
        lines.append(f"| {name} | " + " | ".join(fmt(metrics.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def plot_report(out_dir: Path, models: dict[str, dict], curves: dict[str, str | Path]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine.metrics import read_metrics

    written = []
    series = {}
    for stage, path in curves.items():
        points = [(r["step"], r["loss"]) for r in read_metrics(path) if r.get("loss") is not None]
        if points:
            series[stage] = points
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2), squeeze=False)
        for ax, (stage, points) in zip(axes[0], series.items()):
            steps, losses = zip(*points)
            ax.plot(steps, losses)
            ax.set_title(stage)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "loss_curves.png", dpi=110)
        plt.close(fig)
        written.append("loss_curves.png")
    keys = [k for k in headline_metrics(models) if k != "eval_perplexity"]
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False)
        names = list(models)
        for ax, key in zip(axes[0], keys):
            values = [models[n].get(key) or 0.0 for n in names]
            ax.bar(names, values, color="tab:blue")
            ax.set_title(key, fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "metrics.png", dpi=110)
        plt.close(fig)
        written.append("metrics.png")
    return written


def write_report(out_dir: Path, cfg: EvalConfig, models: dict[str, dict], samples: dict[str, list[dict]],
                 checkpoints: dict[str, str], curves: dict[str, str | Path]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_report(out_dir, models, curves)
    keys = headline_metrics(models)
    lines = ["# Evaluation report", "", markdown_table(models, keys), ""]
    for plot in plots:
        lines += [f"![{plot}]({plot})", ""]
    for name, items in samples.items():
        if items and cfg.samples_in_report:
            lines += [f"## Samples: {name}", ""]
            for item in items[: cfg.samples_in_report]:
                prompt = item["prompt"] if isinstance(item["prompt"], str) else json.dumps(item["prompt"])
                lines += ["```", f"{prompt}{item['completion']}", "```", f"rewards: {item['rewards']}", ""]
    report = {"models": models, "checkpoints": checkpoints, "tasks": [t.model_dump(mode="json") for t in cfg.tasks]}
    _atomic_write(out_dir / "report.json", json.dumps(report, indent=2))
    _atomic_write(out_dir / "report.md", "\n".join(lines))
    _atomic_write(out_dir / "samples.jsonl", "".join(
        json.dumps({"model": name, **item}) + "\n" for name, items in samples.items() for item in items))
    return report


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_evaluate(cfg: EvalConfig, checkpoints: dict[str, str | Path], out_dir: str | Path, *,
                 curves: dict[str, str | Path] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Evaluate every named checkpoint; write the report into out_dir; return report.json's content."""
    from engine.train import log_to_stderr

    log = log or log_to_stderr
    if not checkpoints:
        raise ConfigError("evaluate: no checkpoints to evaluate")
    for task in cfg.tasks:
        if not task.path:
            raise ConfigError(f"tasks.{task.name}.path is required")
        if max(task.pass_at) > task.samples:
            raise ConfigError(f"tasks.{task.name}: pass_at {max(task.pass_at)} needs samples >= {max(task.pass_at)}")
    models, samples = {}, {}
    for name, directory in checkpoints.items():
        log(f"evaluate: model '{name}' ({directory})")
        models[name], samples[name] = evaluate_model(cfg, directory, log)
    return write_report(Path(out_dir), cfg, models, samples, {k: str(v) for k, v in checkpoints.items()},
                        curves or {})


def main(argv: list[str] | None = None) -> int:
    """python -m engine.evaluate JOB.yaml OUT_DIR

    JOB.yaml: {config: EvalConfig, checkpoints: {name: checkpoint dir}, curves: {stage: metrics.jsonl}}.
    """
    from engine.config import load_yaml, validate

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m engine.evaluate JOB.yaml OUT_DIR", file=sys.stderr)
        return 2
    try:
        job = load_yaml(argv[0])
        unknown = set(job) - {"config", "checkpoints", "curves"}
        if unknown:
            raise ConfigError(f"{argv[0]}: unknown key(s) {', '.join(sorted(unknown))}; expected config, "
                              "checkpoints, curves")
        cfg = validate(EvalConfig, job.get("config") or {}, f"{argv[0]}: config")
        report = run_evaluate(cfg, job.get("checkpoints") or {}, argv[1], curves=job.get("curves") or {})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"result": {f"{m}/{k}": v for m, metrics in report["models"].items()
                                 for k, v in metrics.items() if isinstance(v, (int, float))}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
