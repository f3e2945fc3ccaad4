"""Restore soak: thousands of save -> evict -> restore cycles against a real system, every output compared
with a from-scratch computation of the same prompt.

    .venv/bin/python -m bench.soak            # full: 3,000 cycles -> bench/results/soak.json + soak.png
    .venv/bin/python -m bench.soak --quick    # the CI size (tests/test_restore_soak.py runs it)

The system is `moorage up` with the tiny model, 2 stores of a few MiB (the pool evicts constantly) and a
device cache of a few prompts, so a session's history is gone from device memory when it returns and
often partly gone from the pool. Sessions take turns round-robin; each turn re-sends the history plus new
tokens, ending exactly at, just before or just after a chunk boundary (bench/soak_model.py). Along the way:
every `cut_every` turns a session loses a middle chunk of its history from the pool; every
`corrupt_every` turns its first chunk is overwritten with garbage under the same key (the checksum must
reject it: a verify failure turns into a recompute, never into served bytes); halfway, store-1 is killed
and comes back (`moorage up` restarts it, see infra/up.py). Each turn's `usage.moorage` (device / store /
computed tokens) classifies it; the prefills' pool counters give the verify failures. Mismatches, errors
and bad chunks served must all be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from bench._util import machine_info, write_result
from bench.soak_model import Counts, Session, classify
from bench.soak_report import plot, report
from shared.hashing import chunk_hashes, namespace_seed
from shared.kv_object import HEADER_BYTES, object_key


@dataclass
class SoakParams:
    cycles: int = 3000
    sessions: int = 8
    concurrency: int = 3
    max_tokens: int = 4               # greedy output tokens compared per turn
    chunk_tokens: int = 256           # pool chunk (production default)
    max_prompt_tokens: int = 1800     # a conversation starts over past this
    store_bytes: int = 16 << 20       # per store (Mooncake's minimum segment), 2 stores: ~30 chunks of tiny's 1 MiB
    device_blocks: int = 200          # prefill device KV: ~2 prompts (16-token blocks)
    cut_every: int = 25
    corrupt_every: int = 40
    restart_store_at: float = 0.5     # kill store-1 after this share of the cycles (0: never)
    seed: int = 0
    disk_bytes: int = 0               # each store's disk tier (up.disk_bytes; 0: none): a removed or corrupted
    #                                   chunk may then come back from disk, good, and is counted apart


QUICK = SoakParams(cycles=240, sessions=6, cut_every=15, corrupt_every=20, max_prompt_tokens=1300)


def system_overrides(p: SoakParams, nats_url: str, run_dir: str) -> list[str]:
    return ["up.model=tiny", "up.port=0", f"up.nats_url={nats_url}", f"up.run_dir={run_dir}",
            "up.pool=true", "up.stores=2", f"up.store_bytes={p.store_bytes}", "up.ready_timeout_s=180",
            f"prefill.engine.num_blocks={p.device_blocks}", f"prefill.engine.chunk_tokens={p.chunk_tokens}",
            "decode.engine.num_blocks=1024", "master.master.client_ttl_s=2", "router.router.instance_timeout_s=5",
            f"up.disk_bytes={p.disk_bytes}"]  # 0: DRAM only (the default system has a disk tier)


async def _reports(nats_url: str, seconds: float = 1.5) -> dict:
    from shared.bus import Bus, BusConfig
    from shared.messages import LoadReport

    bus = await Bus.connect(BusConfig(url=nats_url), "soak-observer")
    seen: dict = {}

    async def on_load(msg, _raw):
        seen[msg.instance] = msg

    await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
    await asyncio.sleep(seconds)
    await bus.close()
    return seen


class Soak:
    def __init__(self, p: SoakParams, base_url: str, launcher, namespace: str, pool_client):
        from shared.engine.engine import Engine, EngineConfig
        from shared.engine.models import load_model

        self.p, self.launcher, self.ns, self.pool = p, launcher, namespace, pool_client
        self.seed = namespace_seed(namespace)
        self.http = httpx.Client(base_url=base_url, timeout=300)
        self.reference = Engine(load_model("tiny"), EngineConfig(num_blocks=(p.max_prompt_tokens + 64) // 16 + 8,
                                                                 enable_prefix_cache=False))
        self.ref_lock, self.pool_lock, self.count_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self.counts, self.records = Counts(), []
        self.rng = random.Random(p.seed)
        self.sessions = [Session(f"soak-{p.seed}-{i}") for i in range(p.sessions)]
        self.next_cycle = 0
        self.buf = torch.zeros(HEADER_BYTES + (4 << 20), dtype=torch.uint8)
        pool_client.register(self.buf)
        self.t0 = time.perf_counter()

    # ---- pool interference -----------------------------------------------------------------------
    def _cut(self, s: Session) -> None:
        """Remove a middle chunk of the history from the pool (an eviction in the middle of a session)."""
        n = len(s.prompt) // self.p.chunk_tokens
        if n >= 2:
            c = n // 2
            with self.pool_lock:
                self.pool.remove([object_key(self.ns, 0, 1, chunk_hashes(s.prompt, self.seed, self.p.chunk_tokens)[c])],
                                 force=True)
            s.bad_chunk = c
            with self.count_lock:
                self.counts.midway_evictions += 1

    def _corrupt(self, s: Session) -> None:
        """Garbage under the first chunk's key: same header, one payload byte flipped."""
        if len(s.prompt) < self.p.chunk_tokens:
            return
        key = object_key(self.ns, 0, 1, chunk_hashes(s.prompt, self.seed, self.p.chunk_tokens)[0])
        with self.pool_lock:
            [n] = self.pool.get_into([key], [self.buf.data_ptr()], [self.buf.numel()])
            if n <= HEADER_BYTES:
                return  # already evicted: nothing to corrupt
            self.buf[HEADER_BYTES + 1000] ^= 0x5A
            self.pool.remove([key], force=True)
            if self.pool.put_from([key], [self.buf.data_ptr()], [n]) != [0]:
                return
        s.bad_chunk = 0
        with self.count_lock:
            self.counts.corruptions += 1

    def _restart_store(self) -> None:
        proc = self.launcher.procs["store-1"]
        proc.kill()  # the supervisor of `moorage up` restarts it; its objects are gone
        proc.wait(10)
        self.counts.store_restarts += 1
        self.records.append({"event": "store-1 killed", "cycle": self.next_cycle, "t": time.perf_counter() - self.t0})

    # ---- one turn --------------------------------------------------------------------------------
    def turn(self, s: Session, cycle: int) -> None:
        p = self.p
        if s.turns and cycle % p.corrupt_every == 0:
            self._corrupt(s)
        elif s.turns and cycle % p.cut_every == 0:
            self._cut(s)
        with self.ref_lock:
            prompt = s.next_prompt(self.rng, p.chunk_tokens, p.max_prompt_tokens)
        expected = s.reusable_tokens(prompt, p.chunk_tokens)
        t = time.perf_counter()
        r = self.http.post("/v1/completions", headers={"X-Session-ID": s.sid}, json={
            "model": "tiny", "prompt": prompt, "max_tokens": p.max_tokens, "temperature": 0, "ignore_eos": True})
        ms = (time.perf_counter() - t) * 1e3
        with self.ref_lock:
            [ref] = self.reference.generate([prompt], _params(p.max_tokens))
        with self.count_lock:
            rec = {"cycle": cycle, "session": s.sid, "prompt_tokens": len(prompt), "expected": expected,
                   "ms": round(ms, 1), "t": round(time.perf_counter() - self.t0, 2)}
            if r.status_code != 200:
                self.counts.errors += 1
                rec.update(error=r.status_code, body=r.text[:300])
            else:
                body = r.json()
                m = body["usage"]["moorage"]
                outcome = classify(expected, m["device"], m["store"])
                self.counts.add(outcome, body["usage"])
                bad = s.served_bad_chunk(m["device"], m["store"], p.chunk_tokens)
                if p.disk_bytes:  # the store's disk put a good copy back (the output check below proves it)
                    self.counts.bad_chunk_back_from_disk += bad
                else:
                    self.counts.served_bad_chunk += bad
                ok = body["choices"][0]["text"] == ref.output_text
                self.counts.mismatches += not ok
                rec.update(outcome=outcome, ok=ok, bad_chunk=s.bad_chunk, **m)
            self.records.append(rec)
        s.turns += 1
        s.prompt = prompt
        if s.bad_chunk == 0:  # a corrupted first chunk stays in the pool: the conversation starts over
            s.prompt = []
        s.bad_chunk = None

    def worker(self) -> None:
        while True:
            with self.count_lock:
                cycle = self.next_cycle
                if cycle >= self.p.cycles:
                    return
                self.next_cycle += 1
                if self.p.restart_store_at and cycle == int(self.p.cycles * self.p.restart_store_at):
                    self._restart_store()
            s = self._take_session()
            try:
                self.turn(s, cycle)
            finally:
                self._free.append(s)

    def _take_session(self) -> Session:
        with self.count_lock:
            return self._free.pop(0)

    def run(self) -> Counts:
        self._free = list(self.sessions)  # a session is never in flight twice
        with ThreadPoolExecutor(self.p.concurrency) as ex:
            for f in [ex.submit(self.worker) for _ in range(self.p.concurrency)]:
                f.result()
        self.http.close()
        return self.counts


