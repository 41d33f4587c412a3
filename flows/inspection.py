"""Read-only views of a store: pipeline status, lineage trees, artifact listings.

None of this imports Prefect or the engine's JAX code, so the commands answer at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from flows.spec import Plan
from tasks.store.base import ArtifactStore
from tasks.store.names import folder_stage
from tasks.store.records import COMPLETE, parent_dir, read_manifest


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------- status


def status_rows(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for name, info in plan.status().items():
        manifest = read_manifest(Path(info["path"])) if info["state"] != "pending" else None
        reused = (manifest or {}).get("reused") if info["state"] == COMPLETE else None
        rows.append(
            {
                "stage": name,
                "task": info["task"],
                "state": _listed_state(info["state"], manifest or {}),
                "reused_from": f"{reused['stage']}/{reused['id']}" if reused else None,
                "artifact_id": info["artifact_id"],
                "inputs": _inputs_text(plan, name),
                "finished_at": (manifest or {}).get("finished_at") or "-",
                "path": info["path"],
            }
        )
    return rows


def _inputs_text(plan: Plan, name: str) -> str:
    """The stages a stage waits for, a sweep's points as `sft[*] (6 points)`."""
    planned = plan.stages[name]
    shown: dict[str, list[str]] = {}
    for upstream in (*planned.depends_on, *planned.follows):
        shown.setdefault(plan.stages[upstream].base or upstream, []).append(upstream)
    parts = [
        f"{base}[*] ({len(points)} points)" if len(points) > 2 else ", ".join(points) for base, points in shown.items()
    ]
    return ", ".join(parts) or "-"


# --------------------------------------------------------------------------- lineage


def lineage(directory: Path, _seen: set | None = None, store: ArtifactStore | None = None) -> dict[str, Any]:
    """The artifact at `directory` and, recursively, the artifacts it was made from. On a
    bucket `store` (whose staging copy `directory` is), manifests, states and paths are the bucket's."""
    seen = _seen if _seen is not None else set()
    store_root = directory.parent.parent
    at = store.artifact_at(directory) if store is not None else None
    if store is None or at is None:  # a directory of the store it lies in
        store, at = ArtifactStore(store_root), (folder_stage(directory.parent.name), directory.name)
    where = store.location(*at)
    manifest = store.manifest(*at)
    if manifest is None:
        return {"path": where, "error": "no readable artifact.json"}
    # The store's view, not the manifest's word: a manifest left `running` by a run that
    # died (or could not write its last manifest) is partial once no process holds its lock.
    status = store.state(*at)
    node: dict[str, Any] = {
        "stage": manifest.get("stage"),
        "id": manifest.get("id"),
        "kind": manifest.get("kind"),
        "task": manifest.get("task"),
        "status": status,
        "path": where,
        "format_version": manifest.get("format_version"),
        "pipeline": manifest.get("pipeline"),
        "config": manifest.get("config"),
        "config_as_written": manifest.get("config_as_written"),
        "metrics": manifest.get("metrics"),
        "code": manifest.get("code"),
        "prefect": manifest.get("prefect"),
        "created_at": manifest.get("created_at"),
        "finished_at": manifest.get("finished_at"),
        "decisions": manifest.get("decisions"),
        "reused": manifest.get("reused"),
        "parents": [],
    }
    key = str(directory.resolve())
    if key in seen:  # a diamond: show the shared ancestor once in full
        node["parents"] = "(shown above)"
        return node
    seen.add(key)
    for parent in manifest.get("parents", []):
        child = lineage(parent_dir(store_root, parent), seen, store)
        child["input"] = parent.get("input")
        node["parents"].append(child)
    return node


