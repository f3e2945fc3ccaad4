"""Spans back out of Phoenix, through its REST API (`GET /v1/projects/{project}/spans`, cursor-paged),
in the jsonl exporter's shape (shared/tracing.span_to_dict), so infra/tracequery.py reads either source.

Phoenix keeps span attributes but not the OTLP resource: the service name comes from the
`service.name` span attribute that shared/tracing.py adds when it exports over OTLP.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone

from shared.tracing import PROJECT

PAGE = 1000  # Phoenix's largest page


def _ns(iso: str) -> int:
    dt = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def from_phoenix(span: dict) -> dict:
    """One Phoenix REST span as a jsonl-exporter span dict."""
    attrs = dict(span.get("attributes") or {})
    service = attrs.pop("service.name", None)
    instance = attrs.pop("service.instance.id", None)
    start, end = _ns(span["start_time"]), _ns(span["end_time"])
    return {
        "name": span["name"], "trace_id": span["context"]["trace_id"], "span_id": span["context"]["span_id"],
        "parent_span_id": span.get("parent_id"), "service": service, "instance": instance,
        "kind": span.get("span_kind", ""), "start_ns": start, "end_ns": end, "duration_ms": (end - start) / 1e6,
        "attributes": attrs,
        "status": {"code": span.get("status_code", "UNSET"), "description": span.get("status_message", "")},
        "events": [{"name": e.get("name"), "attributes": e.get("attributes", {})} for e in span.get("events") or []],
    }


class PhoenixClient:
    def __init__(self, url: str, timeout: float = 30.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _get(self, path: str, **query) -> dict:
        q = urllib.parse.urlencode([(k, v) for k, vs in query.items() if vs is not None
                                    for v in (vs if isinstance(vs, list) else [vs])])
        with urllib.request.urlopen(f"{self.url}{path}{'?' + q if q else ''}", timeout=self.timeout) as r:
            return json.loads(r.read())

    def projects(self) -> list[dict]:
        return self._get("/v1/projects")["data"]

    def spans(self, project: str = PROJECT, since_ns: int = 0, trace_ids: list[str] | None = None) -> list[dict]:
        """Every span of `project` that started at or after since_ns (optionally of these traces only)."""
        start = (datetime.fromtimestamp(since_ns / 1e9, timezone.utc).isoformat() if since_ns else None)
        out, cursor = [], None
        while True:
            try:
                page = self._get(f"/v1/projects/{urllib.parse.quote(project, safe='')}/spans", limit=PAGE,
                                 cursor=cursor, start_time=start, trace_id=trace_ids)
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    raise LookupError(f"Phoenix at {self.url} has no project {project!r}") from None
                raise
            out += [from_phoenix(s) for s in page["data"]]
            cursor = page.get("next_cursor")
            if not cursor:
                return out
