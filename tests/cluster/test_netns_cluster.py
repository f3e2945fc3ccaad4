"""The multi-host configuration, for real, on one box: three network namespaces are three hosts on one bridge;
`moorage deploy render` writes their files from one inventory, and each host's units run as systemd would
run them there (launch.py). NATS, the master, the gate and the router on h1; a store on every host; prefills
on h1 and h2; the decode on h3.

A two-turn session is forced onto both prefills: turn 1 goes wherever the router sends it (X); X's saved
history is then in the pool and X is stopped (SIGTERM: it drains, says goodbye on the bus, exits 0), so the
router's only prefill for turn 2 is the other one (Y, on the other host): no routing knob or race decides it.
Y has none of the history in device memory and restores it from the pool. The test shows that:
- the restored bytes came from segments on other hosts: Mooncake's replica descriptors place each restored
  object (one replica each, never moved, so its segment is the one that served it), the master's per-segment
  `segment_allocated_bytes` agrees with them, and Y's switch port received at least those bytes;
- both turns' output is token-identical to a from-scratch greedy run of the same model in this process;
- each handoff went from the turn's prefill (h1 or h2) to the decode on h3 (its kv.write endpoint is h3's
  address, decode's spans are in h3's span file, h3's port received the handoff bytes).

The placement is the master's choice (random among the three segments): the test would fail only if every
one of the session's 12 objects landed on Y's own store, a chance of 3^-12 (~2e-6).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from infra.deploy import render
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.hashing import CHUNK_TOKENS, chunk_hashes, namespace_seed
from shared.kv_object import object_key
from tests.cluster import netns, replicas
from tests.cluster.cluster import API_KEY, Cluster, inventory, wait_healthy
from tests.cluster.launch import HostFS
from tests.cluster.observe import HostSpan, Traces, by_label, listening, one, samples
from tests.natsbus import latest_reports

MAX_TOKENS = 16
CODE = "".join(f"line {i:03d}: def f{i}(x): return x * {i} + {i % 7}\n" for i in range(80))
TURN1 = [{"role": "system", "content": "You review Python code."},
         {"role": "user", "content": "Review this file:\n" + CODE}]
NEW_MESSAGE = {"role": "user", "content": "Which line has the largest constant? Answer briefly."}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    try:
        top = netns.create(3)
    except netns.NetnsRefused as e:
        pytest.skip(f"the kernel refuses network namespaces here: {e}")
    c = None
    try:
        run = tmp_path_factory.mktemp("cluster")
        why = HostFS(run / "probe").refused(top.switch_prefix())
        if why:
            pytest.skip(f"the kernel refuses the per-host overlay mounts: {why}")
        (run / "cluster.toml").write_text(inventory(top))
        render(run / "cluster.toml", run / "out")
        c = Cluster(top, run / "out", run)
        print(f"cluster files and service logs: {run}")
        from kernels import cbuild, cpu_attention, cpu_kv  # warm kernel caches per host: one compile, not three

        built = [cpu_attention.available(), cpu_kv.available()]  # both C kernels, before the copies
        seed = cbuild.cache_dir() if any(built) else None
        for h in top.hosts:
            c.fs(h.name).prepare(seed)
        t0 = time.monotonic()
        c.start()
        c.ready_s["all"] = time.monotonic() - t0
        yield c
    finally:
        try:
            if c is not None:
                c.close()
        finally:
            top.close()


def reference(tiny, prompt_ids: list[int]) -> str:
    """Greedy from scratch in this process (one torch thread: beside the cluster's processes on a small box,
    two spinning OpenMP threads took ~20 s instead of ~3 s here, for the same tokens)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(tiny, EngineConfig(num_blocks=512, enable_prefix_cache=False))
        [seq] = engine.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return seq.output_text


@dataclass
class Turn:
    """One turn of the session as the client and the span files saw it."""
    ids: list[int]               # the prompt, tokenized as the router does
    body: dict
    request_id: str
    wall_s: float
    spans: list[HostSpan] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.body["choices"][0]["message"]["content"]

    @property
    def routed(self) -> dict:
        return one(self.spans, "router.request", "h1").attrs


