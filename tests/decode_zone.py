"""In-process decode for tests: a DecodeService with a LandingZone over a real engine, no bus.

`service_ctx` is the context a service gets (a recording stand-in bus unless one is given);
`running_decode` starts the engine loop, yields the service, stops it and checks that every block
and slot came back.
"""

from __future__ import annotations

import asyncio

import contextlib
from types import SimpleNamespace

from services.decode.landing import LandingZone
from services.decode.main import DecodeService
from shared.bus import Subjects
from shared.engine.engine import Engine
from shared.logging import get_logger
from shared.transfer import LandingSlots


def service_ctx(role: str, bus=None):
    if bus is None:
        bus = SimpleNamespace(trace_context=lambda raw: None, published=[], subjects=Subjects("moorage"))

        async def publish(subject, msg):
            bus.published.append((subject, msg))

        bus.publish = publish
    return SimpleNamespace(bus=bus, log=get_logger(role), instance=f"{role}-0", report_soon=asyncio.Event())


@contextlib.asynccontextmanager
async def running_decode(engine: Engine, num_slots: int = 4, slot_bytes: int = 1 << 20, register_pages: bool = True):
    slots = LandingSlots(num_slots, slot_bytes)
    svc = DecodeService(service_ctx("decode"), engine,
                        lambda loop: LandingZone(engine, loop, slots, "local", register_pages=register_pages))
    svc.loop.start()
    try:
        yield svc
    finally:
        await svc.loop.stop()
    engine.block_manager.check_integrity()
    slots.check_integrity()
    assert slots.num_free == num_slots, "a landing slot leaked"


@contextlib.asynccontextmanager
async def handoff_pair(url: str, p_engine: Engine, d_engine: Engine, cfg):
    """A prefill's senders (staged `sender`, `direct` when cfg.direct) and a decode wired as
    services/decode/main.py wires them (cfg.register_pages on both sides), over a real nats-server (`url`) and
    two real Transfer Engines; yields them (p_bus, d_bus, p_te, d_te, slots, decode, sender, direct) and closes
    everything."""
    from services.prefill.direct import DirectSender
    from services.prefill.handoff import HandoffSender
    from shared.bus import Bus, BusConfig
    from shared.messages import HandoffDone, PagesLanded, PagesReleased, PagesRequest, SlotRequest, SlotsFilled
    from shared.transfer import KVTransport

    p_bus = await Bus.connect(BusConfig(url=url), "test-prefill")
    d_bus = await Bus.connect(BusConfig(url=url), "test-decode")
    p_te, d_te = KVTransport(), KVTransport()
    slots = LandingSlots(cfg.slots, cfg.slot_bytes, d_te)
    decode = DecodeService(service_ctx("decode", d_bus), d_engine,
                           lambda loop: LandingZone(d_engine, loop, slots, d_te.endpoint,
                                                    register_pages=cfg.register_pages, reuse=cfg.decode_reuse),
                           transport=d_te, direct=cfg.direct, register_pages=cfg.register_pages)
    decode.loop.start()
    try:
        s = d_bus.subjects
        await d_bus.subscribe(s.decode_pages("decode-0"), PagesRequest, decode.direct.grant, concurrent=True)
        await d_bus.subscribe(s.decode_pages_released("decode-0"), PagesReleased, decode.direct.released)
        await d_bus.subscribe(s.decode_pages_landed("decode-0"), PagesLanded, decode.direct.landed)
        await d_bus.subscribe(s.decode_slots("decode-0"), SlotRequest, decode.zone.grant, concurrent=True)
        await d_bus.subscribe(s.decode_filled("decode-0"), SlotsFilled, decode.zone.filled)
        await d_bus.subscribe(s.decode_landed("decode-0"), HandoffDone, decode.on_landed)
        await d_bus.nc.flush()
        await d_bus.nc.flush()  # nats-py: one flush's PING can overtake buffered SUBs; a second cannot
        sender = HandoffSender(p_bus, "prefill-0", p_engine.layout, p_engine.pages, p_te, cfg)
        direct = DirectSender(p_bus, "prefill-0", p_engine.layout, p_engine.pages, p_te, cfg,
                              p_engine.block_manager.generation)
        yield SimpleNamespace(p_bus=p_bus, d_bus=d_bus, p_te=p_te, d_te=d_te, slots=slots, decode=decode,
                              sender=sender, direct=direct)
    finally:
        await decode.stop()
        slots.close()
        await p_bus.close()
        await d_bus.close()
        for te in (p_te, d_te):
            te.close()


async def collect_chunks(bus, request_id: str):
    """Subscribe to a request's TokenChunks: (the chunks as they come, an Event set by the last one)."""
    import asyncio

    from shared.messages import TokenChunk

    chunks: list = []
    finished = asyncio.Event()

    async def on_chunk(chunk: TokenChunk, _raw) -> None:
        chunks.append(chunk)
        if chunk.finished:
            finished.set()

    await bus.subscribe(bus.subjects.request_out(request_id), TokenChunk, on_chunk)
    return chunks, finished
