"""The whole system as a user runs it: real nats-server, gate, prefill, decode and router processes on
loopback, driven with the official `openai` client. Greedy output must equal the in-process engine's
(what `moorage generate` prints), token for token, including when the prompt prefix came from cache."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.messages import LoadReport
from shared.tracing import read_spans
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url
from shared.sockets import free_port

QUESTION = "List three things a code reviewer checks in a pull request, and why each matters."


@pytest.fixture(scope="module")
def system(tmp_path_factory, tiny):
    run_dir = tmp_path_factory.mktemp("up")
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "decode.engine.num_blocks=96",          # 1536 tokens: the gate's budget is 1382
            "gate.gate.admission_wait_s=1", "up.ready_timeout_s=120",
        ])  # the default handoff: prefill writes straight into decode's pages
        with launched(cfg) as (launcher, base):
            yield launcher, base, url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(loaded, prompt_ids, max_tokens):
    engine = Engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    [seq] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return seq


async def load_reports(nats: str, roles=("gate", "prefill", "decode")) -> dict[str, LoadReport]:
    """The latest report of each role (this system runs one instance per role)."""
    seen = await latest_reports(nats, enough=lambda seen: set(roles) <= {r.role for r in seen.values()})
    return {r.role: r for r in seen.values()}


def test_chat_and_completions_equal_engine_output(system, tiny):
    _, base, _ = system
    c = client(base)
    messages = [{"role": "user", "content": QUESTION}]
    ref = reference(tiny, tiny.tokenizer.chat_token_ids(messages), 24)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.output_text
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(ref.prompt_ids)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True, temperature=0,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.output_text
    assert chunks[-1].usage.completion_tokens == 24

    ref2 = reference(tiny, tiny.tokenizer.encode("def fibonacci(n):"), 16)
    r = c.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref2.output_text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="def fibonacci(n):", max_tokens=16, stream=True, temperature=0, extra_body={"ignore_eos": True}))
    assert streamed == ref2.output_text


def test_logprobs_through_the_system_equal_the_engine_s(system, tiny):
    """Chat `logprobs` + `top_logprobs`, the Responses API's and completions' `logprobs`: the first token's numbers
    come from prefill, the rest from decode, and the second time the prompt comes from the cache; every token's
    log-probability and alternatives equal the in-process engine's from scratch (within float noise), streamed
    and whole alike."""
    _, base, _ = system
    c, tok = client(base), tiny.tokenizer
    messages = [{"role": "user", "content": QUESTION + " Answer with log-probabilities."}]
    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))

    def ref_of(ids):
        [ref] = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
        return [(tok.token_bytes(t), lp.logprob, [tok.token_bytes(a) for a, _ in lp.top])
                for t, lp in zip(ref.output_ids, ref.output_logprobs)]

    def same(got, want):
        assert [(b, alts) for b, _, alts in got] == [(b, alts) for b, _, alts in want]
        assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in want], abs=1e-4)

    want = ref_of(tok.chat_token_ids(messages))
    for turn in range(2):
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body={"ignore_eos": True})
        same([(bytes(e.bytes), e.logprob, [bytes(a.bytes) for a in e.top_logprobs])
              for e in r.choices[0].logprobs.content], want)
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the second time: the prompt from the cache
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    same([(bytes(e.bytes), e.logprob, [bytes(a.bytes) for a in e.top_logprobs])
          for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content], want)
    r = c.responses.create(model="tiny", input=messages[0]["content"], max_output_tokens=12, temperature=0,
                           top_logprobs=3, include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    same([(bytes(e.bytes), e.logprob, [bytes(a.bytes) for a in e.top_logprobs])
          for e in r.output[0].content[0].logprobs], want)

    want = ref_of(tok.encode("def fibonacci(n):"))
    r = c.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    def text(b: bytes) -> str:  # OpenAI's way with a token that is part of a character: its bytes, spelled out
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    assert lp.tokens == [text(b) for b, _, _ in want]
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in want], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[text(a) for a in alts] for _, _, alts in want]


def test_second_turn_reuses_cached_prefix_and_matches_scratch(system, tiny):
    _, base, _ = system
    c = client(base)
    history = [{"role": "user", "content": QUESTION + " (session two)"}]
    first = c.chat.completions.create(model="tiny", messages=history, max_tokens=20, temperature=0,
                                      extra_headers={"X-Session-ID": "s-e2e"}, extra_body={"ignore_eos": True})
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now the fourth thing."}]
    second = c.chat.completions.create(model="tiny", messages=history, max_tokens=20, temperature=0,
                                       extra_headers={"X-Session-ID": "s-e2e"}, extra_body={"ignore_eos": True})
    u = second.usage.model_dump()
    assert u["prompt_tokens_details"]["cached_tokens"] > 0
    assert u["moorage"]["device"] + u["moorage"]["store"] + u["moorage"]["computed"] == u["prompt_tokens"]
    ref = reference(tiny, tiny.tokenizer.chat_token_ids(history), 20)
    assert second.choices[0].message.content == ref.output_text


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "messages": "nope"}, 400, "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "nope"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "context length"),
])
def test_bad_input_gets_openai_error(system, body, status, needle):
    _, base, _ = system
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]


def test_malformed_json_is_400(system):
    _, base, _ = system
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_burst_beyond_budget_queues_then_rejects(system, tiny):
    """Each request reserves 1240 tokens of a 1382-token budget: one runs at a time, the rest queue;
    those still queued after the gate's 1 s wait get 429 with Retry-After."""
    _, base, _ = system
    prompts = ["burst " * (40 + i) for i in range(6)]  # distinct lengths identify the answers

    async def one(i: int):
        async with httpx.AsyncClient(timeout=120) as h:
            return await h.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": prompts[i], "max_tokens": 1000, "ignore_eos": True, "temperature": 0})

    async def burst():
        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(burst())
    ok = [r for r in results if r.status_code == 200]
    rejected = [r for r in results if r.status_code == 429]
    assert ok and rejected and len(ok) + len(rejected) == 6
    assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
    by_length = {len(tiny.tokenizer.encode(p)): p for p in prompts}
    for r in ok:
        prompt = by_length[r.json()["usage"]["prompt_tokens"]]
        assert r.json()["choices"][0]["text"] == reference(tiny, tiny.tokenizer.encode(prompt), 1000).output_text