def chat(ex, api: httpx.Client, url: str, tiny, messages: list[dict]) -> Turn:
    def post() -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = api.post(url + "/v1/chat/completions", headers={"X-Session-ID": "s-cluster"}, json={
            "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        return r, time.monotonic() - t0

    r, wall = ex.submit(post).result()
    assert r.status_code == 200, r.text
    return Turn(tiny.tokenizer.chat_token_ids(messages), r.json(), r.headers["x-request-id"], wall)


def check_ops_endpoints(c: Cluster, ex, probe: httpx.Client) -> None:
    """Every service answers /health (200) and /metrics on its host's address, seen from the operator's box."""
    health = ex.submit(wait_healthy, c, probe).result()
    assert set(health) == set(c.services) - {"nats"}
    for name in health:
        m = samples(ex.submit(lambda n=name: probe.get(c.http_url(n) + "/metrics").text).result())
        if name == "router":  # the router's own figures, on its API port
            assert ("moorage_router_prompt_tokens_total", ()) in m, sorted(m)[:20]
        else:
            labels = (("instance", c.configs[name].instance), ("role", c.services[name].spec.role))
            assert m.get(("moorage_ready", labels)) == 1.0, name


def sockets_by_service(c: Cluster) -> dict[str, list[str]]:
    """What each service listens on, as `ss` sees it inside its host; each one's /health + /metrics (the
    router's API) port is bound to its host's address, as rendered."""
    owners = {svc.proc.pid: name for name, svc in c.services.items()}
    found = {}
    for h in c.top.hosts:
        found.update(listening(h.exec_prefix(), owners))
    for name, svc in c.services.items():
        if name != "nats":
            assert "tcp " + c.http_url(name).removeprefix("http://") in found.get(name, []), (name, found.get(name))
    return found


def bus_reports(c: Cluster, ex) -> dict:
    """Latest load report per instance, once both prefills, the decode and the master have reported."""
    bus = c.configs["gate"].bus
    url = bus.url.replace("nats://", f"nats://{bus.user}:{bus.password}@")

    def enough(seen: dict) -> bool:
        roles = [r.role for r in seen.values() if r.ready]
        return roles.count("prefill") == 2 and "decode" in roles and "master" in roles

    return ex.submit(lambda: asyncio.run(latest_reports(url, enough=enough))).result()


def placements(c: Cluster, ex, probe: httpx.Client, keys: list[str], master_metrics_url: str) -> dict:
    """key -> Placement of every object, from Mooncake's replica descriptors; the master's per-segment use
    (`segment_allocated_bytes`) must say the same, byte for byte (only this session's objects are stored)."""
    top, master = c.top, c.configs["master"].master
    placed = {p.key: p for p in replicas.ask(top.switch_prefix(), f"{master.host}:{master.rpc_port}",
                                             top.operator_address, keys)}
    assert set(placed) == set(keys)
    metrics = samples(ex.submit(lambda: probe.get(master_metrics_url).text).result())
    used = {seg.rpartition(":")[0]: v for seg, v in by_label(metrics, "segment_allocated_bytes", "segment").items()}
    for h in top.hosts:
        assert used.get(h.address, 0) == sum(p.size for p in placed.values() if p.address == h.address), used
    return placed


def test_session_restores_across_hosts_and_hands_off_to_h3(cluster, tiny):
    c, top = cluster, cluster.top
    traces = Traces({h.name: c.fs(h.name).local("/var/log/moorage/traces.jsonl") for h in top.hosts})
    router = c.http_url("router")
    with netns.in_netns(top.switch) as ex, httpx.Client(timeout=120) as probe, \
            httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as api:
        check_ops_endpoints(c, ex, probe)
        ports = sockets_by_service(c)
        reports = bus_reports(c, ex)
        ns = next(r.detail["kv_namespace"] for r in reports.values() if r.role == "prefill")
        master_metrics_url = next(r.detail["metrics_url"] for r in reports.values() if r.role == "master")

        # turn 1: wherever the router sends it (X); its full chunks are saved to the pool
        t1 = chat(ex, api, router, tiny, TURN1)
        x = one(traces.request(t1.request_id, {("h1", "router.request")}), "router.request").attrs["prefill_instance"]
        x_host = c.hosts[x]
        t1.spans = traces.request(t1.request_id, {("h1", "router.request"), (x_host, "store.save"),
                                                  (x_host, "kv.handoff"), ("h3", "decode.generate")})
        nchunks = len(t1.ids) // CHUNK_TOKENS
        assert one(t1.spans, "store.save", x_host).attrs["chunks"] == nchunks >= 12
        keys = [object_key(ns, 0, 1, d) for d in chunk_hashes(t1.ids, namespace_seed(ns))[:nchunks]]
        placed = placements(c, ex, probe, keys, master_metrics_url)

        # turn 2 has one prefill left: X drains and leaves (its goodbye report reaches the router at once)
        assert c.services[x].stop() == 0
        y = next(n for n in ("prefill-0", "prefill-1") if n != x)
        y_host, y_address = c.hosts[y], top.host(c.hosts[y]).address
        assert y_host != x_host
        before = top.port_counters()
        t2 = chat(ex, api, router, tiny, TURN1 + [{"role": "assistant", "content": t1.text}, NEW_MESSAGE])
        after = top.port_counters()

    received = {h: after[h]["received"] - before[h]["received"] for h in after}
    t2.spans = traces.request(t2.request_id, {("h1", "router.request"), (y_host, "store.restore"),
                                              (y_host, "kv.handoff"), (y_host, "kv.write"), ("h3", "decode.page_grant"),
                                              ("h3", "decode.generate")})
    assert t2.routed["prefill_instance"] == y and t2.routed["decode_instance"] == "decode-0"

    # turn 2 restored its history from the pool, on Y, and says so in usage
    usage = t2.body["usage"]["moorage"]
    restore = one(t2.spans, "store.restore", y_host).attrs
    assert restore["chunks"] >= 1 and usage["store"] == restore["chunks"] * CHUNK_TOKENS
    assert usage["device"] + usage["store"] + usage["computed"] == t2.body["usage"]["prompt_tokens"] == len(t2.ids)

    # ...and those bytes crossed hosts: the restored objects' segments, checked against the wire
    restored = [placed[object_key(ns, 0, 1, d)] for d in chunk_hashes(t2.ids, namespace_seed(ns))[:restore["chunks"]]]
    assert restore["bytes"] == sum(p.size for p in restored)
    remote = [p for p in restored if p.address != y_address]
    remote_bytes = sum(p.size for p in remote)
    assert remote_bytes > 0, f"every restored object was on {y_host}'s own store"
    assert received[y_host] >= remote_bytes, (received, remote_bytes)

    # each handoff went from the turn's prefill to the decode on h3
    h3 = top.host("h3").address
    assert c.hosts["decode-0"] == "h3"
    for turn, host in ((t1, x_host), (t2, y_host)):
        assert one(turn.spans, "kv.handoff", host).attrs["decode_instance"] == "decode-0"
        writes = [s.attrs for s in turn.spans if s.name == "kv.write"]
        assert writes and all(w["endpoint"].rpartition(":")[0] == h3 for w in writes), writes
        assert one(turn.spans, "decode.generate", "h3").attrs["completion_tokens"] == MAX_TOKENS
    handoff2 = one(t2.spans, "kv.handoff", y_host).attrs
    assert received["h3"] >= handoff2["bytes"] > 0

    # the output is the model's own, token for token
    assert t1.text == reference(tiny, t1.ids)
    assert t2.text == reference(tiny, t2.ids)
    assert t2.body["usage"]["completion_tokens"] == MAX_TOKENS

    def handoff(turn: Turn, host: str) -> dict:
        return {k: one(turn.spans, "kv.handoff", host).attrs[k] for k in ("bytes", "writes", "rounds", "write_ms")}

    # every service drains and exits 0 on SIGTERM (X already did)
    codes = c.close()
    assert {n: rc for n, rc in codes.items() if n != "nats" and rc != 0} == {}, codes

    figures = {
        "startup_s": round(c.ready_s["all"], 1),
        "exit_codes": codes,
        "listening": ports,
        "turn1": {"prefill": f"{x}@{x_host}", "prompt_tokens": len(t1.ids), "ttft_ms": t1.routed["ttft_ms"],
                  "wall_s": round(t1.wall_s, 2), "saved_chunks": nchunks, "handoff": handoff(t1, x_host)},
        "turn2": {"prefill": f"{y}@{y_host}", "prompt_tokens": len(t2.ids), "ttft_ms": t2.routed["ttft_ms"],
                  "wall_s": round(t2.wall_s, 2), "usage": usage, "handoff": handoff(t2, y_host),
                  "restored": {"chunks": restore["chunks"], "bytes": restore["bytes"], "ms": round(restore["ms"], 1),
                               "cross_host_bytes": remote_bytes, "cross_host_chunks": len(remote),
                               "by_host": {h.name: sum(p.size for p in restored if p.address == h.address)
                                           for h in top.hosts}},
                  "switch_port_received_bytes": received},
    }
    print("\ncluster figures:", json.dumps(figures, indent=1))
