"""Agent sessions on a host whose every core is busy with other work (bench/busy_host.py at its quick size):
the default `moorage up` answers every turn, the tool-call turn and the turn that reads its result."""

from __future__ import annotations

import os

import pytest

from bench.busy_host import QUICK, report, run

pytestmark = pytest.mark.slow


def test_every_turn_is_answered_while_other_processes_keep_every_core_busy(tmp_path):
    result = run(QUICK, str(tmp_path))
    print("\n" + report(result))
    [cell] = result["runs"]
    assert cell["load"] == "busy" and cell["warmer"] == "on" and cell["hogs"] == (os.cpu_count() or 1)
    assert result["errors"] == []
    by_session: dict[int, dict[int, dict]] = {}
    for r in cell["rows"]:
        assert r["ok"] and r["prompt_tokens"] and r["ttft_s"] <= r["t_end"] - r["t_start"] + 1e-3
        by_session.setdefault(r["session"], {})[r["turn"]] = r
    assert len(by_session) == QUICK.sessions
    for turns in by_session.values():
        assert sorted(turns) == [1, 2] and turns[1]["calls"]  # required: a call, then its result read
        assert turns[2]["prompt_tokens"] > turns[1]["prompt_tokens"]