@pytest.mark.parametrize("sampling", [{"temperature": 0.5, "top_p": 1e-300}, {"temperature": 1e-300}])
def test_degenerate_sampling_is_served_and_the_engines_stay_up(system, tiny, sampling):
    """Issue 10: these once raised in the sampler, killed prefill's engine loop and left /health 200."""
    _, base, nats = system
    prompt = tiny.tokenizer.encode("x")
    r = httpx.post(base + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True, **sampling})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference(tiny, prompt, 4).output_text  # both mean: the argmax
    after = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert after.status_code == 200
    expected = reference(tiny, tiny.tokenizer.encode("def add(a, b):"), 8).output_text
    assert after.json()["choices"][0]["text"] == expected
    reports = asyncio.run(load_reports(nats))
    assert reports["prefill"].ready and reports["decode"].ready
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_client_disconnect_releases_budget_and_kv(system):
    _, base, nats = system
    before = asyncio.run(load_reports(nats))
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "disconnect me " * 10, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = asyncio.run(load_reports(nats))
        if (now["gate"].free_tokens == now["gate"].capacity_tokens
                and now["decode"].free_tokens == before["decode"].free_tokens
                and now["decode"].running == 0):
            break
    assert now["gate"].free_tokens == now["gate"].capacity_tokens, "gate budget not released"
    assert now["decode"].running == 0 and now["decode"].free_tokens == before["decode"].free_tokens