def _node_lines(node: dict, width: int) -> list[str]:
    lines = []
    code = node.get("code") or {}
    commit = (code.get("git_commit") or "")[:10]
    code_text = f"trainflow {code.get('version')}" + (f" @ {commit}" if commit else "")
    code_text += " (uncommitted changes)" if code.get("git_dirty") else ""
    lines.append(f"task: {node.get('task')} (format {node.get('format_version')})   code: {code_text}")
    prefect = node.get("prefect") or {}
    if prefect:
        lines.append(
            f"prefect: flow run '{prefect.get('flow_run_name')}' {prefect.get('flow_run_id')}, "
            f"task run {prefect.get('task_run_id')}"
        )
        url = shown_url(prefect)
        if url:
            lines.append(f"         {url}")
    config = flatten(node.get("config_as_written") or {})
    lines += _wrapped("config: ", [f"{k}={_fmt(v)}" for k, v in config.items()] or ["(defaults)"], width)
    metrics = node.get("metrics") or {}
    lines += _wrapped("metrics: ", [f"{k}={_fmt(v)}" for k, v in metrics.items()] or ["-"], width)
    lines.append(f"made: {node.get('created_at')} -> {node.get('finished_at')}")
    reused = node.get("reused")
    if reused:  # early cutoff: these bytes were made by an earlier run, from inputs of equal content
        origin = f"{reused.get('stage')}/{reused.get('id')}"
        lines.append(f"reused: the bytes of {origin}, made {reused.get('finished_at')}")
        made_from = [f"{p.get('input')}={p.get('stage')}/{p.get('id')}" for p in reused.get("parents") or []]
        lines += _wrapped("        from ", [*made_from, "(consumed the same bytes as below)"], width)
    decisions = node.get("decisions") or {}
    if decisions.get("when"):  # the gate that let it run, and what it saw (flows/gates.py)
        seen = " ".join(f"{k}={_fmt(v)}" for k, v in decisions["when"].get("values", {}).items())
        lines.append(f"gate: {decisions['when'].get('expression')}  saw: {seen}")
    for name, chosen in (decisions.get("select") or {}).items():
        lines.append(f"selected {name}: {chosen.get('chosen')} ({chosen.get('best')} {chosen.get('by')})")
    return lines


def shown_url(prefect: dict) -> str | None:
    """The UI address lineage prints for the run that made an artifact: its task run, else its
    flow run, and only an absolute one (flows/links.py records those where a UI URL is
    configured; an older manifest's relative one was of a server that no longer runs)."""
    for key in ("task_run_ui_url", "ui_url"):
        url = prefect.get(key) or ""
        if url.startswith(("http://", "https://")):
            return url.replace("/flow-runs/flow-run/", "/runs/flow-run/")  # prefect.runtime's form: not a route
    return None


def _wrapped(label: str, items: list[str], width: int) -> list[str]:
    lines, current = [], label
    for item in items:
        if len(current) + len(item) + 1 > width and current.strip() != label.strip():
            lines.append(current.rstrip())
            current = " " * len(label)
        current += item + " "
    lines.append(current.rstrip())
    return lines


def format_lineage(node: dict, width: int | None = None) -> str:
    width = width or max(60, min(120, shutil.get_terminal_size((100, 20)).columns))
    out: list[str] = []

    def render(n: dict, head: str, body: str) -> None:
        label = f"{n.get('input')}: " if n.get("input") else ""
        if "error" in n:
            out.append(f"{head}{label}{n['path']}  ({n['error']})")
            return
        reused = " (reused)" if n.get("reused") else ""
        out.append(f"{head}{label}{n['stage']}/{n['id']}  {n['kind']}  {n['status']}{reused}")
        parents = n["parents"]
        if isinstance(parents, str):
            out.append(f"{body}  {parents}")
            return
        bar = "│ " if parents else "  "
        out.extend(f"{body}{bar}{line}" for line in _node_lines(n, width - len(body) - 2))
        for i, parent in enumerate(parents):
            last = i == len(parents) - 1
            render(parent, body + ("└─ " if last else "├─ "), body + ("   " if last else "│  "))

    render(node, "", "")
    return "\n".join(out)


# --------------------------------------------------------------------------- listing


def list_rows(store: ArtifactStore) -> list[dict[str, Any]]:
    rows = []
    for directory, manifest in store.iter_artifacts():
        manifest = manifest or {}
        files = manifest.get("files") or {}
        metrics = manifest.get("metrics") or {}
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        # Accuracies first (an evaluation's per model: its headline), then the first others.
        headline = [k for k in numbers if k.rsplit("/", 1)[-1] == "accuracy"]
        keys = [*headline, *(k for k in numbers if k not in headline)][: max(3, len(headline))]
        shown = [f"{k}={_fmt(numbers[k])}" for k in keys]
        rows.append(
            {
                "stage": folder_stage(directory.parent.name),
                "id": directory.name,
                "kind": manifest.get("kind", "?"),
                "status": _listed_state(store.state(directory.parent.name, directory.name), manifest),
                "size": human(sum(f.get("size", 0) for f in files.values())) if files else "-",
                "finished_at": manifest.get("finished_at") or "-",
                "metrics": " ".join(shown) or "-",
            }
        )
    return rows


def _listed_state(state: str, manifest: dict) -> str:
    """`complete (reused)` for an artifact whose bytes an earlier equal one made (tasks/cutoff.py)."""
    return f"{state} (reused)" if state == COMPLETE and manifest.get("reused") else state


def human(n: float) -> str:
    """A byte count for people: `512 B`, `3.4 MB`."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""
