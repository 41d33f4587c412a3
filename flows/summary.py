"""What a pipeline shows people: each stage's summary (markdown for the Prefect UI, its inputs
linked to the runs that made them), metrics as numbers people read, the console's step and
pipeline lines, the level of a child's output line, and the asset key of an artifact.
Nothing here talks to Prefect: flows/pipeline.py sends what these build."""

from __future__ import annotations

import base64
import logging
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from engine.config import ConfigError
from engine.progress import Eta, format_duration
from flows.links import input_links
from flows.spec import Plan
from tasks.registry import StageKind, get_stage_kind
from tasks.runner import StageResult
from tasks.store.records import read_manifest

ASSET_SCHEME = "trainflow"


def asset_key(stage: str, artifact_id: str) -> str:
    """An artifact's Prefect asset key. Its id is a fingerprint of what it holds, so the key
    names the same asset whichever store holds it. A sweep point's brackets are parentheses
    (Prefect refuses [ and ] in keys)."""
    return f"{ASSET_SCHEME}://{stage.replace('[', '(').replace(']', ')')}/{artifact_id}"


def format_number(value: Any) -> str:
    """A metric for people: 4 significant digits, thousands separated, whole numbers whole."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


# --------------------------------------------------------------------------- the console

CONSOLE_WIDTH = 160
"""A step line's most characters; every metric stays in metrics.jsonl and TensorBoard."""


def console_metrics(task: str) -> tuple[str, ...]:
    """The few metrics of a step line: its stage kind's (StageKind.console_metrics), the
    default for a kind this process does not know."""
    try:
        return get_stage_kind(task).console_metrics
    except ConfigError:
        return StageKind.console_metrics


def step_line(
    task: str, record: dict, total_steps: int | None, eta: Eta | None = None, now: float | None = None
) -> str:
    """`step 60/300 (20%): loss=5.9 grad_norm=1.04 learning_rate=0.0029 | 12,431 tokens/s, ETA 48s`.

    The ETA is paced from the first record `eta` saw (compilation excluded)."""
    step = int(record.get("step", 0))
    head = f"step {step}/{total_steps} ({100 * step / total_steps:.0f}%)" if total_steps else f"step {step}"
    wanted = console_metrics(task)
    keys = [k for k in (*wanted, *(f"eval_{k}" for k in wanted)) if record.get(k) is not None]
    if not keys:  # a record of another kind (an unknown stage's): its first few numbers
        keys = [k for k, v in record.items() if k != "step" and isinstance(v, (int, float))][:4]
    tail = []
    if record.get("tokens_per_second") is not None:
        tail.append(f"{format_number(record['tokens_per_second'])} tokens/s")
    if eta is not None:
        left = eta.update(step, now)
        if left is not None:
            tail.append(f"ETA {format_duration(left)}")
    end = f" | {', '.join(tail)}" if tail else ""
    shown = [f"{k}={format_number(record[k])}" for k in keys]
    while shown and len(f"{head}: {' '.join(shown)}{end}") > CONSOLE_WIDTH:
        shown.pop()
    return f"{head}: {' '.join(shown)}{end}"[:CONSOLE_WIDTH]


class PipelineProgress:
    """`pipeline quickstart: 3/6 stages done (2 skipped: problems, tokenize), 1m02s; running: sft`,
    logged as each stage ends. Thread-safe: stages end on the flow's worker threads."""

    def __init__(self, name: str, stages: int, now: float | None = None):
        self.name, self.total = name, stages
        self.started_at = time.monotonic() if now is None else now
        self.running: list[str] = []
        self.done: dict[str, str] = {}
        self._lock = threading.Lock()

    def started(self, stage: str) -> None:
        with self._lock:
            self.running.append(stage)

    def finished(self, stage: str, status: str, now: float | None = None) -> str:
        with self._lock:
            if stage in self.running:
                self.running.remove(stage)
            self.done[stage] = status
            skipped = [s for s, st in self.done.items() if st.startswith("skipped") or st == "reused"]
            now = time.monotonic() if now is None else now
            line = f"pipeline {self.name}: {len(self.done)}/{self.total} stages done"
            if skipped:
                names = ", ".join(skipped[:4]) + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else "")
                line += f" ({len(skipped)} skipped: {names})"
            line += f", {format_duration(now - self.started_at)}"
            if self.running:
                line += f"; running: {', '.join(self.running[:4])}" + (" ..." if len(self.running) > 4 else "")
            return line


