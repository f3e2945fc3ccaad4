"""bench/agent_loop.py: the reuse-ceiling and summary arithmetic (fast), and the bench at its quick size
end to end (slow): mini-swe-agent against one `moorage up` per pool mode, K = 1 and 2 agents, 3 steps.

What the slow test holds the system to: every model call recorded (as many rows as the agent made calls,
each with the prompt length the router reported, and our rendering of the prompt with the router's code
giving exactly that length); every step a valid `bash` call the agent accepted (before the grammar closed
objects that list their properties, SmolLM2 nested invented keys into mini-swe-agent's bash call until
max_tokens cut 5 of 7 first calls off); from step 2 on a cached share
above 0 in every run and never more than the conversation's own ceiling (plus one block of rounding); the
JSON and PNG written.
"""

from __future__ import annotations

import json

import pytest

from bench import agent_loop as al
from services.router.tool_calls import FORMATS


def row(step: int, prompt: int, cached: int, ceiling: int, valid: bool = True, session: int = 0, **kw) -> dict:
    return {"mode": "pool_on", "k": 1, "session": session, "step": step, "ok": True, "prompt_tokens": prompt,
            "cached_tokens": cached, "ceiling_tokens": ceiling, "ceiling_prompt_only": min(ceiling, prompt),
            "tool_call_valid": valid, "tool_calls": 1 if valid else 0,
            "finish_reason": "tool_calls" if valid else "length",
            "first_token_s": kw.get("ft", 1.0), "ttft_s": kw.get("tt", 2.0), "latency_s": kw.get("lat", 3.0)}


def test_common_prefix_and_ceiling():
    assert al.common_prefix([], [1]) == 0
    assert al.common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert al.common_prefix([1, 2, 3], [1, 2]) == 2
    assert al.common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert al.ceiling_tokens([1, 2, 3], None, None) == 0  # a first step has nothing to reuse
    # the previous prompt, then its completion as far as the new prompt repeats it
    assert al.ceiling_tokens([1, 2, 3, 4, 5, 6], [1, 2, 3], [4, 5, 9]) == 5
    assert al.ceiling_tokens([1, 2, 3, 4], [1, 2, 3], [4, 5, 6]) == 4  # never more than the prompt
    # the new prompt diverges inside the old one (the history dropped a turn): the completion adds nothing
    assert al.ceiling_tokens([1, 2, 7, 4], [1, 2, 3], [4]) == 2


def test_completion_ids_as_the_history_renders_them():
    fmt = FORMATS["hermes"]
    message = {"content": None, "tool_calls": [{"function": {"name": "bash", "arguments": '{"command":"ls"}'}}]}
    text = al.assistant_text(message, fmt)
    assert text == '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert al.assistant_text({"content": "hi", "tool_calls": []}, fmt) == "hi"

    def encode(s):
        return [ord(c) for c in s]
    ids, exact = al.completion_ids(encode, "ab", 3, eos=2)  # stopped with end-of-turn right after
    assert (ids, exact) == ([97, 98, 2], True)
    ids, exact = al.completion_ids(encode, "ab", 2, eos=2)  # stopped by max_tokens right there
    assert (ids, exact) == ([97, 98], True)
    ids, exact = al.completion_ids(encode, "ab", 9, eos=2)  # wrote more than the history shows
    assert (ids, exact) == ([97, 98], False)


