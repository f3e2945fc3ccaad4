"""Terminal views of request traces (rich): one request's waterfall, and the per-stage breakdown.

Pure rendering over infra/tracequery.py's RequestTrace / Breakdown; the command is infra/tracecli.py.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from infra.tracequery import Breakdown, RequestTrace

SERVICE_STYLE = {"router": "cyan", "gate": "magenta", "prefill": "green", "decode": "yellow"}
BAR_WIDTH = 40

# attributes worth a glance in the waterfall, per span name (the rest stay in the file / the UI)
SHOWN = {
    "router.request": ("prompt_tokens", "completion_tokens", "cached_tokens", "status", "routing_reason"),
    "gate.admit": ("decision",),
    "store.lookup": ("hit_chunks", "device_tokens"),
    "store.restore": ("chunks", "bytes", "block_wait_ms"),
    "prefill.compute": ("tokens_computed", "tokens_reused", "tokens_from_store"),
    "kv.handoff": ("mode", "bytes", "writes", "rounds", "early_grant"),
    "kv.gather": ("round", "bytes"),
    "kv.write": ("round", "writes"),
    "decode.scatter": ("bytes",),
    "decode.slot_grant": ("granted",),
    "decode.page_grant": ("runs",),
    "decode.generate": ("completion_tokens", "first_token_ms", "itl_mean_ms", "itl_p90_ms"),
}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1f}"
    if isinstance(v, int) and abs(v) >= 100_000:
        return f"{v / 2**20:.1f}Mi" if v >= 2**20 else f"{v:,}"
    return str(v)


def _bar(start: float, dur: float, total: float, width: int = BAR_WIDTH) -> str:
    """A bar of `width` cells for [start, start+dur] out of [0, total] (at least one cell)."""
    total = max(total, 1e-9)
    a = min(width - 1, int(start / total * width))
    b = max(a + 1, min(width, round((start + dur) / total * width)))
    return " " * a + "█" * (b - a) + " " * (width - b)


def waterfall(trace: RequestTrace) -> Table:
    root = trace.root
    t0 = root["start_ns"]
    end = max(s["end_ns"] for s in trace.spans)
    total_ms = (end - t0) / 1e6
    a = root["attributes"]
    table = Table(title=f"request {trace.request_id}  trace {trace.trace_id}  session {a.get('session_id') or '-'}",
                  title_justify="left", show_lines=False, pad_edge=False)
    table.add_column("span", no_wrap=True)
    table.add_column("service", no_wrap=True)
    table.add_column("start ms", justify="right")
    table.add_column("ms", justify="right")
    table.add_column(f"0 .. {total_ms:,.0f} ms", no_wrap=True)
    table.add_column("attributes", overflow="fold")
    for s in _tree_order(trace):
        style = SERVICE_STYLE.get(s.get("service") or "", "white")
        name = Text("  " * trace.depth(s) + s["name"])
        if (s.get("status") or {}).get("code") == "ERROR":
            name.stylize("bold red")
        start_ms = (s["start_ns"] - t0) / 1e6
        attrs = " ".join(f"{k}={_fmt(s['attributes'][k])}" for k in SHOWN.get(s["name"], ())
                         if k in s["attributes"])
        table.add_row(name, Text(s.get("service") or "?", style=style), f"{start_ms:,.1f}",
                      f"{s['duration_ms']:,.1f}", Text(_bar(start_ms, s["duration_ms"], total_ms), style=style),
                      attrs)
    return table


def _tree_order(trace: RequestTrace) -> list[dict]:
    """Depth-first from the root, children by start time; spans whose parent is missing come last."""
    children: dict[str | None, list[dict]] = {}
    for s in trace.spans[1:]:
        children.setdefault(s.get("parent_span_id"), []).append(s)
    out, stack = [], [trace.root]
    while stack:
        s = stack.pop()
        out.append(s)
        stack.extend(reversed(children.get(s["span_id"], [])))
    seen = {id(s) for s in out}
    return out + [s for s in trace.spans if id(s) not in seen]


def breakdown_table(bd: Breakdown, title: str = "") -> Table:
    table = Table(title=title or f"latency by stage over {bd.requests} requests (ms)", title_justify="left")
    for col, justify in (("stage", "left"), ("requests", "right"), ("p50", "right"), ("p90", "right"),
                         ("p99", "right"), ("mean", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for st in bd.stages:
        table.add_row(st.label, str(st.n), f"{st.p50:,.1f}", f"{st.p90:,.1f}", f"{st.p99:,.1f}", f"{st.mean:,.1f}")
    return table
