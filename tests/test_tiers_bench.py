"""bench/agentic/tiers.py: the pause mixture and the sizing it documents, the per-mode summary, and (slow) the
six systems side by side at the quick size: every mode answers every request, tool turns end in real calls,
and the disk tier writes what the pool saved."""

from __future__ import annotations

import json
import math

import pytest

from bench.agentic import tiers
from bench.agentic.trace import iter_requests


def test_pauses_follow_the_documented_mixture():
    sessions = tiers.corpus(tiers.Size(sessions=40, turns=6))
    pauses = [r.think_time for s in sessions for t, r in iter_requests(s) if t == "main" and r.think_time > 0]
    assert len(pauses) > 150 and 2.0 <= min(pauses) and max(pauses) <= 600.0
    share = {name: sum(lo <= p < hi for p in pauses) / len(pauses) for name, lo, hi in tiers.BUCKETS}
    assert abs(share["<30s"] - 0.55) < 0.1 and abs(share["30s-5min"] - 0.30) < 0.1 and abs(share[">5min"] - 0.15) < 0.08


def test_the_caches_hold_a_third_of_the_working_set():
    sz = tiers.sizing(tiers.corpus(tiers.FULL), tiers.FULL)
    cached = sz["device_blocks"] * 16 * tiers.KV_BYTES_PER_TOKEN + sz["store_bytes"]
    assert cached <= 0.34 * sz["working_set_bytes"] and sz["disk_bytes"] >= sz["working_set_bytes"]
    assert sz["device_blocks"] * 16 >= 2 * sz["longest_tokens"] - 16
    assert sz["unbounded_blocks"] * 16 >= sz["distinct_tokens"] + 2 * sz["longest_tokens"]  # the ceiling's system
    sets = tiers.overrides("unbounded", sz, "runs/x")
    assert sets[-1] == f"prefill.engine.num_blocks={sz['unbounded_blocks']}"  # the last word: over the base's
    assert "up.disk_dir=runs/x/disk/disk" in tiers.overrides("disk", sz, "runs/x")


def test_a_rerun_starts_with_an_empty_disk_tier(tmp_path):
    """The same prompts every run: a disk tier left from the last one would serve hits this run never earned."""
    old = tmp_path / "compact" / "disk" / "store-0" / "objects"
    old.mkdir(parents=True)
    (old / "k").write_bytes(b"x")
    assert tiers.fresh_disk(str(tmp_path), "compact") == tmp_path / "compact" / "disk"
    assert not (tmp_path / "compact" / "disk").exists()
    assert tiers.fresh_disk(str(tmp_path), "lru") == tmp_path / "lru" / "disk"  # nothing there: no error


def test_summary_splits_ttft_by_pause_and_times_each_session():
    rec = dict(warmup=False, thread="main", status=200, device=50, store=30, computed=20, prompt_tokens=100,
               ceiling_tokens=90)
    records = [dict(rec, session="a", think_s=5.0, ttft_s=0.1, t_start=0.0, t_end=1.0),
               dict(rec, session="a", think_s=400.0, ttft_s=0.3, t_start=401.0, t_end=402.0),
               dict(rec, session="b", think_s=40.0, ttft_s=0.2, t_start=10.0, t_end=60.0)]
    s = tiers.summarize_mode("x", {"records": records, "errors": {"total": 0}}, {})
    assert s["hit_share"] == 0.8 and s["ceiling_share"] == 0.9
    assert [s["ttft_s"][b]["n"] for b, _, _ in tiers.BUCKETS] == [1, 1, 1]
    assert s["ttft_s"][">5min"]["p50"] == 0.3 and s["jct_s"] == {"a": 402.0, "b": 50.0}
    assert math.isclose(s["jct_mean_s"], 226.0)
    assert s["wait_s"] == {"a": 2.0, "b": 50.0}  # the pauses are not the model's


def test_model_wait_is_the_union_of_a_sessions_requests_after_its_warm_up():
    def r(sid, a, b, warm=False):
        return dict(session=sid, t_start=a, t_end=b, warmup=warm)
    recs = [r("a", 0.0, 30.0, warm=True), r("a", 40.0, 45.0), r("a", 44.0, 50.0), r("a", 46.0, 47.0),  # overlaps
            r("a", 100.0, 101.5), r("b", 5.0, 6.0)]
    assert tiers.model_wait_s(recs) == {"a": 11.5, "b": 1.0}


def test_offline_bounds_in_trace_and_served_order():
    sessions = tiers.corpus(tiers.QUICK)
    sz = tiers.sizing(sessions, tiers.QUICK)
    records, t = [], 0.0
    for s in reversed(sessions):  # served in another order than the trace's
        counts = {}
        for thread, _ in iter_requests(s):
            counts[thread] = counts.get(thread, -1) + 1
            records.append(dict(session=s.id, thread=thread, index=counts[thread], t_start=t, status=200,
                                warmup=counts[thread] == 0 and thread == "main"))
            t += 1.0
    off = tiers.offline_bounds(sessions, records, sz)
    for order in ("trace_order", "served_order"):
        dram, both = off[order]["dram"], off[order]["device+dram"]
        assert dram["capacity_blocks"] < both["capacity_blocks"]
        assert 0 <= dram["lru"] <= dram["optimum"] <= both["optimum"] <= off[order]["ceiling"] <= 1
        assert dram["lru"] <= both["lru"]


@pytest.mark.slow
def test_the_systems_replay_the_same_sessions(tmp_path):
    out = tmp_path / "tiers.json"
    assert tiers.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    by_mode = {s["mode"]: s for s in result["summary"]}
    assert list(by_mode) == list(tiers.MODES)
    for s in by_mode.values():
        assert s["errors"] == 0 and s["returning_turns"] > 0 and s["hit_share"] is not None
    assert by_mode["lru"]["disk"] is None and by_mode["disk"]["disk"]["written"] > 0
    off = by_mode["lru"]["offline"]["served_order"]["device+dram"]
    assert 0 <= off["lru"] <= off["optimum"] <= 1
    ceiling = by_mode["unbounded"]["hit_share"]  # the measured ceiling: no bounded system is far above it
    assert all(s["measured_ceiling"] == ceiling and s["hit_share"] <= ceiling + 0.05 for s in by_mode.values())
    assert by_mode["compact"]["disk"]["written_bytes"] < by_mode["disk"]["disk"]["written_bytes"]  # bf16 objects
    # tool turns ended in real calls, so the router learned the sessions' pauses
    assert by_mode["session"]["pool"]["saved_pinned_chunks"] > 0 and by_mode["lru"]["pool"]["saved_pinned_chunks"] == 0
