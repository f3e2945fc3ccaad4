"""bench/prefetch.py at its quick size (slow): sessions paused for a tool, whose history other work pushed out of
the prefill's device cache, find it there again when they return (prefetched from the pool halfway through the
pause agents take); with prefetch off they restore it themselves on arrival."""

from __future__ import annotations

import json

import pytest

from bench import prefetch


def test_summary_counts_the_returning_turns():
    mode = {"prefetch": True, "rows": [{"latency_ms": 10.0, "prompt_tokens": 100, "cached_tokens": 90},
                                       {"latency_ms": 30.0, "prompt_tokens": 100, "cached_tokens": 70}],
            "prefill_pool": {"prefetches": 2, "prefetch_used": 1}}
    s = prefetch.summarize(mode)
    assert (s["latency_p50_ms"], s["history_cached"], s["prefetches"], s["prefetch_used"], s["prefetch_wasted"]) \
        == (20.0, 0.8, 2, 1, 0)


@pytest.mark.slow
def test_a_paused_session_finds_its_history_prefetched(tmp_path):
    out = tmp_path / "prefetch.json"
    assert prefetch.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    off, on = json.loads(out.read_text())["summary"]
    n = on["returning_turns"]
    assert off["prefetches"] == 0 and off["prefetch_used"] == 0
    assert on["prefetches"] >= n and on["prefetch_used"] >= n - 1, on  # one may race a filler
    assert on["history_cached"] >= off["history_cached"] - 0.01 and on["history_cached"] > 0.9
