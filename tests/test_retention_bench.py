"""bench/retention.py at its quick size (slow): against the same script, router.retention=session keeps the
histories of the sessions that paused for a tool, where plain LRU (router.retention=lru) lost them to other
work; its arithmetic (fast)."""

from __future__ import annotations

import json

import pytest

from bench import retention as rt


def test_summary_splits_sessions_expected_back_from_ended_ones():
    mode = {"retention": "session", "prefill_sessions": {"session_blocks_demoted": 7}, "rows": [
        {"expected_back": True, "history_share_cached": 1.0}, {"expected_back": True, "history_share_cached": 0.5},
        {"expected_back": False, "history_share_cached": 0.0}]}
    s = rt.summarize(mode)
    assert (s["expected_back_history_cached"], s["ended_history_cached"], s["blocks_demoted"]) == (0.75, 0.0, 7)


@pytest.mark.slow
def test_sessions_expected_back_keep_their_history_where_lru_loses_it(tmp_path):
    out = tmp_path / "retention.json"
    assert rt.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    lru, session = json.loads(out.read_text())["summary"]
    assert (lru["retention"], session["retention"]) == ("lru", "session")
    assert session["expected_back_history_cached"] >= 0.9, session
    assert lru["expected_back_history_cached"] < session["expected_back_history_cached"] - 0.3, (lru, session)
    assert lru["blocks_demoted"] == 0 and session["blocks_demoted"] > 0


@pytest.mark.slow
def test_sessions_expected_back_keep_their_history_in_the_pool(tmp_path):
    """bench/retention_pool.py at its quick size: the device cache keeps nothing of the first turns and other
    work overflows the pool; the tool sessions' chunks were soft-pinned when their turn ended in a call, so
    their history comes back from the pool (restored, not recomputed); under LRU it is gone."""
    from bench import retention_pool

    out = tmp_path / "retention-pool.json"
    assert retention_pool.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    lru, session = json.loads(out.read_text())["summary"]
    assert session["expected_back_history_cached"] >= 0.9, session
    assert session["saved_pinned_chunks"] > 0 and session["restored_chunks"] >= session["saved_pinned_chunks"] / 2
    assert lru["saved_pinned_chunks"] == 0
    assert lru["expected_back_history_cached"] < session["expected_back_history_cached"] - 0.5, (lru, session)