def test_one_trace_spans_every_service(system):
    launcher, base, _ = system
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "trace me", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    path = launcher.run_dir / "traces.jsonl"
    want = {"router.request", "gate.admit", "prefill.queue", "prefill.compute", "kv.handoff", "kv.write",
            "decode.page_grant", "decode.generate"}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = read_spans(path)
        roots = [s for s in spans if s["name"] == "router.request"
                 and s["attributes"].get("request_id") == r.json()["id"].replace("cmpl-", "req-")]
        if roots:
            trace = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
            if want <= {s["name"] for s in trace}:
                break
        time.sleep(0.5)
    assert roots, "router.request span not exported"
    by_id = {s["span_id"]: s for s in trace}
    names = {s["name"]: s for s in trace}
    assert want <= set(names), f"missing spans: {want - set(names)}"
    for s in trace:  # every span but the root has its parent in the same trace
        assert s is roots[0] or s["parent_span_id"] in by_id, f"{s['name']} has a dangling parent"
    assert by_id[names["decode.generate"]["parent_span_id"]]["name"] == "router.request"  # beside kv.handoff
    handoff = names["kv.handoff"]["attributes"]
    assert handoff["mode"] == "direct" and handoff["writes"] == 1 and handoff["bytes"] > 0
    assert handoff["bytes"] == sum(handoff["entry_bytes"]) and handoff["scatter_ms"] == 0  # nothing to scatter
    # one each: the write under kv.handoff; the grant asked for while the prompt's last step computed
    # (early_grant), so under the request and inside prefill.compute
    assert handoff["early_grant"] is True and handoff["grant_ms"] < handoff["write_ms"] + 1000
    for name, service, parent in (("kv.write", "prefill", "kv.handoff"), ("decode.page_grant", "decode", "router.request")):
        [span] = [s for s in trace if s["name"] == name]
        assert by_id[span["parent_span_id"]]["name"] == parent and span["service"] == service
    # asked after the prompt was first scheduled and before its last step ended: both ends of that are
    # prefill's own clock (decode's span start is another process's, so no order is asserted on it)
    [compute] = [s for s in trace if s["name"] == "prefill.compute"]  # one attempt
    assert 0 < handoff["grant_lead_ms"] <= (compute["end_ns"] - compute["start_ns"]) / 1e6
    assert not {"kv.gather", "decode.scatter", "decode.slot_grant"} & set(names)


def test_status_lists_every_service(system):
    launcher, _, _ = system
    r = subprocess.run([sys.executable, "-m", "infra.cli", "status", "--run-dir", str(launcher.run_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for role in ("router", "gate", "prefill", "decode"):
        assert role in r.stdout


def test_the_pool_has_a_disk_tier_by_default(system):
    """Issue 52: nothing set, every store keeps a disk tier under the run directory, sized from its free space, and
    says so in its load report (/metrics, `moorage status`)."""
    launcher, _, nats = system
    assert launcher.disk.per_store > 0 and launcher.disk.directory == launcher.run_dir / "disk"
    stores = [r for r in asyncio.run(latest_reports(nats, enough=lambda s: sum(
        x.role == "store" for x in s.values()) == 2)).values() if r.role == "store"]
    assert len(stores) == 2
    for r in stores:
        disk = r.detail["disk"]
        assert disk["capacity"] == launcher.disk.per_store and disk["writable"]
        assert (launcher.run_dir / "disk" / r.instance / "objects").is_dir()
    status = subprocess.run([sys.executable, "-m", "infra.cli", "status", "--run-dir", str(launcher.run_dir)],
                            capture_output=True, text=True, timeout=60).stdout
    assert status.count(f"/{launcher.disk.per_store >> 20} MiB, ") == 2  # each store's disk: used/capacity


def test_up_stops_every_process_on_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--model", "tiny", "--port", str(port),
                             "--set", f"up.run_dir={run_dir}", "--set", "up.ready_timeout_s=120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "ready" in line and "http://" in line:
                break
        state = json.loads((run_dir / "up.json").read_text())
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for name, pid in state["pids"].items():
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
                f"{name} still running"
    finally:
        if proc.poll() is None:
            proc.kill()
