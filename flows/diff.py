"""`trainflow diff A B`: two artifacts side by side — config, metrics, lineage.

    trainflow diff "artifacts/sft(lr=1e-05,rank=8)/<id>" "artifacts/sft(lr=0.0003,rank=8)/<id>"
    trainflow diff <id-prefix> <id-prefix> --store s3://bucket/artifacts --json

Config: the keys whose values differ (the config as written, flattened: `optimizer.learning_rate`),
then the resolved config's other differences. Metrics: every metric of either, with B - A.
Lineage: each ancestor stage (walking `parents`) whose artifact differs or that only one has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.inspection import flatten, format_table
from tasks.store.base import ArtifactStore
from tasks.store.records import parent_dir, read_manifest


def _manifest(directory: Path, store: ArtifactStore | None) -> dict:
    """An artifact's manifest as its store holds it (a bucket's, not its staging copy's)."""
    at = store.artifact_at(directory) if store is not None else None
    return (store.manifest(*at) if store is not None and at is not None else read_manifest(directory)) or {}


def ancestors(directory: Path, store: ArtifactStore | None) -> dict[str, str]:
    """Stage -> artifact id of every ancestor of an artifact (itself excluded)."""
    out: dict[str, str] = {}
    todo = [(directory, _manifest(directory, store))]
    seen = set()
    while todo:
        path, manifest = todo.pop()
        for parent in manifest.get("parents") or []:
            key = (parent["stage"], parent["id"])
            if key in seen:
                continue
            seen.add(key)
            out.setdefault(parent["stage"], parent["id"])
            parent_path = parent_dir(path.parent.parent, parent)
            todo.append((parent_path, _manifest(parent_path, store)))
    return out


def _changed(a: dict, b: dict) -> list[dict[str, Any]]:
    flat_a, flat_b = flatten(a or {}), flatten(b or {})
    return [
        {"key": key, "a": flat_a.get(key, "-"), "b": flat_b.get(key, "-")}
        for key in sorted(set(flat_a) | set(flat_b))
        if flat_a.get(key, "-") != flat_b.get(key, "-")
    ]


def diff(a: Path, b: Path, store_a: ArtifactStore | None = None, store_b: ArtifactStore | None = None) -> dict:
    ma, mb = _manifest(a, store_a), _manifest(b, store_b)
    metrics = []
    for key in dict.fromkeys([*(ma.get("metrics") or {}), *(mb.get("metrics") or {})]):
        va, vb = (ma.get("metrics") or {}).get(key), (mb.get("metrics") or {}).get(key)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        delta = vb - va if numbers and va is not None and vb is not None else None
        metrics.append({"metric": key, "a": va, "b": vb, "b - a": delta})
    written = _changed(ma.get("config_as_written") or {}, mb.get("config_as_written") or {})
    shown = {row["key"] for row in written}
    resolved = [row for row in _changed(ma.get("config") or {}, mb.get("config") or {}) if row["key"] not in shown]
    anc_a, anc_b = ancestors(a, store_a), ancestors(b, store_b)
    lineage = [
        {"stage": stage, "a": anc_a.get(stage, "-"), "b": anc_b.get(stage, "-")}
        for stage in sorted(set(anc_a) | set(anc_b))
        if anc_a.get(stage) != anc_b.get(stage)
    ]
    return {
        "a": {"stage": ma.get("stage"), "id": ma.get("id"), "task": ma.get("task"), "status": ma.get("status")},
        "b": {"stage": mb.get("stage"), "id": mb.get("id"), "task": mb.get("task"), "status": mb.get("status")},
        "config": written,
        "resolved_config": resolved,
        "metrics": metrics,
        "lineage": lineage,
        "same_ancestors": sorted(s for s in set(anc_a) & set(anc_b) if anc_a[s] == anc_b[s]),
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def format_diff(result: dict) -> str:
    a, b = result["a"], result["b"]
    lines = [
        f"A: {a['stage']}/{a['id']} ({a['task']}, {a['status']})",
        f"B: {b['stage']}/{b['id']} ({b['task']}, {b['status']})",
    ]
    for title, rows, columns in (
        ("config (as written)", result["config"], ["key", "a", "b"]),
        ("config (resolved, other differences)", result["resolved_config"], ["key", "a", "b"]),
        ("metrics", result["metrics"], ["metric", "a", "b", "b - a"]),
        ("lineage (ancestors that differ)", result["lineage"], ["stage", "a", "b"]),
    ):
        lines += ["", f"{title}:"]
        if rows:
            lines.append(format_table([{k: _fmt(v) for k, v in row.items()} for row in rows], columns))
        else:
            lines.append("  (same)" if title != "metrics" else "  (none)")
    if result["same_ancestors"]:
        lines += ["", f"same ancestors: {', '.join(result['same_ancestors'])}"]
    return "\n".join(lines)