def test_call_validity_checks_json_name_and_schema():
    tools = al.tools_for(False)
    ok = [{"function": {"name": "bash", "arguments": '{"command": "ls"}'}}]
    assert al.call_validity(ok, tools) == (True, "")
    assert al.call_validity([], tools)[0] is False
    assert "unknown tool" in al.call_validity([{"function": {"name": "sh", "arguments": "{}"}}], tools)[1]
    assert "not JSON" in al.call_validity([{"function": {"name": "bash", "arguments": "{"}}], tools)[1]
    missing = [{"function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]
    assert "schema" in al.call_validity(missing, tools)[1]
    wrong_type = [{"function": {"name": "bash", "arguments": '{"command": 3}'}}]
    assert "schema" in al.call_validity(wrong_type, tools)[1]
    extra = [{"function": {"name": "bash", "arguments": '{"command": "ls", "x": 1}'}}]
    assert al.call_validity(extra, tools)[0] is True  # mini-swe-agent's schema allows more properties
    assert al.call_validity(extra, al.tools_for(True))[0] is False  # the strict variant does not


def test_usage_from_sse_keeps_moorage_breakdown():
    usage = {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 96},
             "moorage": {"device": 64, "store": 32, "computed": 4}}
    raw = (b'data: {"choices": [{"delta": {"content": ""}}], "usage": null}\n\n'
           + b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    assert al.usage_from_sse(raw) == usage
    assert al.usage_from_sse(b"data: [DONE]\n\n") is None


def test_summary_splits_step_one_from_the_rest():
    rows = [row(1, 1000, 0, 0, ft=2.0, tt=4.0), row(2, 1100, 990, 1050, ft=0.4, tt=2.2),
            row(3, 1200, 1100, 1180, ft=0.5, tt=2.4),
            row(1, 1000, 0, 0, session=1, ft=3.0, tt=5.0), row(2, 1100, 1000, 1100, valid=False, session=1, ft=0.6)]
    s = al.summarize(rows, wall_s=10.0)
    assert (s["steps"], s["ok_steps"], s["sessions"]) == (5, 5, 2)
    assert s["first_token_step1_p50_s"] == 2.5 and s["first_token_step1_p90_s"] == pytest.approx(2.9)
    assert s["first_token_later_p50_s"] == 0.5
    cached = [990 / 1100, 1100 / 1200, 1000 / 1100]
    ceiling = [1050 / 1100, 1180 / 1200, 1100 / 1100]
    assert s["cached_share_later_mean"] == pytest.approx(sum(cached) / 3, abs=1e-4)
    assert s["ceiling_share_later_mean"] == pytest.approx(sum(ceiling) / 3, abs=1e-4)
    assert s["gap_points"] == pytest.approx(100 * (sum(ceiling) - sum(cached)) / 3, abs=0.02)
    assert s["cached_share_step1_mean"] == 0
    assert s["tool_call_valid_share"] == 0.8 and s["finished_calls_valid_share"] == 1.0
    assert s["cut_off_share"] == 0.2
    assert s["steps_per_s"] == 0.5


def test_summary_without_later_steps_or_rows():
    s = al.summarize([row(1, 1000, 0, 0)], wall_s=2.0)
    assert s["cached_share_later_mean"] is None and s["gap_points"] is None and s["first_token_later_p50_s"] is None
    assert al.summarize([], wall_s=1.0)["tool_call_valid_share"] is None


def test_grammar_overhead_is_copied_not_measured(tmp_path):
    assert al.grammar_overhead(tmp_path / "absent.json") is None
    g = {"machine": {"date": "d"}, "rows": [{"batch": 1, "overhead": 0.02, "itl_free_ms": 26.0, "itl_guided_ms": 26.5,
                                             "overhead_each_repeat": [0.01]},
                                            {"batch": 8, "overhead": 0.03}, {"batch": 4, "overhead": 0.5}]}
    (tmp_path / "grammar.json").write_text(json.dumps(g))
    got = al.grammar_overhead(tmp_path / "grammar.json")
    assert [r["batch"] for r in got["rows"]] == [1, 8] and got["measured"] == "d"
    assert "overhead_each_repeat" not in got["rows"][0] and "grammar.json" in got["source"]


@pytest.mark.slow
def test_quick_agent_loop_end_to_end(tmp_path):
    out = tmp_path / "agent-loop.json"
    assert al.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    block = result["params"]["block_tokens"]
    assert [m["mode"] for m in result["modes"]] == ["pool_on", "pool_off"]
    assert result["grammar_overhead"] is None or {r["batch"] for r in result["grammar_overhead"]["rows"]} == {1, 8}
    for m in result["modes"]:
        assert [r["k"] for r in m["runs"]] == list(al.QUICK.sessions)
        for r in m["runs"]:
            for s in r["sessions"]:  # every call recorded: the agent's step limit, unless it submitted earlier
                assert s["error"] == "", s
                assert s["steps"] == al.QUICK.steps or (s["exit_status"] == "Submitted" and s["steps"] >= 1), s
            rows = r["rows"]
            assert len(rows) == sum(s["steps"] for s in r["sessions"])
            assert all(x["ok"] for x in rows), [x["error"] for x in rows]
            assert all(x["rendered_prompt_tokens"] == x["prompt_tokens"] > 0 for x in rows)  # the router's rendering
            assert all(x["first_token_s"] is not None and 0 < x["first_token_s"] <= x["latency_s"] for x in rows)
            for x in rows:  # issue 27's goal: every required call valid against the schema, the agent's parser agreeing
                assert x["tool_calls"] >= 1 and x["tool_call_valid"], x
            later = [x for x in rows if x["step"] >= 2]
            assert later and all(x["cached_tokens"] > 0 for x in later), later
            for x in later:
                assert x["cached_tokens"] <= x["ceiling_tokens"] + block, x
            summary = r["summary"]
            assert summary["steps"] == len(rows) and summary["cached_share_later_mean"] > 0
            assert summary["cached_share_later_mean"] <= summary["ceiling_share_later_mean"] + 0.05
