"""What a pipeline shows people: each stage's summary (markdown for the Prefect UI), metrics
as numbers people read, the level of a child's output line, and the asset key of an artifact.
Free of Prefect: flows/pipeline.py sends what these build."""

from __future__ import annotations

import base64
import logging
import math
import re
from pathlib import Path
from typing import Any

import yaml

from flows.spec import Plan
from tasks.artifacts import read_manifest
from tasks.runner import StageResult

ASSET_SCHEME = "trainflow"


def asset_key(stage: str, artifact_id: str) -> str:
    """An artifact's Prefect asset key. Its id is a fingerprint of what it holds, so the key
    names the same asset whichever store holds it."""
    return f"{ASSET_SCHEME}://{stage}/{artifact_id}"


def format_number(value: Any) -> str:
    """A metric for people: 4 significant digits, thousands separated, whole numbers whole."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


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


def _task_run_link(manifest: dict, text: str) -> str:
    """`text` linked to the task run that made an artifact, where the UI's address is known."""
    prefect = manifest.get("prefect") or {}
    ui_url, task_run_id = prefect.get("ui_url"), prefect.get("task_run_id")
    if not ui_url or not task_run_id or "/runs/flow-run/" not in ui_url:
        return text
    return f"[{text}]({ui_url.split('/runs/flow-run/')[0]}/runs/task-run/{task_run_id})"


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
        lines += ["| input | artifact | kind | asset |", "|---|---|---|---|"]
        for parent in parents:
            upstream = read_manifest(plan.store.artifact_dir(parent["stage"], parent["id"])) or {}
            artifact = _task_run_link(upstream, f"{parent['stage']}/{parent['id']}")
            lines.append(
                f"| {parent['input']} | {artifact} | {parent['kind']} | `{asset_key(parent['stage'], parent['id'])}` |"
            )
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
