"""Busy is not dead (issue 33): the default `moorage up` with a CPU hog on every core, and ten agent sessions
sending ~3K-token prompts at once, two turns each (bench/saturation.py at its quick size, the openai SDK
streaming). Before the fix 0 of 20 requests succeeded: routers took a starved decode and prefill for dead
("instance lost", no load report for 3 s). Now:
- every request succeeds;
- the router logs no "instance lost", and no process ended (none announced, same pids, 0 restarts);
- the second turn's history came from cache (cached tokens > 0): the saturated system still does its job.

Run with -s to see the load-report gaps each instance had."""

from __future__ import annotations

import pytest

from bench.saturation import QUICK, report, run

pytestmark = pytest.mark.slow


def test_saturated_host_fails_no_request_as_instance_lost(tmp_path):
    result = run(QUICK, str(tmp_path / "run"))
    print("\n" + report(result))
    assert result["requests"] == QUICK.sessions * QUICK.turns
    assert result["failed"] == [], result["failed"]
    assert result["instance_lost"] == 0
    assert result["exits_announced"] == [] and result["all_alive"], (result["exits_announced"], result["restarts"])
    assert not any(result["restarts"].values()), result["restarts"]
    assert result["cached_tokens_turn2_plus"] > 0
    # every instance kept reporting while saturated (each one was heard; the gaps are printed above)
    assert {k.split("/")[0] for k in result["gaps"]} >= {"router", "gate", "prefill", "decode"}