def _params(n: int):
    from shared.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_soak(p: SoakParams, run_dir: str) -> dict:
    """Start the system, soak it, stop it: the result (params, counts, per-turn records)."""
    from infra.natsd import start_nats_server
    from infra.up import UpConfig, launched
    from shared.config import load_config
    from shared.pool import PoolClient, PoolConfig

    if p.disk_bytes:  # the same sessions every run: a disk tier left from the last would hold this run's chunks
        shutil.rmtree(Path(run_dir) / "disk", ignore_errors=True)
    nats = start_nats_server()
    try:
        cfg = load_config(UpConfig, overrides=system_overrides(p, nats.url, run_dir))
        with launched(cfg) as (launcher, base):
            before = {i: r for i, r in asyncio.run(_reports(nats.url)).items() if r.role == "prefill"}
            ns = next(iter(before.values())).detail["kv_namespace"]
            client = PoolClient(PoolConfig(master_addr=launcher.configs["prefill-0"].pool.master_addr))
            try:
                soak = Soak(p, base, launcher, ns, client)
                counts = soak.run()
            finally:
                client.close()
            time.sleep(3.0)  # quiet: the master's next listings catch up with the last saves
            reports = asyncio.run(_reports(nats.url))
            after = {i: r for i, r in reports.items() if r.role == "prefill"}
            pool = {i: r.detail["pool"] for i, r in after.items()}
            index = store_index_check(base, reports["master-0"])
            counts.verify_failures = sum(c["verify_failures"] - before[i].detail["pool"]["verify_failures"]
                                         for i, c in pool.items() if i in before)
            restarts = launcher.restarts() if hasattr(launcher, "restarts") else {}
            disk = {i: r.detail["disk"] for i, r in reports.items() if r.role == "store" and "disk" in r.detail}
    finally:
        nats.stop()
    return {"params": dataclasses.asdict(p), "counts": counts.to_dict(), "prefill_pool_counters": pool,
            "store_index": index, "launcher_restarts": restarts, "store_disk": disk, "records": soak.records}


