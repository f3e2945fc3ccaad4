"""PageWarmer: the KV blocks the block manager hands out next are made resident ahead of need, in the
background, without changing a byte; the window follows allocations. Residency is read with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine, EngineConfig, warm_ahead_bytes
from shared.engine.models import load_model
from shared.engine.page_warmer import PageWarmer
from shared.kv_layout import KVLayout, allocate_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_share(pages: torch.Tensor, lo: int, hi: int) -> float:
    """Share of the 4 KiB pages of blocks [lo, hi) that are in memory."""
    bb = pages[0].numel() * pages.element_size()
    a, z = pages.data_ptr() + lo * bb, pages.data_ptr() + hi * bb
    a += -a % mmap.PAGESIZE  # whole pages inside the range only
    z -= z % mmap.PAGESIZE
    vec = np.zeros((z - a) // mmap.PAGESIZE, dtype=np.uint8)
    assert _libc.mincore(a, z - a, vec.ctypes.data) == 0, ctypes.get_errno()
    return float((vec & 1).mean())


LAYOUT = KVLayout(4, 2, 64, dtype=torch.float32)  # the tiny model's: 64 KiB per 16-token block


def fresh_pages(num_blocks: int) -> list[torch.Tensor]:
    """Pages in a new anonymous mapping: nothing resident until touched, whatever the allocator recycles
    (allocate_pages' calloc may hand a test process memory it freed before, already resident)."""
    shape = LAYOUT.page_shape(0, num_blocks)
    m = mmap.mmap(-1, int(np.prod(shape)) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return [torch.frombuffer(m, dtype=torch.float32).view(shape)]


def test_window_made_resident_then_follows_allocations():
    pages = fresh_pages(1024)
    assert resident_share(pages[0], 0, 1024) < 0.05
    bm = BlockManager(1024, LAYOUT.block_size)
    warmer = PageWarmer(pages, ahead_blocks=64, step_bytes=1 << 20)
    bm.on_allocate = warmer.allocated
    try:
        assert warmer.wait_idle()
        assert resident_share(pages[0], 0, 64) == 1.0
        assert resident_share(pages[0], 128, 1024) < 0.05  # only the window, not the pool
        bm.allocate(100)  # blocks 0..99 out: the window is now [100, 164)
        assert warmer.wanted == 164
        assert warmer.wait_idle()
        assert resident_share(pages[0], 100, 164) == 1.0
        assert resident_share(pages[0], 200, 1024) < 0.05
        assert not pages[0].any()  # no byte changed
    finally:
        warmer.close()


def test_blocks_already_written_keep_every_byte():
    """The warmer faults pages in by adding 0 to a word of each: bytes already there stay as they are."""
    pages = fresh_pages(256)
    pattern = torch.arange(pages[0][:40].numel(), dtype=torch.float32).view_as(pages[0][:40]) + 0.5
    pages[0][:40] = pattern
    warmer = PageWarmer(pages, ahead_blocks=128, step_bytes=1 << 20)
    try:
        assert warmer.wait_idle() and resident_share(pages[0], 0, 128) == 1.0
        assert torch.equal(pages[0][:40], pattern) and not pages[0][40:].any()
    finally:
        warmer.close()


def test_window_stops_at_the_pool_end():
    pages = fresh_pages(64)
    warmer = PageWarmer(pages, ahead_blocks=1000)
    try:
        assert warmer.ahead == 64
        warmer.allocated([63])
        assert warmer.wanted == 64 and warmer.wait_idle()
        assert resident_share(pages[0], 0, 64) == 1.0
    finally:
        warmer.close()


def test_off_starts_no_thread():
    warmer = PageWarmer(allocate_pages(LAYOUT, 64), ahead_blocks=0)
    assert warmer._warmer is None and not warmer.running
    warmer.allocated([10])
    assert warmer.wanted == 0


@pytest.mark.parametrize("spec, pool, expected", [("0", 1 << 30, 0), ("off", 1 << 30, 0),
                                                   ("512MiB", 1 << 30, 512 << 20), ("10%", 1000, 100)])
def test_warm_ahead_bytes(spec, pool, expected):
    assert warm_ahead_bytes(spec, pool) == expected


def test_bad_warm_ahead_is_a_config_error():
    with pytest.raises(ValueError, match="kv_warm_ahead"):
        EngineConfig(kv_warm_ahead="lots")


def test_engine_warms_ahead_of_its_scheduler():
    """The engine wires the warmer to its block manager: a prompt's blocks move the window."""
    engine = Engine(load_model("tiny"), EngineConfig(num_blocks=256, kv_warm_ahead="2MiB"))
    try:
        assert engine.page_warmer.ahead == 32
        assert engine.page_warmer.wait_idle()
        engine.block_manager.allocate(40)
        assert engine.page_warmer.wanted == 72 and engine.page_warmer.wait_idle()
        assert resident_share(engine.pages[0], 40, 72) == 1.0
    finally:
        engine.page_warmer.close()


def test_dropped_engine_frees_its_pages_and_thread():
    """Dropping the warmer (an engine without close) stops and joins its thread, then frees the pages."""
    import gc
    import weakref
    pages = fresh_pages(4096)
    ref = weakref.ref(pages[0])
    warmer = PageWarmer(pages, ahead_blocks=8)
    stopper = warmer._stopper
    assert warmer.running and warmer.wait_idle()
    del warmer, pages
    gc.collect()
    assert not stopper.alive  # stop() ran: the thread was joined before the pages could go
    assert ref() is None


def test_the_warmer_thread_never_takes_the_gil():
    """The warmer makes progress while this thread holds the GIL without a break: it is a native thread that
    never asks for the GIL, so the engine never hands the GIL to a thread the scheduler may leave waiting."""
    import threading
    import time
    pages = fresh_pages(4096)  # 256 MiB of fresh blocks: most of a second of populating
    switch = sys.getswitchinterval()
    sys.setswitchinterval(60)  # no forced GIL switch: no other Python thread runs during the loop below
    try:
        warmer = PageWarmer(pages, ahead_blocks=4096, step_bytes=1 << 20)
        before, t0 = warmer.warmed, time.monotonic()
        while time.monotonic() - t0 < 1.0:  # a nice-19 thread: the other core is idle meanwhile
            pass
        during = warmer.warmed
    finally:
        sys.setswitchinterval(switch)
    try:
        assert not any("warm" in t.name for t in threading.enumerate())
        assert during > before
        assert warmer.wait_idle(60) and resident_share(pages[0], 0, 4096) == 1.0
    finally:
        warmer.close()
    assert not warmer.running
    warmer.close()  # twice: nothing left to stop
