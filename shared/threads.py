"""Worker threads started up front, never on the request path.

Python's ThreadPoolExecutor starts a thread the first time a task finds none idle, and `submit` waits
until the new thread runs. Starting a thread maps its stack, a writer on the process's mmap lock, so it
waits behind every page fault in flight. On a saturated host (a CPU hog on each core, a handoff faulting
fresh KV pages in) that wait held decode's event loop for 0.8-0.9 s (issue 33; prefill's first step sat 4 s
behind its engine thread's start). A service starts its threads while it starts.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

STARTUP_WAIT_S = 120.0  # how long starting the threads may take (a loaded box at start-up)


def started_executor(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose `workers` threads are all running when it is returned."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait, STARTUP_WAIT_S) for _ in range(workers)]:
        future.result()  # each task holds its thread until all have one: every thread is started
    return pool


def default_workers() -> int:
    """asyncio's default executor size (the same rule as ThreadPoolExecutor's default)."""
    return min(32, (os.cpu_count() or 1) + 4)
