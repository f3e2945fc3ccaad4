"""EngineLoop.call_now: queueing a request (or pinning blocks no running sequence owns) does not wait for
the step in flight, which may be a long prompt's chunk; the output is the same as without the overlap."""

from __future__ import annotations

import asyncio
import threading

from shared.engine.engine import Engine, EngineConfig
from shared.engine.loop import EngineLoop
from shared.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


async def test_a_request_is_queued_while_a_step_computes(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    expected = Engine(tiny, EngineConfig(num_blocks=64)).generate([[5, 6, 7, 8] * 20], GREEDY)[0].output_ids
    in_forward, release = threading.Event(), threading.Event()
    run = engine.runner.run

    def slow_run(batch):  # the first forward blocks until the test lets it go
        if not release.is_set():
            in_forward.set()
            release.wait(30)
        return run(batch)

    engine.runner.run = slow_run
    done: dict[str, list[int]] = {}
    finished = asyncio.Event()

    async def on_outputs(outputs):
        for o in outputs:
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not engine.has_unfinished():
            finished.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    try:
        await loop.call_now(lambda: engine.add_request("cold", [9, 10, 11] * 40, GREEDY))
        assert await asyncio.to_thread(in_forward.wait, 30)  # a step is computing "cold"
        await asyncio.wait_for(loop.call_now(lambda: engine.add_request("turn", [5, 6, 7, 8] * 20, GREEDY)), 2)
        assert engine.sequences["turn"] in engine.scheduler.waiting  # queued while the forward runs
        release.set()
        await asyncio.wait_for(finished.wait(), 60)
    finally:
        release.set()
        await loop.stop()
    assert done["turn"] == expected
    assert engine.block_manager.num_free_blocks == 64
    engine.block_manager.check_integrity()


def test_changed_wakes_waiters_on_a_call_and_times_out_otherwise():
    """Waiters for free blocks (the pool's restore) are woken by engine activity, not by polling."""
    from shared.engine.models import load_model

    async def main():
        engine = Engine(load_model("tiny"), EngineConfig(model="tiny", num_blocks=64))

        async def on_outputs(_outputs):
            pass

        loop = EngineLoop(engine, on_outputs)
        loop.start()
        try:
            t0 = asyncio.get_running_loop().time()
            assert await loop.changed(0.05) is False
            assert asyncio.get_running_loop().time() - t0 >= 0.04
            waiter = asyncio.create_task(loop.changed(30))
            await asyncio.sleep(0)
            await loop.call_now(lambda: None)
            assert await asyncio.wait_for(waiter, 5) is True
            waiter = asyncio.create_task(loop.changed(30))
            await asyncio.sleep(0)
            await loop.call(lambda: None)
            assert await asyncio.wait_for(waiter, 5) is True
            assert await loop.changed(0) is False
        finally:
            await loop.stop()

    asyncio.run(main())
