"""The evaluation report: one table comparing the models, their curves, sample completions.

report.json        {"models": {name: metrics}, "tasks": [...], "checkpoints": {...}}
report.md          the table, the plots, sample completions
loss_curves.png    per training stage in `curves`: its loss (GRPO: its mean reward)
metrics.png        each headline metric per model
samples.jsonl      every prompt's completions and rewards, per model
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402

from engine.evaluate.config import EvalConfig  # noqa: E402
from engine.train.metrics import read_metrics  # noqa: E402


def headline_metrics(models: dict[str, dict]) -> list[str]:
    keys: list[str] = []
    for metrics in models.values():
        for key in metrics:
            if key not in keys and (
                key in ("eval_loss", "eval_perplexity")
                or key.endswith("/accuracy")
                or "/pass@" in key
                or "/reward/" in key
                or (key.startswith("harness/") and "_stderr" not in key and not key.endswith(("/samples", "/seconds")))
            ):
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


def training_curve(records: list[dict]) -> tuple[str, list[tuple[int, float]]]:
    """What a training stage optimised, per step: the reward for GRPO (its surrogate loss says
    little), the training loss otherwise."""
    for key, label in (("reward", "mean reward"), ("loss", "training loss")):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            return label, points
    return "", []


def panel_keys(models: dict[str, dict]) -> list[str]:
    """Headline metrics worth a panel: a metric equal to an earlier one for every model (pass@1
    and the correctness reward are the accuracy under greedy decoding) is drawn once."""
    keys: list[str] = []
    for key in headline_metrics(models):
        if key == "eval_perplexity":
            continue
        values = [models[name].get(key) for name in models]
        if any(values == [models[name].get(other) for name in models] for other in keys):
            continue
        keys.append(key)
    return keys


def plot_report(out_dir: Path, models: dict[str, dict], curves: dict[str, str | Path]) -> list[str]:
    written = []
    series = {}
    for stage, path in curves.items():
        label, points = training_curve(read_metrics(path))
        if points:
            series[stage] = (label, points)
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2), squeeze=False)
        for ax, (stage, (label, points)) in zip(axes[0], series.items()):
            steps, values = zip(*points)
            ax.plot(steps, values)
            ax.set_title(stage)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "loss_curves.png", dpi=110)
        plt.close(fig)
        written.append("loss_curves.png")
    keys = panel_keys(models)
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False)
        names = list(models)
        for ax, key in zip(axes[0], keys):
            values = [models[n].get(key) for n in names]
            bars = ax.bar(names, [0.0 if v is None else v for v in values], color="tab:blue")
            for bar, value in zip(bars, values):
                if value is None:  # not measured for this model: say so rather than draw a 0
                    bar.set_alpha(0.0)
                    ax.annotate("n/a", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", fontsize=8)
            ax.set_title(key, fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "metrics.png", dpi=110)
        plt.close(fig)
        written.append("metrics.png")
    return written


def write_report(
    out_dir: Path,
    cfg: EvalConfig,
    models: dict[str, dict],
    samples: dict[str, list[dict]],
    checkpoints: dict[str, str],
    curves: dict[str, str | Path],
    *,
    write: bool = True,
) -> dict:
    """The report's content; written into out_dir when `write` (the primary process of a run)."""
    if not write:
        return {"models": models, "checkpoints": checkpoints, "tasks": [t.model_dump(mode="json") for t in cfg.tasks]}
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
    _atomic_write(
        out_dir / "samples.jsonl",
        "".join(json.dumps({"model": name, **item}) + "\n" for name, items in samples.items() for item in items),
    )
    return report


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
