"""The floor of a push handoff on this machine: what a handoff of the same pieces would cost with nothing of
moorage around it, measured beside the handoff in bench/handoff.py.

A handoff needs at least (1) a write into another process's memory and (2) one message to that process
and its answer, in sequence: decode cannot use the KV before it is told the write is complete, and
prefill learns that only from its own Transfer Engine. `FloorTE` times exactly that, nothing else:

- a child process (`python -m bench.handoff_floor NATS_URL SUBJECT NBYTES`) registers NBYTES with its own
  Transfer Engine, prints its endpoint and address, and answers each HandoffDone on SUBJECT with an Ack
  (the real messages, decoded and encoded; no checksum, no engine, no tracing); it exits when its stdin
  closes;
- the bench process writes the pieces into it with the handoff's own `KVTransport.write`, then sends a
  HandoffDone of the request's shape (its prompt ids, one page entry per piece) over the system's
  nats-server and waits for the Ack.

The raw baseline (two engines in one process, no message) is the transfer engine's limit; this one adds
only what any push handoff between two processes pays on this box. A handoff far above the floor spends
its time in moorage; one near it, in the machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import torch

from shared.messages import Ack, HandoffDone
from shared.transfer import KVTransport


class FloorTE:
    """`write()` times one write of `lengths` pieces into a child process plus one HandoffDone -> Ack round
    trip on the bus: (write seconds, write + round trip seconds)."""

    def __init__(self, lengths: list[int], nats_url: str, done: HandoffDone, subject: str = "bench.floor.done"):
        import nats
        import uvloop

        total, offs = sum(lengths), [sum(lengths[:i]) for i in range(len(lengths))]
        self.lengths, self.subject, self.payload = lengths, subject, done.encode()
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
            self.s_addr = [self.src.data_ptr() + o for o in offs]
            self.d_addr = [hello["addr"] + o for o in offs]
            self.loop = uvloop.new_event_loop()
            self.nc = self.loop.run_until_complete(nats.connect(nats_url, allow_reconnect=False))
            self.write()  # warm-up: connection set-up on both paths
        except BaseException:
            self.child.kill()
            self.child.wait()
            raise

    def write(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.te.write(self.peer, self.s_addr, self.d_addr, self.lengths)
        t1 = time.perf_counter()
        reply = self.loop.run_until_complete(self.nc.request(self.subject, self.payload, timeout=10))
        t2 = time.perf_counter()
        if not Ack.decode(reply.data).ok:
            raise RuntimeError("the floor's child refused the HandoffDone")
        return t1 - t0, t2 - t0

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
        await nc.publish(msg.reply, Ack(req.request_id, True).encode())

    await nc.subscribe(subject, cb=done)
    await nc.flush()
    print(json.dumps({"endpoint": te.endpoint, "addr": buf.data_ptr()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await nc.close()
    te.close()


if __name__ == "__main__":
    import uvloop

    uvloop.run(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
