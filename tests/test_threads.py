"""Threads start while a service starts, never on the request path (shared/threads.py, issue 33: starting one
held a saturated decode's event loop for 0.8 s)."""

from __future__ import annotations

import threading

from shared.threads import started_executor


def test_every_worker_is_running_before_the_first_task():
    before = {t.ident for t in threading.enumerate()}
    pool = started_executor(3, "probe")
    try:
        started = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("probe")]
        assert len(started) == 3 and all(t.is_alive() for t in started)
        assert pool.submit(threading.get_ident).result() in {t.ident for t in started}  # reused, none new
        assert len([t for t in threading.enumerate() if t.name.startswith("probe")]) == 3
    finally:
        pool.shutdown()


def test_the_engine_loop_thread_exists_before_its_first_step(tiny):
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.loop import EngineLoop

    async def nothing(outputs):
        return None

    before = {t.ident for t in threading.enumerate()}
    loop = EngineLoop(Engine(tiny, EngineConfig(num_blocks=16)), nothing)
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("engine")]
    loop._executor.shutdown()
