"""Agent-hint priority through the whole system (bench/priority.py at its quick size): the default `moorage up`
overloaded by closed-loop low-priority clients while high requests come with priority 0 and 5 in turn.
Every request of both classes is served (no error, none lost to the overload); the TTFT table is printed
(-s) and the full size's numbers live in bench/results/priority.json. The ordering itself is proven without
timing in tests/test_gate_admission.py, tests/test_gate_service.py and tests/test_scheduler_policy.py."""

from __future__ import annotations

import pytest

from bench.priority import QUICK, report, run

pytestmark = pytest.mark.slow


def test_both_classes_are_served_under_overload(tmp_path):
    result = run(QUICK, str(tmp_path / "run"))
    print("\n" + report(result))
    assert result["errors"] == []
    classes = result["classes"]
    assert classes["unloaded"]["n"] == QUICK.high
    assert classes["overloaded, priority 0"]["n"] == QUICK.high
    assert classes[f"overloaded, priority {QUICK.priority}"]["n"] == QUICK.high
    assert classes["low class (overload)"]["n"] > 0 and result["low_completed_per_s"] > 0
