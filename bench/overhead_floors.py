"""Floors under the router + gate overhead (bench/overhead.py), measured on this machine:

    .venv/bin/python -m bench.overhead_floors --n 2000 --out bench/results/overhead_floors.json

- nats: a bare request/reply round trip between two processes (nats-py; the responder on uvloop like
  every service; the requester on uvloop and on the default asyncio loop, the bench's), small msgpack
  payload, with and without a `traceparent` header. What one bus hop costs before any of our code.
- http: one keep-alive aiohttp client (the bench's, default asyncio loop) POSTing a ~32-token JSON body
  to a uvicorn server (httptools, uvloop; another process) that answers a small JSON body, as
  (1) a bare ASGI callable, (2) a Starlette route, (3) a FastAPI route with a Request and JSONResponse,
  (4) the same FastAPI app with the router's four exception handlers. What the HTTP stack costs before
  the router's own work.
Every figure is the median (and p90) of n sequential round trips after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench._util import machine_info, md_table, write_result

from shared.sockets import free_port

SUBJECT = "floors.echo"
BODY = {"model": "tiny", "prompt": list(range(1000, 1032)), "max_tokens": 1, "temperature": 0, "ignore_eos": True}
GAP_S = 0.002  # between round trips, as between a bench's requests: each one finds its peers idle (asleep)
HTTP_KINDS = ("asgi", "starlette", "fastapi", "fastapi+handlers")


def stats(xs: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(xs, 50)), "p90_ms": float(np.percentile(xs, 90)),
            "mean_ms": float(np.mean(xs)), "n": len(xs)}


# ---- servers (child processes) ------------------------------------------------------------------

async def _responder(url: str) -> None:
    import msgpack
    import nats

    nc = await nats.connect(url)
    reply = msgpack.packb({"request_id": "r", "status": "admitted", "decode_instance": "decode-0", "waited_ms": 0.01})

    async def cb(msg) -> None:
        msgpack.unpackb(msg.data)
        await nc.publish(msg.reply, reply)

    await nc.subscribe(SUBJECT, cb=cb)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


def http_app(kind: str):
    out = {"id": "cmpl-1", "object": "text_completion",
           "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 32, "completion_tokens": 1, "total_tokens": 33}}
    if kind == "asgi":
        payload = json.dumps(out).encode()

        async def app(scope, receive, send) -> None:
            body = b""
            while True:
                m = await receive()
                body += m.get("body", b"")
                if not m.get("more_body"):
                    break
            json.loads(body)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
        return app
    if kind == "starlette":
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def ep(request):
            await request.json()
            return JSONResponse(out)
        return Starlette(routes=[Route("/v1/completions", ep, methods=["POST"])])
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(telemetry={"tracing": False}) if _fastapi_has_telemetry() else FastAPI()

    @app.post("/v1/completions")
    async def ep(request: Request):
        await request.json()
        return JSONResponse(out)

    if kind == "fastapi+handlers":
        from fastapi.exceptions import RequestValidationError
        from starlette.exceptions import HTTPException

        for exc in (RequestValidationError, HTTPException, Exception, KeyError):
            app.add_exception_handler(exc, lambda r, e: JSONResponse({}, status_code=500))
    return app


def _fastapi_has_telemetry() -> bool:
    import inspect

    from fastapi import FastAPI
    return "telemetry" in inspect.signature(FastAPI.__init__).parameters


def _serve_http(kind: str, port: int) -> None:
    import uvicorn

    uvicorn.run(http_app(kind), host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, lifespan="off")


def _start_gate(url: str, workdir: str, extra: list[str]) -> subprocess.Popen:
    """The real gate service (`moorage serve gate`), logging and tracing to files as under `moorage up`."""
    from infra.tomlgen import to_toml
    from services.gate.config import GateConfig
    from shared.config import load_config

    cfg = load_config(GateConfig, overrides=[f"bus.url={url}", "http.port=-1", f"tracing.path={workdir}/traces.jsonl",
                                             *extra])
    path = os.path.join(workdir, "gate-0.toml")
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    log = open(os.path.join(workdir, "gate-0.log"), "ab")
    return subprocess.Popen([sys.executable, "-m", "infra.cli", "serve", "gate", "--config", path],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


async def gate_rtt(url: str, n: int, warm: int) -> list[float]:
    """AdmitRequest -> AdmitReply round trips against the gate, each followed by its Release (as the router
    does, with a traceparent), once a decode load report made it admit at once."""
    from shared.bus import Bus, BusConfig
    from shared.messages import AdmitReply, AdmitRequest, LoadReport, Release

    bus = await Bus.connect(BusConfig(url=url), "floors-gate")
    s, out = bus.subjects, []
    tp = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    report = LoadReport("decode-0", "decode", True, capacity_tokens=1 << 20, free_tokens=1 << 20)
    await bus.publish(s.load("decode", "decode-0"), report)
    for i in range(warm + n):
        if i % 200 == 0:
            await bus.publish(s.load("decode", "decode-0"), report)  # stays live (instance_timeout_s)
        rid = f"req-{i:032x}"
        data = AdmitRequest(rid, 32, 1, None, router_boot="b" * 32).encode()
        t0 = time.perf_counter()
        raw = await bus.nc.request(s.gate_admit, data, timeout=5, headers=tp)
        dt = time.perf_counter() - t0
        reply = AdmitReply.decode(raw.data)
        assert reply.status == "admitted", reply
        await bus.nc.publish(s.gate_release, Release(rid, "finished").encode(), headers=tp)
        await asyncio.sleep(GAP_S)
        if i >= warm:
            out.append(dt * 1e3)
    await bus.close()
    return out


# ---- clients ------------------------------------------------------------------------------------

async def nats_rtt(url: str, n: int, warm: int, headers: dict | None) -> list[float]:
    import msgpack
    import nats

    nc = await nats.connect(url)
    data = msgpack.packb({"request_id": "req-" + "0" * 32, "prompt_tokens": 32, "max_tokens": 1,
                          "decode_instance": None, "router_boot": "b" * 32})
    out = []
    for i in range(warm + n):
        t0 = time.perf_counter()
        await nc.request(SUBJECT, data, timeout=5, headers=headers)
        if i >= warm:
            out.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(GAP_S)
    await nc.close()
    return out


async def http_rtt(port: int, n: int, warm: int) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=1)) as c:
        for i in range(warm + n):
            t0 = time.perf_counter()
            async with c.post("/v1/completions", json=BODY) as r:
                await r.json()
            if i >= warm:
                out.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(GAP_S)
    return out


def _child(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.overhead_floors", *args], stdout=subprocess.PIPE, text=True)


def _wait_port(port: int, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # startup only
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_subscribed(url: str, timeout: float = 30) -> None:
    """Until the gate answers an admit (startup only)."""
    import uvloop

    from shared.bus import Bus, BusConfig
    from shared.messages import AdmitReply, AdmitRequest

    async def probe() -> None:
        bus = await Bus.connect(BusConfig(url=url), "floors-probe")
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    await bus.request(bus.subjects.gate_admit, AdmitRequest("probe", 0, 0, None), AdmitReply, timeout=1)
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()

    uvloop.run(probe())


def measure(n: int, warm: int, gate_set: list[str], only: list[str] | None = None) -> dict:
    import uvloop

    from infra.natsd import start_nats_server

    only = set(only or ("nats", "gate", "http"))
    res: dict = {"nats": {}, "gate": {}, "http": {}}
    if only & {"nats", "gate"}:
        server = start_nats_server()
        try:
            if "nats" in only:
                res["nats"] = nats_floor(server.url, n, warm)
            if "gate" in only:
                with tempfile.TemporaryDirectory(prefix="floors-gate-") as d:
                    gate = _start_gate(server.url, d, gate_set)
                    try:
                        _wait_subscribed(server.url)
                        cpu0 = _cpu_s(gate.pid)
                        rtt = uvloop.run(gate_rtt(server.url, n, warm))
                        cpu_ms = (_cpu_s(gate.pid) - cpu0) * 1e3 / (n + warm)
                        res["gate"] = {"admit round trip, gate process alone": {**stats(rtt),
                                                                                "gate_cpu_ms_per_request": cpu_ms}}
                    finally:
                        gate.terminate()
                        gate.wait()
        finally:
            server.stop()
    for kind in HTTP_KINDS if "http" in only else ():
        port = free_port()
        child = _child(["--role", "http", "--kind", kind, "--port", str(port)])
        try:
            _wait_port(port)
            res["http"][kind] = stats(asyncio.run(http_rtt(port, n, warm)))
        finally:
            child.terminate()
            child.wait()
    return res


def nats_floor(url: str, n: int, warm: int) -> dict:
    import uvloop

    responder = _child(["--role", "responder", "--url", url])
    try:
        assert responder.stdout.readline().strip() == "ready"
        tp = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        return {"requester uvloop": stats(uvloop.run(nats_rtt(url, n, warm, None))),
                "requester asyncio": stats(asyncio.run(nats_rtt(url, n, warm, None))),
                "requester uvloop, traceparent header": stats(uvloop.run(nats_rtt(url, n, warm, tp)))}
    finally:
        responder.terminate()
        responder.wait()


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{part}: {k}", v) for part in ("nats", "gate", "http") for k, v in r["floors"].get(part, {}).items()]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(range(len(rows)), [v["p50_ms"] for _, v in rows],
            xerr=[[0] * len(rows), [v["p90_ms"] - v["p50_ms"] for _, v in rows]])
    ax.set_yticks(range(len(rows)), [k for k, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("round trip, ms (bar p50, whisker p90)")
    ax.set_title("Floors under the router + gate overhead")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(r: dict) -> str:
    m, f = r["machine"], r["floors"]
    rows = [[f"nats request/reply, {k}", v["n"], v["p50_ms"], v["p90_ms"], v["mean_ms"]] for k, v in f["nats"].items()]
    rows += [[f"gate: {k} (gate CPU {v['gate_cpu_ms_per_request']:.2f} ms per admit + release)", v["n"], v["p50_ms"],
              v["p90_ms"], v["mean_ms"]] for k, v in f.get("gate", {}).items()]
    rows += [[f"http POST (aiohttp -> uvicorn httptools/uvloop), {k}", v["n"], v["p50_ms"], v["p90_ms"], v["mean_ms"]]
             for k, v in f["http"].items()]
    return (f"## overhead floors\n\n{m['cpu_count']} CPUs, {m['date']}; load avg start "
            f"{m['loadavg_1m_5m_15m'][0]:.2f} / end {m['loadavg_at_end'][0]:.2f}\n\n"
            + md_table(["round trip", "N", "p50 ms", "p90 ms", "mean ms"], rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("nats", "gate", "http"), action="append", help="measure only these parts")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a gate config override (repeatable)")
    ap.add_argument("--role", choices=("responder", "http"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=HTTP_KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "responder":
        import uvloop
        uvloop.run(_responder(args.url))
        return
    if args.role == "http":
        _serve_http(args.kind, args.port)
        return
    args.out = args.out or f"runs/overhead-floors-{time.strftime('%Y%m%d-%H%M%S')}/overhead_floors.json"
    info, t0 = machine_info(), time.perf_counter()
    result = {"command": "python -m bench.overhead_floors " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": info, "floors": measure(args.n, args.warm, args.set, args.only)}
    write_result(result, args.out, t0, plot, report)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
