"""bench/layouts.py at its quick size: every configuration runs, answers as one process does, and the report
carries the ratios, the bubble and the exchange wait it claims."""

from __future__ import annotations

import json

from bench import layouts


def test_quick_layouts_bench(tmp_path):
    out = tmp_path / "layouts.json"
    assert layouts.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["exact"] and r["comparisons"] == 2 * (len(layouts.QUICK.prompt_lengths) + len(layouts.QUICK.contexts))
    pre = {(x["prompt_tokens"], x["pp"]): x for x in r["prefill"]}
    assert all(pre[(n, 1)]["vs_pp1"] == 1 and pre[(n, 2)]["ttft_ms_median"] > 0 for n in layouts.QUICK.prompt_lengths)
    assert all(0 < pre[(n, 2)]["bubble_median"] < 1 for n in layouts.QUICK.prompt_lengths)
    dec = {x["dcp"]: x for x in r["decode"]}
    assert dec[1]["vs_dcp1"] == 1 and 0 < dec[2]["exchange_wait_share"] < 1
    assert (tmp_path / "layouts.png").stat().st_size > 0