# Level of a child's line, from the formats the engine's libraries log in: Python logging's
# default (`WARNING:absl:...`), absl/glog (`W1130 11:02:14.640 ...`), Python warnings
# (`file.py:12: UserWarning: ...`) and the engine's own `error:` / `warning:` lines.
_LEVEL_PATTERNS = (
    (re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL|FATAL):"), None),
    (re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d"), None),
    (re.compile(r"^\S+:\d+: \w*Warning: "), logging.WARNING),
    (re.compile(r"^(error|Traceback \(most recent call last\))"), logging.ERROR),
    (re.compile(r"^warning:"), logging.WARNING),
)
_LEVEL_NAMES = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}


def line_level(line: str) -> int:
    """The logging level a child's output line was written at (INFO when it does not say)."""
    text = re.sub(r"^\[rank \d+\] ", "", line)
    for pattern, level in _LEVEL_PATTERNS:
        match = pattern.match(text)
        if match:
            return level if level is not None else _LEVEL_NAMES[match.group(1)]
    return logging.INFO


_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def inline_images(markdown: str, directory: Path) -> str:
    """Markdown whose PNG links (relative to `directory`) are data: URIs, so a browser shows
    them wherever the text is rendered (the Prefect UI cannot reach the artifact's files)."""

    def inline(match: re.Match) -> str:
        path = directory / match.group(2)
        if not path.is_file():
            return match.group(0)
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"

    return _IMAGE.sub(inline, markdown)


def summary_markdown(plan: Plan, stage: str, result: StageResult, manifest: dict) -> str:
    """A stage's one summary: status, where its artifact is, metrics, report, lineage, config."""
    job = plan.stages[stage].job
    where = plan.store.location(stage, job.artifact_id)
    lines = [
        f"# {stage} ({job.task}): {result.status}",
        "",
        "| | |",
        "|---|---|",
        f"| pipeline | `{plan.name}` |",
        f"| artifact | `{stage}/{job.artifact_id}` ({job.kind.output_kind(job.config)}) |",
        f"| asset | `{asset_key(stage, job.artifact_id)}` |",
        f"| location | `{where}` |",
        f"| manifest | `{where.rstrip('/')}/artifact.json` |",
        f"| time | {result.seconds:.1f} s (work {result.work_seconds:.1f} s) |",
        f"| inspect | `trainflow lineage {where}` |",
        "",
        "## Metrics",
        "",
    ]
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str, type(None)))}
    lines += (
        ["| metric | value |", "|---|---|", *(f"| {k} | {format_number(v)} |" for k, v in metrics.items())]
        if metrics
        else ["none"]
    )
    report = result.path / "report.md"
    if report.is_file():  # e.g. an evaluation report: its tables and plots, in the Prefect UI
        lines += [
            "",
            "## Report",
            "",
            re.sub(r"^(#+) ", r"##\1 ", inline_images(report.read_text(), result.path), flags=re.MULTILINE),
        ]
    lines += ["", "## Lineage", ""]
    parents = manifest.get("parents", [])
    if parents:
        # Each input linked to the run that made it, its summary and its asset's events, in the
        # Prefect UI of that run (flows/links.py); plain text where it had no UI.
        lines += ["| input | artifact | kind | asset | made by |", "|---|---|---|---|---|"]
        for parent in parents:
            upstream = read_manifest(plan.store.artifact_dir(parent["stage"], parent["id"])) or {}
            key = asset_key(parent["stage"], parent["id"])
            links = input_links(upstream, key)
            artifact, asset = f"{parent['stage']}/{parent['id']}", f"`{key}`"
            if "asset events" in links:
                asset = f"[{asset}]({links['asset events']})"
            made_by = " · ".join(f"[{name}]({links[name]})" for name in ("task run", "summary") if name in links)
            lines.append(f"| {parent['input']} | {artifact} | {parent['kind']} | {asset} | {made_by or '-'} |")
    else:
        lines.append("no inputs")
    lines += [
        "",
        "## Config",
        "",
        "```yaml",
        yaml.safe_dump(job.config_as_written, sort_keys=False).rstrip() or "{}",
        "```",
    ]
    return "\n".join(lines)
