"""bench/compact_pool.py: its arithmetic (fast), and its quick size end to end on SmolLM2 (slow): the lossless
restore is exact, the bfloat16 and float8 e4m3fn ones are measurably not (and say by how much)."""

from __future__ import annotations

import json

import pytest

from bench import compact_pool as cp


def test_first_divergence():
    assert cp.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert cp.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert cp.first_divergence([9], [1]) == 0


def test_summary_counts_identical_outputs_and_divergences():
    rows = [{"model": "m", "mode": mode, "first_divergence": div, "first_token_max_logit_diff": d,
             "first_token_argmax_moved": moved, "tokens_compared": 8}
            for mode, div, d, moved in [("lossless", None, 0.0, False), ("lossless", None, 0.0, False),
                                        ("bfloat16", None, 0.01, False), ("bfloat16", 3, 0.2, True)]]
    lossless, bf16 = cp.summarize(rows)
    assert (lossless["identical_outputs"], lossless["first_divergence_min"], lossless["max_logit_diff_max"]) == (2, None, 0)
    assert (bf16["identical_outputs"], bf16["first_divergence_min"], bf16["first_token_argmax_moved"]) == (1, 3, 1)
    assert bf16["max_logit_diff_median"] == pytest.approx(0.105) and bf16["max_logit_diff_max"] == 0.2


@pytest.mark.slow
def test_quick_run_lossless_is_exact_and_compact_is_not(tmp_path):
    out = tmp_path / "cp.json"
    assert cp.main(["--quick", "--models", "smollm2-135m", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["mode"] for r in rows} == {"lossless", "bfloat16", "float8_e4m3fn"} and all(r["history_tokens"] > 0 for r in rows)
    for r in rows:
        if r["mode"] == "lossless":
            assert r["first_divergence"] is None and r["first_token_max_logit_diff"] == 0.0, r
        else:
            assert r["first_token_max_logit_diff"] > 0.0, r  # the history was rounded, and it shows
    sizes = result["bytes"]["smollm2-135m"]
    assert sizes["pool_bytes_per_token_bfloat16"] * 2 == sizes["kv_bytes_per_token"]
    assert sizes["pool_bytes_per_token_float8_e4m3fn"] * 4 == sizes["kv_bytes_per_token"]
    assert out.with_suffix(".png").stat().st_size > 0
