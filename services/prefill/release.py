"""Prefill lets go of a decode's grant: PagesReleased, asked until decode acknowledges it.

A handoff that fails or is cancelled after decode granted it blocks (the direct handoff's pages, or the staged
one's landing and slots) tells decode so, and decode gives them to others at once. A plain publish was lost when
the bus restarted between the grant and the release: decode, not yet subscribed again, held the blocks until its
expiry (transfer.timeout_s). So the release is a request, asked again after RELEASE_RETRY_S (doubling, at most
RELEASE_RETRY_MAX_S) until decode answers, or until transfer.timeout_s has passed (then decode's own expiry has
freed the blocks). A release that overtakes its grant is safe: decode remembers the id as cancelled and refuses
or undoes the grant.
"""

from __future__ import annotations

import asyncio
import time

from shared.bus import Bus
from shared.messages import Ack, PagesReleased

RELEASE_ASK_S = 1.0  # one PagesReleased awaits decode's Ack this long
RELEASE_RETRY_S, RELEASE_RETRY_MAX_S = 0.25, 2.0  # then asks again after this, doubling


class GrantReleases:
    def __init__(self, bus: Bus, timeout_s: float):
        self.bus, self.timeout_s = bus, timeout_s
        self.pending: set[asyncio.Future] = set()  # releases not yet acknowledged

    def release(self, decode: str, request_id: str) -> None:
        """Returns at once; the release is asked until decode acknowledges it."""
        task = asyncio.ensure_future(self._acked(decode, request_id))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _acked(self, decode: str, request_id: str) -> None:
        subject, deadline, pause = self.bus.subjects.decode_pages_released(decode), \
            time.monotonic() + self.timeout_s, RELEASE_RETRY_S
        while True:
            try:
                await self.bus.request(subject, PagesReleased(request_id), Ack, timeout=RELEASE_ASK_S)
                return
            except Exception:  # no responders (decode reconnecting, or gone) or no answer yet
                if time.monotonic() + pause > deadline:
                    return
                await asyncio.sleep(pause)
                pause = min(2 * pause, RELEASE_RETRY_MAX_S)

    async def close(self) -> None:
        """The service stops: stop asking."""
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
