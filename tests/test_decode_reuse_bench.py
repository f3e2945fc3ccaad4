"""Decode reuse through the whole system, on against off (bench/decode_reuse.py at its quick size: tiny model,
two sessions growing to 2K tokens): the same turns give the same answers in both modes; with reuse on,
returning turns hand off only what decode lacked (at most 1.1x its KV plus one block) and decode held part of
every returning prompt; with it off, nothing is held. Timings are printed (-s), never asserted; the full
size's numbers live in bench/results/decode-reuse.json."""

from __future__ import annotations

import pytest

from bench.decode_reuse import QUICK, report, run

pytestmark = pytest.mark.slow


def test_reuse_on_sends_only_what_decode_lacks_and_answers_the_same(tmp_path):
    result = run(QUICK, str(tmp_path / "run"))
    print("\n" + report(result))
    off, on = result["summary"]["off"], result["summary"]["on"]
    assert result["answers_identical"] and result["turns"] >= 6
    assert off["returning_turns"] == on["returning_turns"] >= 4
    assert off["decode_hit_share"] == 0 and on["decode_hit_share"] > 0.5
    assert on["bytes_over_lacked_kv_plus_block"] <= 1.1
    assert on["handoff_mb_per_turn"] < off["handoff_mb_per_turn"] / 2
    on_rows = [r for r in result["modes"][1]["rows"] if r["turn"] > 0]
    assert all(r["reused_blocks"] > 0 for r in on_rows)
