"""Prefill's registered staging buffers for handoffs: windows are gathered into them and written from them."""

from __future__ import annotations

import asyncio

import torch

from shared.device_staging import host_buffer
from shared.transfer import KVTransport


class StagingPool:
    """Registered staging buffers (one slot plus two tokens each), shared by all handoffs of this instance.

    A handoff may gather a window before decode granted it a slot (speculatively), but only while at
    least half the pool, and never the last two buffers, would stay free: a handoff that holds slots then
    always finds a buffer, or one held by another slot holder that writes and returns it. Without that
    rule handoffs holding buffers but no slots and handoffs holding slots but no buffers could wait on
    each other until their timeout.
    """

    def __init__(self, transport: KVTransport, count: int, nbytes: int, device: torch.device):
        # Pinned when the pages are a GPU's (`device`); written once now, so no gather or write ever
        # page-faults its way into a fresh buffer.
        self.buffers = [host_buffer(nbytes, device).fill_(0) for _ in range(count)]
        for b in self.buffers:
            transport.register(b)
        self._free = list(range(count))
        self._changed: asyncio.Future | None = None

    def _speculation_ok(self) -> bool:
        return len(self._free) >= 2 and 2 * len(self._free) > len(self.buffers)

    async def take(self, credited, speculate=lambda: True) -> int:
        """A free buffer, for a window that has a slot (`credited()`) or may be gathered ahead (`speculate()`:
        its bytes are known to be sent)."""
        while not (self._free and (credited() or (speculate() and self._speculation_ok()))):
            if self._changed is None or self._changed.done():
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)
        return self._free.pop()

    def poke(self) -> None:
        """Wake the waiters: buffers came back, or a handoff got slots."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def give_back(self, ids: list[int]) -> None:
        self._free += ids
        self.poke()
