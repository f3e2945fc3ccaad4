"""The AgentX / weka trace format (bench/agentic/trace.py), the synthetic corpus (synth.py) and prompt
synthesis from hash ids (prompt.py). Pure Python and small: no model, no services."""

from __future__ import annotations

import copy
import json
import statistics

import pytest

from bench.agentic.prompt import block_text, prompt_text
from bench.agentic.synth import SynthParams, main as trace_main, synthesize
from bench.agentic.trace import (
    TraceError,
    TraceRequest,
    TraceSession,
    TraceSubagent,
    ceiling,
    iter_requests,
    load_traces,
    parse_session,
    session_to_json,
    write_traces,
)

BS = 64


def req(t, ids, n_in=None, out=5, **kw):
    d = {"t": t, "type": "s", "model": "m", "in": len(ids) * BS if n_in is None else n_in, "out": out,
         "hash_ids": list(ids), "input_types": ["text"], "output_types": ["text"], "stop": "tool_use",
         "api_time": 1.0, "think_time": 0.5}
    d.update(kw)
    return d


def sub(t, agent_id, requests, **kw):
    d = {"t": t, "type": "subagent", "agent_id": agent_id, "subagent_type": "Explore", "status": "completed",
         "duration_ms": 1500, "requests": requests}
    d.update(kw)
    return d


def session(sid, requests, scope="local"):
    return {"id": sid, "models": ["m"], "block_size": BS, "hash_id_scope": scope, "requests": requests}


def nested_session():
    return session("nest", [
        req(0, [1, 2]),
        sub(2, "a1", [req(2.1, [10, 11]), sub(2.5, "a2", [req(2.6, [20])]), req(3.0, [10, 11, 12])]),
        req(5, [1, 2, 3], n_in=3 * BS - 10, type="n", ttft=0.25),
    ])


SMALL = dict(sessions=3, scale=0.02, turns=20)  # a few hundred short requests: fast on two cores


# ---------------------------------------------------------------- format


def test_round_trip_dir_jsonl_and_list(tmp_path):
    sessions = [parse_session(nested_session(), "mem"), parse_session(session("b", [req(0, [7])]), "mem")]
    for target in (tmp_path / "dir", tmp_path / "all.jsonl", tmp_path / "all.json"):
        write_traces(sessions, target)
        assert load_traces(target) == sessions
    # the written JSON is the public shape again, field for field
    assert session_to_json(sessions[0]) == nested_session()


def test_public_optional_fields_default():
    obj = session("opt", [{"t": 0.0, "type": "n", "model": "m", "in": 65, "out": 1, "hash_ids": [4, 5],
                           "api_time": None}])
    obj.update(tool_tokens=11899, system_tokens=2926)
    s = parse_session(obj)
    r = s.requests[0]
    assert (r.input_types, r.output_types, r.stop, r.api_time, r.think_time, r.ttft) == ([], [], "", 0.0, 0.0, None)
    assert s.system_tokens == 2926 and parse_session(session_to_json(s)) == s


def _mutate(fn):
    obj = nested_session()
    fn(obj)
    return obj


@pytest.mark.parametrize("mutate, path, words", [
    (lambda o: o["requests"][1]["requests"][2].update(hash_ids=[10, 11]), "requests[1].requests[2].hash_ids",
     "ceil"),
    (lambda o: o["requests"][1]["requests"][1]["requests"][0].update(out=-3),
     "requests[1].requests[1].requests[0].out", "non-negative"),
    (lambda o: o["requests"][0].update(type="x"), "requests[0].type", "unknown request type"),
    (lambda o: o["requests"][0].pop("model"), "requests[0].model", "missing"),
    (lambda o: o["requests"][0].update(extra=1), "requests[0].extra", "unknown field"),
    (lambda o: o["requests"][0].update(t="0"), "requests[0].t", "number"),
    (lambda o: o["requests"][0].update(t=float("nan")), "requests[0].t", "finite"),
    (lambda o: o["requests"][0].update(**{"in": 1.5}), "requests[0].in", "integer"),
    (lambda o: o["requests"][0].update(**{"in": True}), "requests[0].in", "integer"),
    (lambda o: o["requests"][0]["hash_ids"].__setitem__(1, "b"), "requests[0].hash_ids[1]", "integer"),
    (lambda o: o["requests"][0].update(input_types="text"), "requests[0].input_types", "list"),
    (lambda o: o["requests"][1].pop("agent_id"), "requests[1].agent_id", "missing"),
    (lambda o: o["requests"][1].update(requests={}), "requests[1].requests", "list"),
    (lambda o: o.update(block_size=0), "block_size", "positive"),
    (lambda o: o.update(hash_id_scope="tenant"), "hash_id_scope", "scope"),
    (lambda o: o.update(requests=[]), "requests", "at least one"),
    (lambda o: o.pop("models"), "models", "missing"),
])
def test_strict_validation_names_file_session_and_path(tmp_path, mutate, path, words):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(_mutate(mutate)))
    with pytest.raises(TraceError) as e:
        load_traces(p)
    msg = str(e.value)
    assert str(p) in msg and "'nest'" in msg and f": {path}: " in msg and words in msg, msg
    assert e.value.path == path and e.value.session_id == "nest"


