"""The service lifecycle's load reports (shared/service.py): one every load_interval_s, and one at once
when the service asks for it (`report_soon`: a decode whose request ended and freed KV), so a gate that
counts decode's reported free KV admits the next request without waiting for the next periodic report."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shared.bus import Subjects
from shared.messages import LoadReport
from shared.service import ServiceContext, _report_load


def _ctx() -> tuple[ServiceContext, list]:
    published: list = []
    bus = SimpleNamespace(subjects=Subjects("moorage"))

    async def publish(subject, msg):
        published.append((asyncio.get_running_loop().time(), subject, msg))

    bus.publish = publish
    ctx = ServiceContext("decode", "decode-0", None, bus)
    ctx.load_report = lambda: LoadReport("decode-0", "decode", True, capacity_tokens=100, free_tokens=100)
    return ctx, published


async def test_report_soon_publishes_at_once_and_a_burst_is_one_report():
    ctx, published = _ctx()
    reporter = asyncio.create_task(_report_load(ctx, interval=60.0))
    try:
        await asyncio.sleep(0.05)
        assert len(published) == 1  # the first, at start; the next periodic one is a minute away
        for _ in range(5):  # a burst of finished requests
            ctx.report_soon.set()
        await asyncio.sleep(0.2)
        assert len(published) == 2 and published[1][1] == "moorage.load.decode.decode-0"
        assert published[1][2].boot == ctx.boot
        ctx.report_soon.set()  # later: another one
        await asyncio.sleep(0.2)
        assert len(published) == 3
    finally:
        ctx.stop.set()
        await asyncio.wait_for(reporter, 2)  # stop ends it without waiting for the interval
    assert len(published) == 3
