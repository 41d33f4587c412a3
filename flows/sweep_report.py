"""A sweep's summary: one row per point (its labels and final metrics), as a table and a plot.

The fan-in stage of a sweep (`inputs: {models: sft[*]}`) publishes it as Prefect artifacts
(`<pipeline>-<stage>-sweep`: a table, and a markdown page with the plot inlined) and
records the rows in its manifest (`decisions.sweep`), so `trainflow lineage` shows them.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from flows.inspection import format_table  # noqa: E402
from flows.summary import format_number  # noqa: E402


def sweep_rows(plan, stage: str) -> dict[str, list[dict[str, Any]]]:
    """Input as written -> one row per point it gathers: {point, <labels>..., <metrics>...}."""
    planned = plan.stages[stage]
    out = {}
    for input_name, points in planned.fan_in.items():
        rows = []
        for point in points:
            manifest = plan.manifest_of(point) or {}
            metrics = {k: v for k, v in (manifest.get("metrics") or {}).items() if _number(v)}
            rows.append(
                {
                    "point": point,
                    **plan.stages[point].params,
                    **metrics,
                    "artifact_id": plan.stages[point].job.artifact_id,
                }
            )
        out[input_name] = rows
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_columns(rows: list[dict], labels: list[str]) -> list[str]:
    skip = {"point", "artifact_id", *labels}
    return list(dict.fromkeys(k for row in rows for k in row if k not in skip))


def table_markdown(rows: list[dict], labels: list[str]) -> str:
    metrics = metric_columns(rows, labels)
    columns = ["point", *labels, *metrics]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(format_number(row.get(c, "")) if c in metrics else str(row.get(c, "")) for c in columns)
            + " |"
        )
    return "\n".join(lines)


def table_text(rows: list[dict], labels: list[str], width: int = 160) -> str:
    """The table for a console: each point (its name holds its labels) and its metrics, in as
    many tables as it takes for every line to fit `width` characters, the point column in each."""
    metrics = metric_columns(rows, labels)
    cells = [{"point": str(row["point"]), **{m: format_number(row[m]) for m in metrics if m in row}} for row in rows]

    def column_width(column: str) -> int:
        return max(len(column), *(len(cell.get(column, "")) for cell in cells))

    groups: list[list[str]] = [[]]
    used = column_width("point")
    for metric in metrics:
        needed = 2 + column_width(metric)  # format_table's gap, then the column
        if groups[-1] and used + needed > width:
            groups.append([])
            used = column_width("point")
        groups[-1].append(metric)
        used += needed
    return "\n\n".join(format_table(cells, ["point", *group]) for group in groups)


def sweep_figure(rows: list[dict], labels: list[str]) -> Figure:
    """One bar panel per metric, one bar per point labelled with its value, in a grid of up
    to 3 columns (a row of dozens of panels was unreadable)."""
    metrics = metric_columns(rows, labels)
    names = [",\n".join(f"{k}={row.get(k)}" for k in labels) or row["point"] for row in rows]
    cols = min(3, len(metrics))
    grid_rows = -(-len(metrics) // cols)
    width = max(4.0, 0.6 * len(rows) + 1.0)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(width * cols, 3.8 * grid_rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        values = [row.get(metric) for row in rows]
        bars = ax.bar(range(len(rows)), [v if _number(v) else 0.0 for v in values])
        ax.bar_label(bars, labels=[format_number(v) if _number(v) else "n/a" for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(rows)), names, rotation=60 if len(rows) > 4 else 0, ha="right", fontsize=7)
        ax.set_title(metric, fontsize=9)
        ax.margins(y=0.15)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_png(rows: list[dict], labels: list[str]) -> bytes | None:
    """sweep_figure as PNG bytes (None when there is nothing to plot)."""
    if not rows or not metric_columns(rows, labels):
        return None
    fig = sweep_figure(rows, labels)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def sweep_markdown(stage: str, input_name: str, rows: list[dict], labels: list[str]) -> str:
    lines = [f"# {stage}: sweep over {input_name} ({len(rows)} points)", "", table_markdown(rows, labels)]
    png = plot_png(rows, labels)
    if png is not None:
        lines += ["", f"![metrics per point](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(lines)