def test_bad_files_reported(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(session("ok", [req(0, [1])])) + "\n{nope\n")
    with pytest.raises(TraceError, match=r"a\.jsonl:2: invalid JSON"):
        load_traces(tmp_path)
    (tmp_path / "a.jsonl").write_text(json.dumps([1]))
    with pytest.raises(TraceError, match=r"a\.jsonl:1: a session must be a JSON object"):
        load_traces(tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").write_text(json.dumps(session("dup", [req(0, [1])])))
    (tmp_path / "b.json").write_text(json.dumps([session("dup", [req(0, [1])])]))
    with pytest.raises(TraceError, match=r"b\.json\[0\]: session 'dup': duplicate session id"):
        load_traces(tmp_path)
    with pytest.raises(TraceError, match="no such file"):
        load_traces(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no sessions"):
        load_traces(tmp_path / "empty")


def test_load_sorted_by_file_name(tmp_path):
    for name in ("c", "a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(session(name, [req(0, [1])])))
    (tmp_path / "notes.txt").write_text("ignored")
    assert [s.id for s in load_traces(tmp_path)] == ["a", "b", "c"]


def test_iter_requests_order_and_threads():
    s = parse_session(nested_session())
    got = [(th, r.t) for th, r in iter_requests(s)]
    assert got == [("main", 0), ("a1", 2.1), ("a2", 2.6), ("a1", 3.0), ("main", 5)]
    dup = parse_session(session("d", [sub(0, "x", [req(0, [1])]), sub(1, "x", [req(1, [2])]),
                                      sub(2, "main", [req(2, [3])])]))
    assert [th for th, _ in iter_requests(dup)] == ["x", "x#2", "main#2"]


# ---------------------------------------------------------------- ceiling


def test_ceiling_hand_made():
    s = parse_session(session("c", [
        req(0, [1, 2, 3], n_in=3 * BS - 20),  # cold: 172 tokens
        req(1, [1, 2, 4, 5]),  # prefix [1, 2] known: 128 of 256
        req(2, [1, 2, 4, 5, 6], n_in=5 * BS - 1),  # 4 blocks known: 256 of 319
        req(3, [9, 2]),  # first block differs: nothing, even though block 2 was seen
        req(4, [1, 2, 3], n_in=2 * BS + 5),  # all 3 ids known: the partial last block too, capped at 133
    ]))
    c = ceiling([s])
    assert c["prompt_tokens"] == 172 + 256 + 319 + 128 + 133
    assert c["reusable_tokens"] == 0 + 128 + 256 + 0 + 133
    assert c["ratio"] == pytest.approx(c["reusable_tokens"] / c["prompt_tokens"])


def test_ceiling_time_order_and_subagents():
    # a subagent extends the main thread's prefix; the main request at t=5 sees it, the one at t=1 does not
    s = parse_session(session("o", [req(0, [1]), req(5, [1, 2, 3]), sub(1, "a", [req(1, [1, 2])])]))
    c = ceiling([s])
    assert c["reusable_tokens"] == 0 + 2 * BS + 1 * BS


def test_ceiling_scope():
    a = [req(0, [1, 2]), req(1, [1, 2, 3])]
    b = [req(0.5, [1, 2, 3])]
    local = [parse_session(session("A", a)), parse_session(session("B", b))]
    glob = [parse_session(session("A", a, "global")), parse_session(session("B", b, "global"))]
    assert ceiling(local)["reusable_tokens"] == 2 * BS  # B's ids are its own
    # global: B at t=0.5 reuses A's [1, 2]; A at t=1 then reuses all of B's [1, 2, 3]
    assert ceiling(glob)["reusable_tokens"] == 2 * BS + 3 * BS
    assert ceiling([])["ratio"] == 0.0


# ---------------------------------------------------------------- synth


def test_synth_deterministic_and_seeded():
    a = [session_to_json(s) for s in synthesize(SynthParams(**SMALL, seed=7))]
    b = [session_to_json(s) for s in synthesize(SynthParams(**SMALL, seed=7))]
    c = [session_to_json(s) for s in synthesize(SynthParams(**SMALL, seed=8))]
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(c)
    # session i does not depend on how many sessions were asked for
    one = [session_to_json(s) for s in synthesize(SynthParams(**(SMALL | {"sessions": 1}), seed=7))]
    assert one[0] == a[0]


def test_synth_sessions_validate_and_round_trip(tmp_path):
    sessions = synthesize(SynthParams(**SMALL, fanout_prob=0.2))
    write_traces(sessions, tmp_path)
    assert load_traces(tmp_path) == sessions  # every synthesized session passes strict validation
    for s in sessions:
        assert s.hash_id_scope == "local" and s.block_size == BS
        for _, r in iter_requests(s):
            assert len(r.hash_ids) == -(-r.in_tokens // BS)


def _main_requests(s):
    return [r for th, r in iter_requests(s) if th == "main"]


def _common_blocks(a, b):
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def test_synth_shape_grows_with_small_new_suffix():
    p = SynthParams(sessions=4, scale=0.05, turns=30, pause_prob=0.0, fanout_prob=0.0, user_turn_prob=0.0)
    new = []
    for s in synthesize(p):
        mains = _main_requests(s)
        assert len(mains) >= p.min_turns
        for prev, cur in zip(mains, mains[1:]):
            assert cur.in_tokens > prev.in_tokens  # the context grows every turn
            k = _common_blocks(prev.hash_ids, cur.hash_ids)
            assert k >= prev.in_tokens // BS  # all full blocks of the previous turn are still a prefix
            new.append(cur.in_tokens - k * BS)
            assert cur.t >= prev.t + prev.api_time - 1e-3
    # median new tokens per turn is about new_tokens * scale (plus the refilled partial block)
    assert 0.6 * 1700 * 0.05 <= statistics.median(new) <= 1.6 * 1700 * 0.05 + BS
    assert ceiling(synthesize(p))["ratio"] > 0.9


def test_synth_pauses_cut_history():
    p = SynthParams(sessions=2, scale=0.05, turns=20, pause_prob=0.3, user_turn_prob=0.0, fanout_prob=0.0,
                    pause_keep_min=0.2, pause_keep_max=0.4)
    cuts = 0
    for s in synthesize(p):
        mains = _main_requests(s)
        for prev, cur in zip(mains, mains[1:]):
            k = _common_blocks(prev.hash_ids, cur.hash_ids)
            full = prev.in_tokens // BS
            if prev.stop == "end_turn":  # only a pause (no user turns here) ends a turn mid-session
                cuts += 1
                assert cur.think_time >= 1.0
                assert int(0.2 * full) <= k <= max(0.4 * full, p.tokens(p.system_tokens) // BS)  # a prefix
            else:
                assert k >= prev.in_tokens // BS
    assert cuts > 0
    assert ceiling(synthesize(p))["ratio"] < ceiling(synthesize(
        SynthParams(**(p.to_json() | {"pause_prob": 0.0}))))["ratio"] < 1.0


def test_synth_fanout_subagents_build_own_contexts_and_join():
    p = SynthParams(sessions=2, scale=0.05, turns=15, fanout_prob=0.5, fanout_min=2, fanout_max=3,
                    subagent_turns=4, pause_prob=0.0)
    seen = 0
    for s in synthesize(p):
        items = s.requests
        ids = [h for _, r in iter_requests(s) for h in r.hash_ids]
        agents = [x for x in items if isinstance(x, TraceSubagent)]
        assert len({a.agent_id for a in agents}) == len(agents)
        for i, x in enumerate(items):
            if not isinstance(x, TraceSubagent):
                continue
            seen += 1
            first = x.requests[0]
            assert first.t >= x.t and all(isinstance(r, TraceRequest) for r in x.requests)
            main_ids = set(items[0].hash_ids)
            assert not main_ids & set(first.hash_ids)  # its own context, not the main thread's
            end = x.t + x.duration_ms / 1000
            nxt = next((y for y in items[i + 1:] if isinstance(y, TraceRequest)), None)
            if nxt is not None:
                assert nxt.t >= end - 1e-3  # the main thread waits for the join
        assert min(ids) >= 1
    assert seen > 0


def test_synth_compacts_at_max_context():
    p = SynthParams(sessions=2, scale=0.05, turns=40, max_context=3000)
    for s in synthesize(p):
        assert max(r.in_tokens + r.out_tokens for _, r in iter_requests(s)) <= 3000
    with pytest.raises(ValueError, match="max_context"):
        synthesize(SynthParams(sessions=1, scale=0.05, max_context=1000))


def test_synth_params_are_checked():
    with pytest.raises(ValueError, match="scale"):
        synthesize(SynthParams(scale=0))
    with pytest.raises(ValueError, match="pause_keep_min"):
        synthesize(SynthParams(pause_keep_min=0.9, pause_keep_max=0.1))


def test_cli_synth_and_validate(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert trace_main(["synth", "--out", str(out), "--sessions", "2", "--seed", "3", "--scale", "0.02",
                       "--turns", "10", "--no-shared-prefix"]) == 0
    assert len(list(out.glob("*.json"))) == 2 and (out / "synth_params.txt").exists()
    assert json.loads((out / "synth_params.txt").read_text())["seed"] == 3
    capsys.readouterr()
    assert trace_main(["validate", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sessions"] == 2 and 0 < summary["ceiling"] < 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(session("z", [req(0, [1, 2], n_in=10)])))
    assert trace_main(["validate", str(bad)]) == 1
    assert "requests[0].hash_ids" in capsys.readouterr().err
    assert trace_main(["synth", "--out", str(out), "--scale", "-1"]) == 2


def test_shared_prefix_global_scope():
    p = SynthParams(**SMALL, shared_prefix=True)
    sessions = synthesize(p)
    assert all(s.hash_id_scope == "global" for s in sessions)
    heads = {tuple(_main_requests(s)[0].hash_ids[: p.tokens(p.system_tokens) // BS]) for s in sessions}
    assert len(heads) == 1  # every session starts with the same system prefix ...
    rest = [set(h for _, r in iter_requests(s) for h in r.hash_ids if h >= 1 << 32) for s in sessions]
    assert not rest[0] & rest[1]  # ... and otherwise has ids of its own


# ---------------------------------------------------------------- prompt


def test_prompt_text_exact_and_shared_by_ids():
    s = parse_session(session("p", [req(0, [1, 2, 3], n_in=2 * BS + 7), req(1, [1, 2, 4, 5])]))
    a, b = [r for _, r in iter_requests(s)]
    ta, tb = prompt_text(s, a), prompt_text(s, b)
    assert len(ta) == a.in_tokens and len(tb) == b.in_tokens
    assert ta[: 2 * BS] == tb[: 2 * BS] and ta[2 * BS:] != tb[2 * BS: 2 * BS + 7]
    assert ta.isascii() and ta.isprintable() and "<|" not in ta + tb and not any(c.isspace() for c in ta)
    # a partial block is a prefix of the full block with the same id
    assert ta[2 * BS:] == block_text("p", 3, "local")[:7]
    # scope: local ids are per session, global ids are corpus-wide
    assert block_text("p", 1, "local") != block_text("q", 1, "local")
    assert block_text("p", 1, "global") == block_text("q", 1, "global")
    assert len(block_text("p", 1, "local", 200)) == 200 and block_text("p", 1, "local", 0) == ""
    empty = TraceRequest(0, "s", "m", 0, 1, [])
    assert prompt_text(s, empty) == ""


def test_prompt_text_of_synthetic_corpus():
    s = synthesize(SynthParams(**(SMALL | {"sessions": 1})))[0]
    reqs = [r for _, r in iter_requests(s)][:5]
    texts = [prompt_text(s, r) for r in reqs]
    assert [len(t) for t in texts] == [r.in_tokens for r in reqs]
    k = _common_blocks(reqs[0].hash_ids, reqs[1].hash_ids)
    assert texts[0][: k * BS] == texts[1][: k * BS]
