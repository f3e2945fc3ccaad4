"""bench/agentic/replay.py: the AgentX-style replay client against a fake OpenAI-compatible streaming
server (lanes, think time, subagent spawn and join, headers and bodies, warm-up, statistics, admission
rejections), the sweep's topology overrides and table, and one real smoke run against `moorage up`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.agentic import replay as rp
from bench.agentic import stats, system
from bench.agentic import sweep as sw
from bench.agentic.prompt import prompt_text
from bench.agentic.synth import SynthParams, synthesize
from bench.agentic.trace import TraceRequest, TraceSession, TraceSubagent, ceiling
from tests.natsbus import nats_url
from shared.sockets import free_port

BS = 4  # trace block size of the hand-made sessions


# --- a fake router -------------------------------------------------------------------------------

@dataclass
class Fake:
    ttft_s: float = 0.01
    itl_s: float = 0.002
    status_for: dict = field(default_factory=dict)       # X-Correlation-ID + "#" + n-th request -> status
    stream_error_for: set = field(default_factory=set)
    log: list = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self, **kw) -> None:
        self.__init__(**kw)


def make_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    def sse(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        corr = request.headers.get("x-correlation-id", "")
        n = sum(1 for e in fake.log if e["corr"] == corr)
        entry = {"t_start": time.perf_counter(), "t_end": None, "session": request.headers.get("x-session-id"),
                 "corr": corr, "body": body}
        fake.log.append(entry)
        key = f"{corr}#{n}"
        if key in fake.status_for:
            entry["t_end"] = time.perf_counter()
            return JSONResponse({"error": {"message": "busy", "type": "x", "param": None, "code": "busy"}},
                                status_code=fake.status_for[key])
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)

        async def gen():
            try:
                base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": body["model"]}
                yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                await asyncio.sleep(fake.ttft_s)
                if key in fake.stream_error_for:
                    yield sse({"error": {"message": "deadline", "type": "server_error", "code": "timeout"}})
                    yield b"data: [DONE]\n\n"
                    return
                n_out = body["max_completion_tokens"]
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(fake.itl_s)
                    yield sse({**base, "choices": [{"index": 0, "delta": {"content": "x"},
                                                    "finish_reason": "length" if i == n_out - 1 else None}],
                               "usage": None})
                prompt = len(body["messages"][0]["content"])
                device, store = prompt // 2, prompt // 4
                usage = {"prompt_tokens": prompt, "completion_tokens": n_out, "total_tokens": prompt + n_out,
                         "moorage": {"device": device, "store": store, "computed": prompt - device - store}}
                yield sse({**base, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
            finally:
                fake.in_flight -= 1
                entry["t_end"] = time.perf_counter()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    fake = Fake()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(fake), host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def fake(fake_server):
    f, url = fake_server
    f.reset()
    return f, url


# --- hand-made sessions --------------------------------------------------------------------------

def req(t: float, n_in: int, out: int = 3, think: float = 0.0, first_id: int = 1) -> TraceRequest:
    ids = list(range(first_id, first_id + -(-n_in // BS)))
    return TraceRequest(t=t, type="s", model="tiny", in_tokens=n_in, out_tokens=out, hash_ids=ids, think_time=think)


def session(sid: str, items: list) -> TraceSession:
    return TraceSession(id=sid, models=["tiny"], block_size=BS, hash_id_scope="local", requests=items)


def chain(sid: str, turns: int, out: int = 3, think: float = 0.0) -> TraceSession:
    return session(sid, [req(float(i), 8 * (i + 1) + 2, out, think if i else 0.0) for i in range(turns)])


def cfg(url: str, **kw) -> rp.ReplayConfig:
    base = dict(base_url=url, concurrency=1, think_time_scale=0.0, warmup_turns=0, tag="", request_timeout_s=20)
    return rp.ReplayConfig(**{**base, **kw})


def run(sessions, c: rp.ReplayConfig) -> dict:
    return asyncio.run(rp.replay(sessions, c, progress=False))


# --- the client ----------------------------------------------------------------------------------

def test_requests_carry_history_headers_and_limits(fake):
    f, url = fake
    s = chain("s1", 3, out=5)
    stats = run([s], cfg(url))
    assert stats["requests"]["sent"] == 3 and stats["errors"]["total"] == 0
    assert len(f.log) == 3
    prev = ""
    for entry, r in zip(f.log, s.requests):
        b = entry["body"]
        assert b["model"] == "tiny" and b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["max_completion_tokens"] == r.out_tokens and b["ignore_eos"] is True and b["temperature"] == 0
        assert b["messages"] == [{"role": "user", "content": prompt_text(s, r)}]
        content = b["messages"][0]["content"]
        assert len(content) == r.in_tokens and content.startswith(prev)  # the history grows turn by turn
        prev = content
        assert entry["session"] == "s1" and entry["corr"] == "s1/main"
    rec = stats["records"]
    assert [x["completion_tokens"] for x in rec] == [5, 5, 5]
    assert all(x["ttft_s"] >= f.ttft_s * 0.8 and x["itl_s"] is not None for x in rec)


def test_run_tag_salts_prompts_and_session_ids(fake):
    f, url = fake
    s = chain("s1", 2)
    run([s], cfg(url, tag="t9"))
    assert [e["session"] for e in f.log] == ["s1~t9", "s1~t9"]
    assert [e["corr"] for e in f.log] == ["s1~t9/main"] * 2
    assert all(e["body"]["messages"][0]["content"].startswith("[t9]\n") for e in f.log)
    f.reset()
    run([s], cfg(url, tag=None))  # random per replay
    tag = f.log[0]["session"].split("~")[1]
    assert len(tag) == 8 and f.log[0]["body"]["messages"][0]["content"].startswith(f"[{tag}]\n")


def test_lanes_bound_concurrency_and_take_sessions_in_order(fake):
    f, url = fake
    f.ttft_s = 0.05
    sessions = [chain(f"s{i}", 2) for i in range(5)]
    stats = run(sessions, cfg(url, concurrency=2))
    assert stats["requests"]["sent"] == 10 and f.max_in_flight == 2
    firsts = {}
    for e in f.log:
        firsts.setdefault(e["session"], e["t_start"])
    order = sorted(firsts, key=firsts.get)
    # the two lanes start with the first two sessions (in either order: they race) and take the
    # rest from the queue; the last one is taken last
    assert set(order[:2]) == {"s0", "s1"} and order[-1] == "s4"
    f.reset(ttft_s=0.5)  # long enough that five lanes overlap even on a loaded machine
    run(sessions, cfg(url, concurrency=5))
    assert f.max_in_flight == 5


def test_think_time_is_scaled_then_capped(fake):
    c = cfg("http://x", think_time_scale=0.05, think_time_cap_s=2.0)
    assert rp.think_delay(10.0, c) == pytest.approx(0.5)
    assert rp.think_delay(100.0, c) == 2.0
    assert rp.think_delay(None, c) == 0.0
    f, url = fake
    s = session("s", [req(0.0, 10), req(5.0, 20, think=4.0), req(9.0, 30, think=100.0)])
    stats = run([s], cfg(url, think_time_scale=0.05, think_time_cap_s=0.3))
    gaps = [b["t_start"] - a["t_end"] for a, b in zip(f.log, f.log[1:])]
    assert 0.2 <= gaps[0] < 1.0           # 4 s x 0.05 (not 4 s)
    assert 0.3 <= gaps[1] < 1.5           # 100 s x 0.05 = 5 s, capped at 0.3
    assert [r["think_s"] for r in stats["records"]] == pytest.approx([0.0, 0.2, 0.3])


def test_subagents_run_concurrently_and_join_before_the_next_turn(fake):
    f, url = fake
    f.ttft_s = 0.08
    sub_a = TraceSubagent(t=1.0, agent_id="agent_a", subagent_type="Explore", status="completed",
                          duration_ms=2000, requests=[req(1.1, 6, first_id=100), req(1.6, 10, first_id=100)])
    sub_b = TraceSubagent(t=1.0, agent_id="agent_a", subagent_type="Explore", status="completed",  # same id
                          duration_ms=1000, requests=[req(1.1, 6, first_id=200)])
    # recorded: main request 1 is sent 0.25 s after the join at t=3.0, with 30 s of think time counted from
    # the end of request 0 (through the subagents): only the 0.25 s after the join is still to wait
    s = session("s", [req(0.0, 10), sub_a, sub_b, req(3.25, 30, think=30.0)])
    stats = run([s], cfg(url, think_time_scale=1.0, think_time_cap_s=5.0))
    assert stats["errors"]["total"] == 0
    by = {}
    for e in f.log:
        by.setdefault(e["corr"], []).append(e)
    assert sorted(by) == ["s/agent_a", "s/agent_a#2", "s/main"]
    main0, main1 = by["s/main"]
    subs = by["s/agent_a"] + by["s/agent_a#2"]
    assert all(e["t_start"] >= main0["t_end"] for e in subs)                # spawned after the turn
    assert by["s/agent_a#2"][0]["t_start"] < by["s/agent_a"][0]["t_end"]  # both run at once
    assert by["s/agent_a"][1]["t_start"] >= by["s/agent_a"][0]["t_end"]   # in order within a thread
    join = max(e["t_end"] for e in subs)
    assert 0.25 <= main1["t_start"] - join < 1.5  # not the 30 s (capped at 5) from before the subagents
    rec = {(r["thread"], r["index"]): r for r in stats["records"]}
    assert rec[("main", 1)]["think_s"] == pytest.approx(0.25)
    assert rec[("agent_a", 0)]["turn"] == 0 and rec[("main", 1)]["turn"] == 1


def test_warmup_turns_and_their_subagents_are_excluded(fake):
    f, url = fake
    sub = TraceSubagent(t=1.0, agent_id="a1", subagent_type="Explore", status="completed", duration_ms=100,
                        requests=[req(1.0, 6, first_id=50), req(1.05, 9, first_id=50)])
    s = session("s", [req(0.0, 10), sub, req(2.0, 20), req(3.0, 30)])
    stats = run([s], cfg(url, warmup_turns=1))
    assert stats["requests"] == {"total_in_traces": 5, "sent": 5, "measured": 2, "measured_ok": 2, "warmup": 3,
                                 "not_sent": 0}
    assert stats["ttft_s"]["n"] == 2
    assert [(r["thread"], r["warmup"]) for r in sorted(stats["records"], key=lambda r: (r["thread"], r["index"]))] \
        == [("a1", True), ("a1", True), ("main", True), ("main", False), ("main", False)]
    prompts = {(r["thread"], r["index"]): r["prompt_tokens"] for r in stats["records"]}
    assert stats["tokens"]["prompt"] == prompts[("main", 1)] + prompts[("main", 2)] == 50
    assert stats["warmup"]["tokens"]["prompt"] == 10 + 6 + 9
    assert stats["ceiling"]["measured"]["prompt_tokens"] == 50
    stats = run([s], cfg(url, warmup_turns=0))
    assert stats["requests"]["measured"] == 5 and stats["requests"]["warmup"] == 0


def test_rejections_and_errors_are_counted_and_the_session_goes_on(fake):
    f, url = fake
    f.status_for = {"s/main#1": 429, "s/main#2": 503, "s/main#3": 500}
    f.stream_error_for = {"s/main#4"}
    s = chain("s", 6)
    stats = run([s], cfg(url))
    assert stats["requests"]["sent"] == 6 and stats["requests"]["measured_ok"] == 2
    assert stats["rejections"] == 2
    assert stats["errors"] == {"total": 4, "by_status": {"429": 1, "503": 1, "500": 1, "stream_error:timeout": 1}}
    assert stats["tokens"]["prompt"] == s.requests[0].in_tokens + s.requests[5].in_tokens


def test_connection_refused_is_an_error_not_a_crash():
    stats = run([chain("s", 2)], cfg(f"http://127.0.0.1:{free_port()}", request_timeout_s=5))
    assert stats["requests"]["sent"] == 2 and stats["errors"]["total"] == 2
    assert all(str(k).startswith("error:") for k in stats["errors"]["by_status"])


def test_duration_stops_starting_new_turns(fake):
    f, url = fake
    f.ttft_s = 0.1
    t0 = time.perf_counter()
    stats = run([chain(f"s{i}", 5) for i in range(3)], cfg(url, duration_s=0.25))
    assert 0 < stats["requests"]["sent"] < 15 and stats["requests"]["not_sent"] == 15 - stats["requests"]["sent"]
    assert all(e["t_start"] - t0 < 0.75 for e in f.log)
    assert stats["sessions"]["started"] < 3


def test_stats_math():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert stats.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert stats.percentile([], 50) is None

    def rec(i, warm=False, status=200):
        r = rp.RequestRecord(session="s", thread="main", index=i, turn=i, warmup=warm, t_start=float(i),
                             t_end=float(i) + 0.5, status=status, ttft_s=0.1 * (i + 1), gaps_s=[0.01, 0.03],
                             prompt_tokens=100, completion_tokens=10, device=60, store=30, computed=10)
        return r
    records = [rec(0, warm=True), rec(1), rec(2), rec(3), rec(4, status=429)]
    st = stats.summarize(records, wall_s=9.0, total_requests=6)
    assert st["requests"] == {"total_in_traces": 6, "sent": 5, "measured": 4, "measured_ok": 3, "warmup": 1,
                              "not_sent": 1}
    assert st["ttft_s"]["p50"] == pytest.approx(0.3) and st["ttft_s"]["n"] == 3
    assert st["itl_s"]["p50"] == pytest.approx(0.02) and st["itl_s"]["n"] == 6
    assert st["window_s"] == pytest.approx(3.5)  # first measured send (1.0) to last measured finish (4.5)
    assert st["throughput"]["tokens_per_s"] == pytest.approx(3 * 110 / 3.5)
    assert st["throughput"]["requests_per_s"] == pytest.approx(3 / 3.5)
    assert st["tokens"]["shares"] == pytest.approx({"device": 0.6, "pool": 0.3, "computed": 0.1, "reused": 0.9})
    assert st["rejections"] == 1 and st["errors"] == {"total": 1, "by_status": {"429": 1}}
    assert st["warmup"]["tokens"]["prompt"] == 100


def test_measured_ceiling_splits_trace_ceiling():
    sessions = synthesize(SynthParams(sessions=3, scale=0.01, turns=6, fanout_prob=0.3, seed=3))
    from bench.agentic.trace import iter_requests

    per = [(s, [(r, i < 2) for i, (_, r) in enumerate(iter_requests(s))]) for s in sessions]
    per_request: dict = {}
    split = stats.split_ceiling(per, per_request)
    assert split["sent"] == ceiling(sessions)
    assert sum(per_request.values()) == split["sent"]["reusable_tokens"] and len(per_request) == sum(
        len(items) for _, items in per)
    assert split["measured"]["prompt_tokens"] + split["warmup"]["prompt_tokens"] == ceiling(sessions)["prompt_tokens"]
    assert split["measured"]["ratio"] > ceiling(sessions)["ratio"]  # the cold first turns are warm-up


def test_topology_overrides_are_valid_up_configs():
    from shared.config import load_config
    from infra.up import UpConfig

    sets, _ = system.topology_overrides("none", groups=2, device_blocks=100, store_bytes=1 << 20, decode_blocks=300)
    assert "up.pool=false" in sets and not any(s.startswith("up.pool_mode") for s in sets)
    assert "prefill.engine.num_blocks=100" in sets and "decode.engine.num_blocks=300" in sets
    for topo, mode, routing in (("split", "split", "cache-aware"), ("shared-p2c", "shared", "p2c"),
                                ("shared-sticky", "shared", "sticky")):
        sets, _ = system.topology_overrides(topo, groups=2, store_bytes=1 << 20, stores=1)
        c = load_config(UpConfig, overrides=sets)
        assert (c.up.pool, c.up.pool_mode, c.up.groups, c.up.stores) == (True, mode, 2, 1)
        assert c.router.router.routing == routing and c.up.model == "tiny"
    with pytest.raises(ValueError):
        system.topology_overrides("shared-random")


def test_sweep_table_ratios():
    def stats(tps, ttft, computed):
        return {"requests": {"measured_ok": 4, "sent": 5}, "errors": {"total": 0}, "rejections": 0,
                "tokens": {"prompt": 100, "computed": computed,
                           "shares": {"device": 0.5, "pool": 0.5 - computed / 100, "computed": computed / 100,
                                      "reused": 1 - computed / 100}},
                "ceiling": {"measured": {"ratio": 0.95}}, "ttft_s": {"p50": ttft, "p99": ttft * 2},
                "itl_s": {"p50": 0.01}, "throughput": {"tokens_per_s": tps, "requests_per_s": 1.0}}
    runs = [{"topology": "none", "concurrency": 2, "stats": stats(500.0, 0.4, 40)},
            {"topology": "shared", "concurrency": 2, "stats": stats(1000.0, 0.2, 10)},
            {"topology": "split", "concurrency": 2, "error": "boom"}]
    md = sw.table(runs)
    none_row = md.splitlines()[2].split(" | ")
    assert none_row[-3:] == ["0.50", "2.00", "4.00 |"]
    assert "failed: boom" in md


def test_cli_against_a_running_server_writes_json_and_png(fake, tmp_path):
    f, url = fake
    out = tmp_path / "r.json"
    code = rp.main(["--url", url, "--quick", "--concurrency", "2", "--think-scale", "0", "--no-progress",
                    "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    st = result["stats"]
    assert result["corpus"]["sessions"] == 3 and st["requests"]["sent"] == result["corpus"]["requests"]
    assert st["ceiling"]["measured"]["ratio"] > 0 and (tmp_path / "r.png").stat().st_size > 10_000



def test_real_think_times_uncapped(fake):
    c = cfg("http://x", think_time_scale=1.0, think_time_cap_s=None)
    assert rp.think_delay(1000.0, c) == 1000.0 and rp.think_delay(None, c) == 0.0
    import argparse

    def parsed(*argv):
        p = argparse.ArgumentParser()
        rp.add_replay_args(p)
        args = p.parse_args(list(argv))
        rp.resolve_think(args, list(argv))
        return args.think_scale, args.think_cap

    assert parsed() == (rp.ReplayConfig.think_time_scale, rp.ReplayConfig.think_time_cap_s)  # defaults unchanged
    assert parsed("--real-think") == (1.0, None)
    assert parsed("--real-think", "--think-cap", "30") == (1.0, 30.0)
    assert parsed("--real-think", "--think-scale=0.5") == (0.5, None)
    assert parsed("--think-cap", "none") == (rp.ReplayConfig.think_time_scale, None)
    # recorded waits are honoured as recorded, beyond the old 2 s cap
    f, url = fake
    s = session("s", [req(0.0, 10), req(3.0, 20, think=2.5)])
    stats = run([s], cfg(url, think_time_scale=1.0, think_time_cap_s=None))
    assert [r["think_s"] for r in stats["records"]] == pytest.approx([0.0, 2.5])
    assert stats["config"]["think_time_cap_s"] is None


def test_model_flag_is_sent_and_served():
    import argparse

    from shared.config import load_config
    from infra.up import UpConfig

    sets, _ = system.topology_overrides("shared", store_bytes=1 << 20, model="smollm2-135m")
    assert load_config(UpConfig, overrides=sets).up.model == "smollm2-135m"
    sessions = [chain("s1", 3)]
    p = argparse.ArgumentParser()
    rp.add_replay_args(p)
    system.add_system_args(p)
    args = p.parse_args(["--model", "smollm2-135m"])
    sets, _ = system.system_overrides(args, "none", sessions, 2)
    assert "up.model=smollm2-135m" in sets and rp.replay_config(args, 2, 0).model == "smollm2-135m"
    sets, _ = system.system_overrides(p.parse_args([]), "none", sessions, 2)
    assert "up.model=tiny" in sets  # the default stays the tiny model


def test_default_output_goes_to_a_gitignored_run_dir(fake, tmp_path, monkeypatch):
    assert rp.default_out("sweep", "agentic.json").startswith("runs/sweep-")
    f, url = fake
    monkeypatch.chdir(tmp_path)
    assert rp.main(["--url", url, "--quick", "--concurrency", "2", "--think-scale", "0", "--no-progress"]) == 0
    [out] = list((tmp_path / "runs").glob("agentic-*/agentic-replay.json"))
    assert json.loads(out.read_text())["kind"] == "moorage-bench-agentic" and out.with_suffix(".png").exists()


# --- the real system -----------------------------------------------------------------------------

def test_smoke_replay_against_moorage_up(tmp_path):
    """Two tiny synthetic sessions at concurrency 2 against the real system (tiny model, a shared pool):
    every request succeeds and every prompt token is accounted for as device, pool or computed."""
    sessions = synthesize(SynthParams(sessions=2, scale=0.005, turns=3, turns_sigma=0.0, min_turns=3,
                                      fanout_prob=0.0))
    sets, _ = system.topology_overrides("shared", groups=1, device_blocks=96, store_bytes=32 << 20,
                                    decode_blocks=256, stores=1)
    with nats_url() as nats:
        with system.running_system(sets + [f"up.nats_url={nats}"], tmp_path, ready_timeout_s=90) as url:
            stats = run(sessions, rp.ReplayConfig(base_url=url, concurrency=2, think_time_scale=0.01,
                                                  request_timeout_s=30, duration_s=30))
    assert stats["requests"]["sent"] == stats["requests"]["total_in_traces"] == 6
    assert stats["errors"]["total"] == 0 and stats["requests"]["measured_ok"] == 4
    for r in stats["records"]:
        assert r["prompt_tokens"] > r["trace_in_tokens"]  # the chat template and the run tag on top
        assert r["device"] + r["store"] + r["computed"] == r["prompt_tokens"]
        assert r["completion_tokens"] == r["trace_out_tokens"]  # ignore_eos: exactly the recorded output
    sh = stats["tokens"]["shares"]
    assert sh["device"] + sh["pool"] + sh["computed"] == pytest.approx(1.0)
    assert sh["reused"] > 0.5  # later turns extend earlier ones
    assert 0 < stats["ceiling"]["measured"]["ratio"] <= 1
    assert stats["ttft_s"]["p50"] is not None and stats["throughput"]["tokens_per_s"] > 0


def test_tool_turns_send_the_tool_list_on_every_turn_so_the_prefix_holds(fake):
    """An agent sends its tools on every turn, and the tools render into the prompt's start: a replay that
    sent them on tool turns only changed every later turn's prefix (30 of 196 returning turns of a tiers run
    missed in every mode, the disk tier included). Checked with the router's own parser and SmolLM2's
    template: each rendered prompt starts with the one before it, less its generation prompt."""
    from services.router.api_openai import ChatCompletions
    from services.router.conversation import render_prompt
    from services.router.tool_calls import format_for
    from shared.engine.models import load_tokenizer

    f, url = fake
    s = session("s", [req(0.0, 10), TraceRequest(t=1.0, type="s", model="tiny", in_tokens=20, out_tokens=3,
                                                 hash_ids=[1, 2, 3, 4, 5], stop="tool_use"), req(2.0, 30)])
    run([s], cfg(url, tool_turns=True))
    bodies = [e["body"] for e in f.log]
    assert [b["tools"] for b in bodies] == [[rp.TOOL]] * 3
    assert [b["tool_choice"] for b in bodies] == ["none", "required", "none"]
    tok = load_tokenizer("smollm2-135m")[0]
    fmt = format_for(tok.chat_template)
    prompts = [render_prompt(tok, ChatCompletions().parse(json.dumps(b).encode()).conversation, fmt)
               for b in bodies]
    assert all('"name": "run"' in p for p in prompts)
    for before, after in zip(prompts, prompts[1:]):
        head = before[:before.rindex("<|im_end|>")]  # the user turn's text grows; the rest is the same
        assert after.startswith(head)
    f.reset()
    run([s], cfg(url))  # without tool_turns: no tools at all
    assert all("tools" not in e["body"] for e in f.log)
