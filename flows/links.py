"""Addresses of a run's records in the Prefect UI and API, recorded in each artifact's manifest
and linked from the stage summaries of its consumers.

Runs are addressed with `prefect.utilities.urls.url_for`, Prefect's supported builder
(`prefect.runtime`'s `ui_url` / `api_url` of a flow run, `.../flow-runs/flow-run/<id>`, is
not an API route). The UI's other pages used here are routes of the pinned Prefect's UI
(3.9; both its bundles, tests/test_observability.py reads their route tables):

    /artifacts/key/<key>     a Prefect artifact by key (the stage summary of the run that made it)
    /events?resource=...     the event feed filtered to a resource: an asset's materialisation
                             and references. The pinned UI has no asset page (`/assets` is a
                             404), so this is its closest view of an asset.

The server answers these addresses with its original UI (the newer one lives under `/v2`),
whose event feed reads `resource` as plain resource-id prefixes (one parameter each; a JSON
list would be taken whole, brackets and all) and its time range from `type=range`,
`startDate` and `endDate` (without them it shows the last day).

UI addresses are recorded only where a UI URL is configured (PREFECT_UI_URL, or Prefect's
default from a configured PREFECT_API_URL): the local server trainflow starts for a run
without one has no UI, and is gone when the run ends.
"""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime, timedelta

from prefect.settings import PREFECT_UI_URL
from prefect.utilities.urls import url_for

ARTIFACT_ROUTE = "artifacts/key/{key}"
EVENTS_ROUTE = "events"


def run_links(flow_run_id: str, task_run_id: str) -> dict[str, str]:
    """The manifest's `prefect` addresses of a stage's run: `api_url` (the flow run in the
    API) and, where the UI has an absolute address, `ui` (its root), `ui_url` (the flow run)
    and `task_run_ui_url`."""
    links = {"api_url": url_for("flow-run", obj_id=flow_run_id, url_type="api")}
    ui = (PREFECT_UI_URL.value() or "").rstrip("/")
    if ui.startswith(("http://", "https://")):
        links.update(
            ui=ui,
            ui_url=url_for("flow-run", obj_id=flow_run_id),
            task_run_ui_url=url_for("task-run", obj_id=task_run_id),
        )
    return {k: v for k, v in links.items() if v}


def artifact_url(ui: str, key: str) -> str:
    return f"{ui}/{ARTIFACT_ROUTE.format(key=urllib.parse.quote(key, safe=''))}"


def asset_events_url(ui: str, asset: str, start: str | None, end: str | None) -> str:
    """The UI's event feed filtered to `asset`, from a minute before `start` to a minute
    after `end` (ISO times; the feed shows the last day without them)."""
    query = {"resource": asset}
    if start and end:
        query.update(type="range", startDate=_shifted(start, -60), endDate=_shifted(end, 60))
    return f"{ui}/{EVENTS_ROUTE}?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


def _shifted(iso: str, seconds: float) -> str:
    """`iso` moved by `seconds`, in UTC with milliseconds and a Z (what the UI's dates read)."""
    moved = datetime.fromisoformat(iso.replace("Z", "+00:00")) + timedelta(seconds=seconds)
    return moved.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def input_links(manifest: dict, asset: str) -> dict[str, str]:
    """Links to what made an input artifact, from its manifest: its task run, the summary its
    run published, and its asset's events. Empty where that run had no UI address."""
    prefect = manifest.get("prefect") or {}
    ui = prefect.get("ui")
    if not ui:
        return {}
    links = {}
    if prefect.get("task_run_ui_url"):
        links["task run"] = prefect["task_run_ui_url"]
    if prefect.get("summary_key"):
        links["summary"] = artifact_url(ui, prefect["summary_key"])
    links["asset events"] = asset_events_url(ui, asset, manifest.get("created_at"), manifest.get("finished_at"))
    return links
