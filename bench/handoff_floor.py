"""The floor of a push handoff on this machine: what a checksummed handoff of the same pieces would cost with
nothing of moorage around it, measured beside the handoff in bench/handoff.py.

A handoff needs at least (1) a write into another process's memory, (2) one message to that process and
its answer, in sequence (decode cannot use the KV before it is told the write is complete, and prefill
learns that only from its own Transfer Engine), and (3) since moorage adopts no byte it has not verified,
the receiver's CRC-32C of every byte before it answers. `FloorTE` times exactly that, nothing else:

- a child process (`python -m bench.handoff_floor NATS_URL SUBJECT NBYTES`) registers NBYTES with its own
  Transfer Engine, prints its endpoint and address, and answers each HandoffDone on SUBJECT with an Ack
  once it has checked each page entry's bytes against its CRC (the real messages, decoded and encoded;
  the CRC inline on its event loop, the cheapest way: the CRC is memory-bound here; no engine, no
  tracing); the Ack's stats carry the check's ms, so the unchecked floor is known too; it exits when its
  stdin closes;
- the bench process writes the pieces into it with the handoff's own `KVTransport.write`, then sends a
  HandoffDone of the request's shape (its prompt ids, one page entry per piece, with the pieces' CRCs)
  over the system's nats-server and waits for the Ack.

The raw baseline (two engines in one process, no message) is the transfer engine's limit; this one adds
only what any checksummed push handoff between two processes pays on this box. A handoff far above the
floor spends its time in moorage; one near it, in the machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import torch

from shared.handoff_check import checksum
from shared.messages import Ack, HandoffDone
from shared.transfer import KVTransport


class FloorTE:
    """`write()` times one write of `lengths` pieces into a child process plus one HandoffDone -> Ack round
    trip on the bus, the child's check of the pieces' CRCs included: (write seconds, write + round trip
    seconds, the child's check in seconds). `done`'s page entries get the pieces' CRCs."""

    def __init__(self, lengths: list[int], nats_url: str, done: HandoffDone, subject: str = "bench.floor.done"):
        import nats
        import uvloop

        total, offs = sum(lengths), [sum(lengths[:i]) for i in range(len(lengths))]
        self.lengths, self.subject = lengths, subject
        self.child = subprocess.Popen([sys.executable, "-m", "bench.handoff_floor", nats_url, subject, str(total)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            hello = json.loads(self.child.stdout.readline() or "null")
            if hello is None:
                raise RuntimeError(f"the floor's child exited ({self.child.wait()}) before it was ready")
            self.peer = hello["endpoint"]
            self.te = KVTransport()
            self.src = torch.ones(total, dtype=torch.uint8)
            self.te.register(self.src)
            done.pages = [[0, 1, off, n, checksum(self.src[off:off + n])] for off, n in zip(offs, lengths)]
            self.payload = done.encode()
            self.s_addr = [self.src.data_ptr() + o for o in offs]
            self.d_addr = [hello["addr"] + o for o in offs]
            self.loop = uvloop.new_event_loop()
            self.nc = self.loop.run_until_complete(nats.connect(nats_url, allow_reconnect=False))
            self.write()  # warm-up: connection set-up on both paths
        except BaseException:
            self.child.kill()
            self.child.wait()
            raise

    def write(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        self.te.write(self.peer, self.s_addr, self.d_addr, self.lengths)
        t1 = time.perf_counter()
        reply = self.loop.run_until_complete(self.nc.request(self.subject, self.payload, timeout=10))
        t2 = time.perf_counter()
        ack = Ack.decode(reply.data)
        if not ack.ok:
            raise RuntimeError(f"the floor's child refused the HandoffDone: {ack.error}")
        return t1 - t0, t2 - t0, ack.stats["verify_ms"] / 1e3

    def close(self) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()
        self.te.close()
        self.child.stdin.close()
        self.child.wait(timeout=30)


async def _serve(nats_url: str, subject: str, nbytes: int) -> None:
    import nats

    te = KVTransport()
    buf = torch.zeros(nbytes, dtype=torch.uint8)  # written once: resident, like decode's warm pages
    te.register(buf)
    nc = await asyncio.wait_for(nats.connect(nats_url, allow_reconnect=False), 30)  # the parent waits for our line

    async def done(msg) -> None:
        req = HandoffDone.decode(msg.data)
        t = time.perf_counter()
        bad = [i for i, (_, _, off, n, crc) in enumerate(req.pages) if checksum(buf[off:off + n]) != crc]
        ms = (time.perf_counter() - t) * 1e3
        await nc.publish(msg.reply, Ack(req.request_id, not bad, f"pieces {bad} differ" if bad else "",
                                        {"verify_ms": ms}).encode())

    await nc.subscribe(subject, cb=done)
    await nc.flush()
    print(json.dumps({"endpoint": te.endpoint, "addr": buf.data_ptr()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await nc.close()
    te.close()


if __name__ == "__main__":
    import uvloop

    uvloop.run(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
