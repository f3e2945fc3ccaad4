"""`moorage trace show REQUEST_ID|--last` and `moorage trace breakdown [--since ...]`: where requests'
time went, in the terminal, from the run's traces.jsonl (default) or from Phoenix's API (--phoenix URL).

(`moorage trace synth|validate` are the agent-trace corpus tools of bench/agentic; cli.py sends
`show` and `breakdown` here.)
"""

from __future__ import annotations

import argparse
import re
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console

from infra.tracequery import breakdown, find_request, read_jsonl, request_traces
from infra.traceview import breakdown_table, waterfall
from shared.tracing import PROJECT

ACTIONS = ("show", "breakdown")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str | None, now: float | None = None) -> int:
    """Nanoseconds since the epoch: "" / None -> 0 (everything); "90s", "10m", "2h", "1d" -> that long
    ago; an ISO date-time (local time unless it has an offset); or plain epoch seconds."""
    if not text:
        return 0
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return int((now - float(m.group(1)) * _UNITS[m.group(2)]) * 1e9)
    try:
        return int(float(text) * 1e9)
    except ValueError:
        pass
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1e9)
    except ValueError:
        raise ValueError(f"--since {text!r}: expected e.g. 10m, 2h, 1d, an ISO date-time or epoch seconds") from None


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="request traces (OpenTelemetry spans): waterfall and "
                                                       "per-stage latency")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="one request's waterfall")
    which = show.add_mutually_exclusive_group(required=True)
    which.add_argument("request_id", nargs="?", help="the request id (X-Request-ID, the response's id) or trace id")
    which.add_argument("--last", action="store_true", help="the latest request that finished")
    bd = sub.add_parser("breakdown", help="p50/p90/p99 per stage across requests")
    bd.add_argument("--since", help="only requests started since: 10m, 2h, 1d, an ISO date-time or epoch seconds")
    for q in (show, bd):
        src = q.add_mutually_exclusive_group()
        src.add_argument("--file", help="a jsonl trace file (default: RUN_DIR/traces.jsonl)")
        src.add_argument("--phoenix", metavar="URL", help="read from a Phoenix server instead, e.g. http://127.0.0.1:6006")
        q.add_argument("--run-dir", default=".moorage", help="the `moorage up` run dir (default %(default)s)")
        q.add_argument("--project", default=PROJECT, help="Phoenix project (default %(default)s)")
        q.add_argument("--width", type=int, default=0, help="terminal width (default: detected)")
    return p


def load_spans(args: argparse.Namespace, since_ns: int = 0) -> list[dict]:
    if args.phoenix:
        from infra.phoenix_api import PhoenixClient

        return PhoenixClient(args.phoenix).spans(args.project, since_ns=since_ns)
    return read_jsonl(Path(args.file) if args.file else Path(args.run_dir) / "traces.jsonl", since_ns)


def main(argv: list[str] | None = None, prog: str = "moorage trace") -> int:
    args = _parser(prog).parse_args(argv)
    console = Console(width=args.width or None, soft_wrap=False)
    since = parse_since(getattr(args, "since", None))
    try:
        traces = request_traces(load_spans(args, since))
        if args.action == "show":
            console.print(waterfall(find_request(traces, None if args.last else args.request_id)))
        else:
            if not traces:
                raise LookupError("no request traces found" + (f" since {args.since}" if args.since else ""))
            console.print(breakdown_table(breakdown(traces)))
    except (LookupError, OSError) as e:
        console.print(f"moorage trace {args.action}: {e}", style="red")
        return 1
    return 0
