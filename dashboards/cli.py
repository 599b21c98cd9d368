"""`kuberl dashboards generate [--check]` and `kuberl dashboards upload --url --token`.

Pure parts (JSON rendering, staleness, events -> annotation payloads) are separate from the
thin I/O shell that writes files or talks to Grafana through grafana-client.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from kuberl.dashboards.definitions import DASHBOARDS

GENERATED = Path(__file__).resolve().parent / "generated"
# The Helm chart ships the same JSON as ConfigMaps (Helm can only read files inside the chart).
CHART_DASHBOARDS = Path(__file__).resolve().parent.parent / "charts" / "kuberl" / "dashboards"


def _targets() -> list[Path]:
    """Folders that hold generated JSON: the package's, plus the chart's in a source checkout."""
    return [GENERATED] + ([CHART_DASHBOARDS] if CHART_DASHBOARDS.parent.is_dir() else [])


def rendered() -> dict[str, str]:
    """File name -> JSON text for every dashboard."""
    return {f"{uid}.json": d.to_json() for uid, d in DASHBOARDS.items()}


def stale_files(folder: Path = GENERATED) -> list[str]:
    """Generated files that are missing, different, or no longer produced."""
    want = rendered()
    stale = [n for n, text in want.items() if not (folder / n).is_file() or (folder / n).read_text() != text]
    extra = [p.name for p in folder.glob("*.json") if p.name not in want] if folder.is_dir() else []
    return sorted(stale + extra)


def write_generated(folder: Path = GENERATED) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    want = rendered()
    for p in folder.glob("*.json"):
        if p.name not in want:
            p.unlink()
    out = []
    for name, text in want.items():
        (folder / name).write_text(text)
        out.append(folder / name)
    return out


def folder_uid(title: str) -> str:
    """A Grafana folder uid derived from its title (stable, so uploads update in place)."""
    uid = re.sub(r"[^a-zA-Z0-9_-]+", "-", title).strip("-").lower()
    if not uid:
        raise ValueError(f"folder title {title!r} has no usable characters for a uid")
    return uid[:40]


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Parse a run's events.jsonl; a malformed line is an error naming the line."""
    events = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not JSON ({err.msg})") from None
        if not isinstance(ev, dict) or not isinstance(ev.get("time"), int | float) or "kind" not in ev:
            raise ValueError(f"{path}:{i}: an event needs a numeric 'time' and a 'kind'")
        events.append(ev)
    return events


def annotation_payloads(events: list[dict[str, Any]], dashboard_uid: str = "kuberl-training") -> list[dict]:
    """Grafana annotation bodies (POST /api/annotations) for a run's events.

    Tags: ``kuberl``, the event kind, and ``stage:<name>`` / ``step:<n>`` when present, so
    dashboards can filter annotations by tag. Grafana wants epoch milliseconds.
    """
    out = []
    for ev in events:
        tags = ["kuberl", str(ev["kind"])]
        if ev.get("stage"):
            tags.append(f"stage:{ev['stage']}")
        if ev.get("step") is not None:
            tags.append(f"step:{ev['step']}")
        ms = int(round(float(ev["time"]) * 1000))
        out.append(
            {
                "dashboard_uid": dashboard_uid,
                "time_from": ms,
                "time_to": ms,
                "tags": tags,
                "text": str(ev.get("text") or ev["kind"]),
            }
        )
    return out


def upload(url: str, token: str, folder: str = "kuberl", annotations: str | None = None) -> dict[str, int]:
    """Create/update the folder, overwrite the dashboards, post annotations. Returns counts."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    events = read_events(annotations) if annotations else []
    api = GrafanaApi.from_url(url, credential=token)
    fuid = folder_uid(folder)
    try:
        api.folder.get_folder(fuid)
    except GrafanaClientError as err:
        if err.status_code != 404:
            raise
        api.folder.create_folder(folder, uid=fuid)
    for d in DASHBOARDS.values():
        body = json.loads(d.to_json())
        api.dashboard.update_dashboard(
            {"dashboard": body, "folderUid": fuid, "overwrite": True, "message": "kuberl dashboards upload"}
        )
    for payload in annotation_payloads(events):
        api.annotations.add_annotation(**payload)
    return {"dashboards": len(DASHBOARDS), "annotations": len(events)}


def run(args: argparse.Namespace) -> int:
    """Entry point wired to `kuberl dashboards ...`."""
    if args.dashboards_command == "generate":
        if args.check:
            bad = {str(folder): stale for folder in _targets() if (stale := stale_files(folder))}
            for folder, stale in bad.items():
                print(
                    f"stale dashboards in {folder}: {', '.join(stale)}; run `kuberl dashboards generate`",
                    file=sys.stderr,
                )
            if bad:
                return 1
            print(f"dashboards in {', '.join(map(str, _targets()))} are up to date")
            return 0
        for folder in _targets():
            for p in write_generated(folder):
                print(f"wrote {p}")
        return 0
    if args.dashboards_command == "upload":
        from grafana_client.client import GrafanaException

        try:
            counts = upload(args.url, args.token, folder=args.folder, annotations=args.annotations)
        except GrafanaException as err:
            print(f"error: Grafana at {args.url} answered: {err}", file=sys.stderr)
            return 1
        print(
            f"uploaded {counts['dashboards']} dashboards and {counts['annotations']} annotations to {args.url}"
        )
        return 0
    raise ValueError(f"unknown dashboards command {args.dashboards_command!r}")
