"""Reading a running cluster the way an operator would: each host's span file (/var/log/moorage/traces.jsonl
on that host), Prometheus text from /metrics endpoints, and each host's listening sockets (`ss`)."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shared.tracing import read_spans

SPAN_WAIT_S = 30.0  # span exporters batch (up to ~5 s); a loaded box is slower still
SPAN_POLL_S = 0.2


@dataclass(frozen=True)
class HostSpan:
    host: str
    span: dict

    @property
    def name(self) -> str:
        return self.span["name"]

    @property
    def attrs(self) -> dict:
        return self.span["attributes"]


class Traces:
    """The span files of every host (host -> its traces.jsonl)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def _all(self) -> list[HostSpan]:
        return [HostSpan(host, s) for host, path in self.files.items() for s in read_spans(path)]

    def request(self, request_id: str, want: set[tuple[str, str]], timeout: float = SPAN_WAIT_S) -> list[HostSpan]:
        """Every span of the request's trace, once each (host, span name) in `want` is there; the spans
        exporters batch, so this waits for them (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self._all()
            roots = [s for s in spans if s.name == "router.request" and s.attrs.get("request_id") == request_id]
            trace = [s for s in spans if roots and s.span["trace_id"] == roots[0].span["trace_id"]]
            have = {(s.host, s.name) for s in trace}
            if want <= have:
                return trace
            if time.monotonic() > deadline:
                raise AssertionError(f"request {request_id}: spans {sorted(want - have)} missing after {timeout:.0f} s "
                                     f"(have {sorted(have)})")
            time.sleep(SPAN_POLL_S)


def one(spans: list[HostSpan], name: str, host: str | None = None) -> HostSpan:
    found = [s for s in spans if s.name == name and (host is None or s.host == host)]
    assert len(found) == 1, f"expected one {name} span{' on ' + host if host else ''}, got {len(found)}"
    return found[0]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_label(metrics: dict[tuple[str, tuple], float], name: str, label: str) -> dict[str, float]:
    """One metric's values keyed by one of its labels."""
    return {dict(labels)[label]: v for (n, labels), v in metrics.items() if n == name and label in dict(labels)}


def _owner(pid: int, owners: dict[int, str]) -> str:
    """The service whose process tree `pid` is in (mooncake_master is the master service's child)."""
    seen = pid
    while seen > 1:
        if seen in owners:
            return owners[seen]
        try:
            seen = int(Path(f"/proc/{seen}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return f"pid {pid}"


def listening(prefix: list[str], owners: dict[int, str]) -> dict[str, list[str]]:
    """Every listening TCP/UDP socket inside a namespace (`ss` run there), by service: "tcp 10.66.0.1:9100"."""
    r = subprocess.run([*prefix, "ss", "-Hltnup"], capture_output=True, text=True, timeout=30, check=True)
    out: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        fields = line.split()
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        for name in {_owner(p, owners) for p in pids} or {"?"}:
            out.setdefault(name, []).append(f"{fields[0]} {fields[4]}")
    return {k: sorted(set(v)) for k, v in sorted(out.items())}
