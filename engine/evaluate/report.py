"""The evaluation report: one table comparing the models, their curves, sample completions.

report.json        {"models": {name: metrics}, "tasks": [...], "checkpoints": {...},
                    "measured_on": {metric group: what it was measured on},
                    "equal_columns": {column: [metrics equal to it for every model]}}
report.md          the table (each column names its data; duplicates merged), what each
                   metric was measured on, the plots, right and wrong sample completions
loss_curves.png    one panel per metric over every training stage in `curves` (a sweep's
                   points overlaid): training and held-out loss; GRPO's mean reward, smoothed
metrics.png        each headline metric per model, values on the bars
samples.jsonl      every prompt's completions, rewards, correctness and reference, per model
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from engine.evaluate.config import EvalConfig  # noqa: E402
from engine.train.metrics import read_metrics  # noqa: E402

LOSS_KEYS = ("eval_loss", "eval_perplexity")
"""Metrics of the held-out loss on the `dataset` input (as opposed to a generation task's)."""


def headline_metrics(models: dict[str, dict]) -> list[str]:
    keys: list[str] = []
    for metrics in models.values():
        for key in metrics:
            if key not in keys and (
                key in LOSS_KEYS
                or key.endswith("/accuracy")
                or "/pass@" in key
                or "/reward/" in key
                or (key.startswith("harness/") and "_stderr" not in key and not key.endswith(("/samples", "/seconds")))
            ):
                keys.append(key)
    return keys


def equal_columns(models: dict[str, dict], keys: list[str]) -> dict[str, list[str]]:
    """Column -> the later metrics equal to it for every model (under greedy decoding with one
    sample, pass@1 and a 0/1 correctness reward are the accuracy): shown once."""
    merged: dict[str, list[str]] = {}
    for key in keys:
        values = [models[name].get(key) for name in models]
        first = next((k for k in merged if values == [models[name].get(k) for name in models]), None)
        if first is None or all(v is None for v in values):
            merged[key] = []
        else:
            merged[first].append(key)
    return merged


def panel_keys(models: dict[str, dict]) -> list[str]:
    """Headline metrics worth a panel of metrics.png: duplicates once, perplexity (exp of the
    loss) not at all."""
    return [key for key in equal_columns(models, headline_metrics(models)) if key != "eval_perplexity"]


def column_title(key: str, equal: list[str], data_label: str | None = None) -> str:
    """`eval_loss (tokenize:validation)`; `arithmetic/accuracy (= pass@1 = reward/correct)`."""
    title = key
    if key in LOSS_KEYS and data_label:
        title += f" ({data_label})"
    if equal:
        prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        title += " (= " + " = ".join(k.removeprefix(prefix) for k in equal) + ")"
    return title


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def markdown_table(models: dict[str, dict], columns: dict[str, list[str]], data_label: str | None = None) -> str:
    titles = [column_title(k, equal, data_label) for k, equal in columns.items()]
    lines = ["| model | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    for name, metrics in models.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(metrics.get(k)) for k in columns) + " |")
    return "\n".join(lines)


def measured_on(cfg: EvalConfig, models: dict[str, dict], about: dict) -> dict[str, str]:
    """Metric group -> one sentence saying what it was measured on. `about` (from the evaluate
    stage; empty when the engine runs alone): `data` names the dataset input and what it
    is, `paths` maps directories to the artifacts they are."""

    def shown(path: str) -> str:
        for prefix, label in (about.get("paths") or {}).items():
            if path.startswith(prefix.rstrip("/") + "/"):
                return label + path[len(prefix.rstrip("/")) :]
        return path

    out: dict[str, str] = {}
    if cfg.data_path and any("eval_loss" in m for m in models.values()):
        data = about.get("data") or f"the dataset at {cfg.data_path}"
        out["eval_loss, eval_perplexity"] = (
            f"next-token loss on {cfg.loss_batches} batches of {cfg.batch_size} x {cfg.seq_len} tokens of the "
            f"`{cfg.split}` split of {data}"
        )
    for task in cfg.tasks:
        prompts = next((m.get(f"{task.name}/prompts") for m in models.values() if f"{task.name}/prompts" in m), None)
        decoding = "greedy" if task.temperature == 0 else f"temperature {task.temperature:g}"
        correct = task.correct or task.rewards[0].name
        out[f"{task.name}/*"] = (
            f"{prompts if prompts is not None else 'the'} prompts of {shown(task.path or '')}, "
            f"{task.samples} completion(s) each ({decoding}, at most {task.max_new_tokens} new tokens); "
            f"correct: reward `{correct}` >= {task.correct_threshold:g}"
        )
    if cfg.harness:
        out["harness/*"] = f"lm-evaluation-harness task(s) {', '.join(cfg.harness.tasks)}"
        if cfg.harness.limit:
            out["harness/*"] += f", limit {cfg.harness.limit:g} documents per task"
    return out


# --------------------------------------------------------------------------- samples


def chosen_samples(items: list[dict], count: int) -> list[dict]:
    """Up to `count` samples showing both outcomes: right and wrong alternately (a wrong one
    first), in the order they were evaluated; all of one kind when there is no other."""
    right = [s for s in items if s.get("correct")]
    wrong = [s for s in items if not s.get("correct")]
    chosen: list[dict] = []
    while len(chosen) < count and (right or wrong):
        for pool in (wrong, right):
            if pool and len(chosen) < count:
                chosen.append(pool.pop(0))
    return chosen


def samples_markdown(name: str, items: list[dict], count: int) -> list[str]:
    right = sum(1 for s in items if s.get("correct"))
    lines = [f"## Samples: {name} ({right} of {len(items)} completions right)", ""]
    for item in chosen_samples(items, count):
        prompt = item["prompt"] if isinstance(item["prompt"], str) else json.dumps(item["prompt"])
        reference = ", ".join(f"{k}: {_short(v)}" for k, v in (item.get("reference") or {}).items()) or "none"
        verdict = "right" if item.get("correct") else "wrong"
        lines += [
            f"**{verdict}** ({item.get('task')}; reference {reference}; rewards {item['rewards']})",
            "",
            "```",
            f"{prompt}{item['completion']}",
            "```",
            "",
        ]
    return lines


def _short(value, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- curves


def training_curve(records: list[dict]) -> tuple[str, list[tuple[int, float]]]:
    """What a training stage optimised, per step: the reward for GRPO (its surrogate loss says
    little), the training loss otherwise."""
    for key, label in (("reward", "mean reward"), ("loss", "training loss")):
        points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        if points:
            return label, points
    return "", []


def held_out_curve(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in records if _finite(r.get("eval_loss"))]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average, started at the first value (TensorBoard's smoothing)."""
    out, current = [], None
    for value in values:
        current = value if current is None else alpha * value + (1 - alpha) * current
        out.append(current)
    return out


def curve_series(curves: dict[str, str | Path]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Stage -> {"training loss" | "mean reward" | "held-out loss": points}."""
    series = {}
    for stage, path in curves.items():
        records = read_metrics(path)
        label, points = training_curve(records)
        found = {label: points} if points else {}
        if held_out := held_out_curve(records):
            found["held-out loss"] = held_out
        if found:
            series[stage] = found
    return series


def _grid(count: int, columns: int) -> tuple[int, int]:
    cols = min(columns, count)
    return math.ceil(count / cols), cols


def loss_curves_figure(series: dict[str, dict[str, list[tuple[int, float]]]]) -> Figure:
    """One panel per metric, every stage on it (a sweep's points overlaid, one colour per
    stage): loss (training solid, held-out dashed with markers) and mean reward (raw faint,
    an EMA over it). Stages' own step counts on x."""
    panels: dict[str, list[tuple[str, str]]] = {
        "loss": [(s, k) for s, found in series.items() for k in ("training loss", "held-out loss") if k in found],
        "mean reward": [(s, "mean reward") for s, found in series.items() if "mean reward" in found],
    }
    panels = {title: lines for title, lines in panels.items() if lines}
    rows, cols = _grid(max(len(panels), 1), 2)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.2 * rows), squeeze=False)
    colours = {stage: f"C{i % 10}" for i, stage in enumerate(series)}
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for stage, key in lines:
            steps, values = zip(*series[stage][key])
            colour = colours[stage]
            if key == "held-out loss":
                ax.plot(steps, values, "--o", color=colour, markersize=3, label=f"{stage} held-out")
            elif key == "mean reward":
                alpha = 2 / (1 + min(20, max(2, len(values) // 5)))  # span ~ a fifth of the run
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
                ax.plot(steps, ema(list(values), alpha), color=colour, label=f"{stage} (EMA)")
            else:
                ax.plot(steps, values, color=colour, label=f"{stage} training")
        ax.set_title(title)
        ax.set_xlabel("step of each stage")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=1 + len(lines) // 8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def _wrapped(name: str, width: int = 18) -> str:
    """A model name over lines, broken after its commas first (sweep points' parameters)."""
    return "\n".join(textwrap.wrap(name.replace(",", ", "), width)).replace(", ", ",") or name


def metrics_figure(models: dict[str, dict], columns: dict[str, list[str]], data_label: str | None = None) -> Figure:
    """One bar panel per headline metric (merged duplicates once), in a grid of 2 or 3
    columns; each bar labelled with its value, n/a where a model was not measured."""
    keys = [k for k in columns if k != "eval_perplexity"]
    rows, cols = _grid(max(len(keys), 1), 2 if len(keys) <= 4 else 3)
    names = list(models)
    width = max(4.0, 1.3 * len(names) + 1.0)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 4.0 * rows), squeeze=False)
    labels = [_wrapped(n) for n in names]
    for ax, key in zip(axes.flat, keys):
        values = [models[n].get(key) for n in names]
        bars = ax.bar(range(len(names)), [0.0 if v is None else v for v in values], color="tab:blue")
        ax.bar_label(bars, labels=["n/a" if v is None else _fmt(v) for v in values], fontsize=8, padding=2)
        for bar, value in zip(bars, values):
            if value is None:  # not measured for this model: say so rather than draw a 0
                bar.set_alpha(0.0)
        ax.set_xticks(range(len(names)), labels, fontsize=8)
        ax.set_title("\n".join(textwrap.wrap(column_title(key, columns[key], data_label), 40)), fontsize=9)
        ax.margins(y=0.15)  # room for the value labels
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_report(
    out_dir: Path, models: dict[str, dict], curves: dict[str, str | Path], data_label: str | None = None
) -> list[str]:
    written = []
    series = curve_series(curves)
    if series:
        _save(loss_curves_figure(series), out_dir / "loss_curves.png")
        written.append("loss_curves.png")
    columns = equal_columns(models, headline_metrics(models))
    if any(k != "eval_perplexity" for k in columns):
        _save(metrics_figure(models, columns, data_label), out_dir / "metrics.png")
        written.append("metrics.png")
    return written


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=100, bbox_inches="tight")  # tight: no label cut at the edge
    plt.close(fig)


# --------------------------------------------------------------------------- the report


def write_report(
    out_dir: Path,
    cfg: EvalConfig,
    models: dict[str, dict],
    samples: dict[str, list[dict]],
    checkpoints: dict[str, str],
    curves: dict[str, str | Path],
    *,
    about: dict | None = None,
    write: bool = True,
) -> dict:
    """The report's content; written into out_dir when `write` (the primary process of a run).
    `about`: what the inputs are (see measured_on)."""
    about = about or {}
    columns = equal_columns(models, headline_metrics(models))
    measured, merged = measured_on(cfg, models, about), {k: v for k, v in columns.items() if v}
    report = {
        "models": models,
        "checkpoints": checkpoints,
        "tasks": [t.model_dump(mode="json") for t in cfg.tasks],
        "measured_on": measured,
        "equal_columns": merged,
    }
    if not write:
        return report
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_report(out_dir, models, curves, about.get("data_label"))
    lines = ["# Evaluation report", "", markdown_table(models, columns, about.get("data_label")), ""]
    lines += [f"- `{group}`: {text}" for group, text in measured.items()]
    for key, equal in merged.items():
        lines.append(f"- {', '.join(f'`{k}`' for k in equal)}: equal to `{key}` for every model, shown once")
    lines.append("")
    for plot in plots:
        lines += [f"![{plot}]({plot})", ""]
    for name, items in samples.items():
        if items and cfg.samples_in_report:
            lines += samples_markdown(name, items, cfg.samples_in_report)
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