def store_index_check(router_url: str, master) -> dict:
    """The router's store index (from the master's store-tier events) against the pool's own key list."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.master.store_tier import parse_keys

    base = master.detail["metrics_url"].rsplit("/", 1)[0]
    pool = parse_keys(k for k in httpx.get(base + "/get_all_keys", timeout=10).text.splitlines() if k)
    metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(router_url + "/metrics").text)
               for s in f.samples}
    return {"router_store_chunks": int(metrics.get("moorage_router_kv_store_chunks", -1)),
            "pool_chunks": len(pool.chunks), "pool_objects": int(master.detail.get("objects", -1)),
            "master_store_events": master.detail.get("store_events", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI size")
    ap.add_argument("--cycles", type=int, help="override the number of cycles")
    ap.add_argument("--disk-bytes", type=int, default=0, help="each store's disk tier (up.disk_bytes; 0: none)")
    ap.add_argument("--out", default="bench/results/soak.json")
    ap.add_argument("--run-dir", default=".moorage/soak")
    args = ap.parse_args()
    p = QUICK if args.quick else SoakParams()
    if args.cycles:
        p = dataclasses.replace(p, cycles=args.cycles)
    if args.disk_bytes:
        p = dataclasses.replace(p, disk_bytes=args.disk_bytes)
    t0 = time.perf_counter()
    result = {"machine": machine_info(), **run_soak(p, args.run_dir)}
    write_result(result, args.out, t0, plot, report)
    bad = {k: result["counts"][k] for k in ("mismatches", "errors", "served_bad_chunk") if result["counts"][k]}
    if bad:
        raise SystemExit(f"soak FAILED: {json.dumps(bad)}")


if __name__ == "__main__":
    main()
