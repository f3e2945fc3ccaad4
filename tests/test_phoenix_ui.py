"""`moorage up --set up.trace_ui=phoenix`: Phoenix starts with the system, every service exports to it,
and each request is one trace there with every service's spans under the right parents (read back
through Phoenix's REST API). Then headless Chromium renders the trace page: its DOM must list the
services' spans, and its screenshot is taken (into the test's tmp dir; with MOORAGE_UPDATE_SCREENSHOT=1 it
replaces bench/results/phoenix-trace.png, so a plain test run leaves the tree clean).

Needs Phoenix (the [ui] extra or .venv-phoenix, made by infra/dev-env.sh) and Debian's `chromium`
(also installed by dev-env.sh): it fails, rather than skips, when they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.phoenix_api import PhoenixClient
from infra.up import UpConfig, launched
from shared.config import load_config
from shared.tracing import PROJECT
from tests.natsbus import nats_url
from tests.tracetree import SYSTEM, arrived, check_tree, restored_turn

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "bench" / "results" / "phoenix-trace.png"

pytestmark = pytest.mark.ui


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Debian's chromium is missing: run infra/dev-env.sh (apt-get install chromium)"
    return exe


def headless(url: str, *args: str) -> subprocess.CompletedProcess:
    """Chromium renders `url` (a single-page app: give its scripts virtual time to fetch and draw)."""
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1800,1100", "--virtual-time-budget=20000", *args, url],
                          capture_output=True, text=True, timeout=180)


def phoenix_trace(client: PhoenixClient, trace_id: str, timeout: float = 60.0) -> list[dict]:
    """The trace's spans in Phoenix once all of them arrived (exporters send in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = client.spans(PROJECT, trace_ids=[trace_id])
        if arrived(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(1.0)


def requests_in(client: PhoenixClient, rids: set[str], timeout: float = 60.0) -> list[dict]:
    """The router.request spans in Phoenix once every one of `rids` arrived (the project itself is
    made by the first span Phoenix receives)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            roots = [s for s in client.spans(PROJECT) if s["name"] == "router.request"]
        except LookupError:
            roots = []
        if rids <= {s["attributes"].get("request_id") for s in roots} or time.monotonic() > deadline:
            return roots
        time.sleep(1.0)


def test_phoenix_shows_one_trace_per_request_across_services(tmp_path):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[*SYSTEM, "up.port=0", f"up.nats_url={url}",
                                               f"up.run_dir={tmp_path}", "up.trace_ui=phoenix"])
        with launched(cfg) as (launcher, base):
            phoenix = launcher.trace_ui
            assert phoenix is not None and phoenix.process.poll() is None
            for section in ("router", "gate", "prefill", "decode", "store", "master"):
                t = getattr(launcher.cfg, section).tracing
                assert (t.exporter, t.endpoint) == ("jsonl,otlp-http", phoenix.url)
            rids = restored_turn(base)
            client = PhoenixClient(phoenix.url)
            roots = requests_in(client, set(rids))
            assert PROJECT in {p["name"] for p in client.projects()}
            last = next(s for s in roots if s["attributes"].get("request_id") == rids[-1])
            by_name = check_tree(phoenix_trace(client, last["trace_id"]))
            assert by_name["store.restore"][0]["attributes"]["chunks"] == 2
            assert not [s for s in client.spans(PROJECT) if s["name"].startswith(("GET ", "fastapi."))]

            shown = subprocess.run([sys.executable, "-m", "infra.cli", "trace", "show", rids[-1], "--phoenix",
                                    phoenix.url, "--width", "200"], cwd=REPO, capture_output=True, text=True,
                                   timeout=120)
            assert shown.returncode == 0, shown.stderr + shown.stdout
            assert "store.restore" in shown.stdout and "decode.generate" in shown.stdout

            page = phoenix.trace_url(last["trace_id"])
            dom = headless(page, "--dump-dom")
            assert dom.returncode == 0, dom.stderr[-2000:]
            for name in ("router.request", "gate.admit", "store.restore", "prefill.compute", "kv.handoff",
                         "decode.generate"):
                assert name in dom.stdout, f"{name} not on Phoenix's trace page"
            png = SCREENSHOT if os.environ.get("MOORAGE_UPDATE_SCREENSHOT") == "1" else tmp_path / SCREENSHOT.name
            shot = headless(page, f"--screenshot={png}")
            assert shot.returncode == 0 and png.stat().st_size > 20_000, shot.stderr[-2000:]
        assert phoenix.process.poll() is not None  # stopped with the system
