"""Prefill scheduling policies: srpf keeps a returning turn's short compute short behind a cold prompt;
fcfs (the old order) makes it wait for the whole cold prompt. Pure scheduling: no tensors, a fake clock."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import SchedulePolicy, Scheduler, priority_weight
from shared.engine.sequence import Sequence, SeqStatus

B = 16
S = 1_000_000_000  # ns per second


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns


def make(kind: str, cap: int = 256, budget: int = 2048, blocks: int = 2048, aging_s: float = 30.0):
    clock = Clock()
    sched = Scheduler(BlockManager(blocks, B, b"ns"), budget, 32, True,
                      SchedulePolicy(kind, cap, aging_s), clock_ns=clock)
    return sched, clock


def seq(clock: Clock, rid: str, tokens: list[int]) -> Sequence:
    s = Sequence(rid, tokens, SamplingParams(max_tokens=4))
    s.arrival_ns = clock()
    return s


def run_step(sched: Scheduler) -> dict[str, int]:
    """One scheduled step, applied as the engine would (computed tokens advance, full blocks register)."""
    batch = sched.schedule()
    assert batch is not None and batch.is_prefill
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed += n
        full = s.num_computed // B
        if full > s.num_registered_blocks:
            sched.bm.register_full_blocks(s.block_table, s.token_ids, full, start_block=s.num_registered_blocks)
            s.num_registered_blocks = full
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}


def cache_on_device(sched: Scheduler, tokens: list[int]) -> None:
    """Leave `tokens` in the device prefix cache, as an earlier turn of the session would."""
    blocks = sched.bm.allocate(len(tokens) // B)
    sched.bm.register_full_blocks(blocks, tokens, len(blocks))
    sched.bm.release(reversed(blocks))


HISTORY = list(range(3440))                       # a session's history, cached on device
TURN = HISTORY + [7] * 142                        # its returning turn: 142 new tokens
COLD = [(i * 7919) % 40000 + 1 for i in range(4096)]  # another session's cold prompt


def test_srpf_runs_a_cached_turn_in_the_next_step_beside_a_cold_prompt():
    sched, clock = make("srpf")
    cache_on_device(sched, HISTORY)
    sched.add(seq(clock, "cold", COLD))
    assert run_step(sched) == {"cold": 256}       # one short step, not the whole 2048 budget
    clock.ns += S
    sched.add(seq(clock, "turn", TURN))
    step = run_step(sched)
    assert list(step) == ["turn", "cold"]         # the short one first
    assert step["turn"] == len(TURN) - 3440       # only its new tokens: the history is a device hit
    assert step["cold"] == 256                    # the cold prompt still progresses


def test_fcfs_makes_the_cached_turn_wait_for_the_whole_cold_prompt():
    sched, clock = make("fcfs", cap=0)
    cache_on_device(sched, HISTORY)
    sched.add(seq(clock, "cold", COLD))
    assert run_step(sched) == {"cold": 2048}
    sched.add(seq(clock, "turn", TURN))
    assert run_step(sched) == {"cold": 2048}      # the cold prompt takes the whole budget again
    assert "turn" in run_step(sched)


def test_srpf_cap_bounds_every_step_of_a_lone_prompt():
    sched, clock = make("srpf", cap=512)
    sched.add(seq(clock, "cold", COLD))
    steps = []
    while sched.running == [] or sched.running[0].num_uncomputed > 0:
        steps.append(run_step(sched)["cold"])
    assert steps == [512] * 8                     # the step computing the last token samples
    assert sum(steps) == len(COLD)


def test_srpf_aging_lets_a_long_waiting_prompt_go_before_a_fresh_short_one():
    sched, clock = make("srpf", budget=300, cap=300, aging_s=10.0)
    sched.add(seq(clock, "long", [3] * 1000))
    clock.ns += 100 * S                           # waited 100 s: counts as 1000 / 11 ~ 91 tokens
    sched.add(seq(clock, "short", [5] * 200))
    step = run_step(sched)
    assert step == {"long": 300}                  # the whole budget to the aged prompt


def test_srpf_a_higher_priority_prompt_goes_first_by_its_weight_and_past_the_cap():
    sched, clock = make("srpf", budget=300, cap=100)
    sched.add(seq(clock, "short", [5] * 200))
    urgent = seq(clock, "urgent", [3] * 1000)
    urgent.priority = 9                           # weight 10: counts as 100 tokens, fewer than short's 200
    sched.add(urgent)
    assert run_step(sched) == {"urgent": 300}    # the whole budget: the per-prompt cap is for priority <= 0
    meek = seq(clock, "meek", [7] * 150)
    meek.priority = -1                            # weight 1/2: counts as 300, more than short's 200
    sched.add(meek)
    assert run_step(sched) == {"urgent": 300}    # 700 left / 10 = 70: still first, and alone in its step
    sched.add(seq(clock, "also", [9] * 50))
    assert run_step(sched) == {"urgent": 300}
    assert run_step(sched) == {"urgent": 100}    # its last 100, still alone
    assert run_step(sched) == {"also": 50, "short": 100, "meek": 100}  # then the others, capped again
    assert priority_weight(0) == 1.0 and priority_weight(3) == 4.0 and priority_weight(-3) == 0.25


def test_srpf_steps_stay_short_for_others_while_priority_traffic_is_recent():
    """Within priority_window_s of a priority arrival the other prompts share priority_step_tokens a step, so
    the next priority prompt waits for a short step at most; a priority prompt itself is not held to it, and
    with no priority traffic (or once the window passed) the whole budget is used."""
    clock = Clock()
    sched = Scheduler(BlockManager(2048, B, b"ns"), 300, 32, True,
                      SchedulePolicy("srpf", 200, 30.0, priority_step_tokens=100, priority_window_s=60.0),
                      clock_ns=clock)
    sched.add(seq(clock, "a", [5] * 1000))
    sched.add(seq(clock, "b", [6] * 1000))
    assert run_step(sched) == {"a": 200, "b": 100}           # no priority yet: the whole budget
    urgent = seq(clock, "urgent", [3] * 400)
    urgent.priority = 2
    sched.add(urgent)
    assert run_step(sched) == {"urgent": 300}                 # not held to the short step
    assert run_step(sched) == {"urgent": 100}
    assert sum(run_step(sched).values()) == 100               # then the others: 100 a step in all
    clock.ns += 59 * S
    assert sum(run_step(sched).values()) == 100
    clock.ns += 2 * S                                         # the window passed: the whole budget again
    assert sum(run_step(sched).values()) == 300
    with pytest.raises(ValueError, match="priority_step_tokens"):
        SchedulePolicy("srpf", priority_step_tokens=-1)


def test_srpf_a_low_priority_prompt_still_gets_its_turn_by_aging():
    sched, clock = make("srpf", budget=300, cap=300, aging_s=10.0)
    low = seq(clock, "low", [3] * 400)
    low.priority = -3                             # weight 1/4: counts as 1600
    sched.add(low)
    clock.ns += 100 * S                           # waited 100 s: 1600 / 11 ~ 145
    high = seq(clock, "high", [5] * 600)
    high.priority = 3                             # weight 4: counts as 150
    sched.add(high)
    assert run_step(sched) == {"low": 300}


def test_srpf_short_arrivals_never_starve_a_cold_prompt():
    sched, clock = make("srpf", budget=512, cap=256)
    sched.add(seq(clock, "cold", COLD))
    progressed = 0
    for i in range(20):
        clock.ns += S // 2
        sched.add(seq(clock, f"short-{i}", [i + 100] * 40))
        step = run_step(sched)
        progressed += step.get("cold", 0)
        for s in list(sched.running):  # shorts finish after their step (prefill-only instances)
            if s.request_id.startswith("short") and s.num_uncomputed <= 1:
                sched.finish(s, "abort")
    assert progressed == len(COLD)                # 256 a step beside each short one: done in 16 of 20 steps


def test_srpf_skips_a_prompt_that_does_not_fit_and_runs_one_that_does():
    sched, clock = make("srpf", blocks=20, cap=256)
    big = seq(clock, "big", [9] * 600)
    sched.add(big)
    hog = sched.bm.allocate(10)                   # only 10 blocks (160 tokens) left
    clock.ns += S
    sched.add(seq(clock, "small", [4] * 100))
    assert run_step(sched) == {"small": 100}
    assert big.status is SeqStatus.WAITING and not big.block_table  # nothing held while it waits
    sched.finish(sched.running[0], "abort")       # small is done: 10 blocks free, big needs 16
    clock.ns += 119 * S                           # big waited 120 s: it counts as 600 / 5 = 120 tokens
    sched.add(seq(clock, "late", [6] * 150))      # would fit in 10 blocks, but ranks after big
    assert sched.schedule() is None               # an old prompt that does not fit is not overtaken
    sched.bm.release(hog)
    assert run_step(sched) == {"big": 256}


def test_policy_validates_its_settings():
    with pytest.raises(ValueError, match="fcfs or srpf"):
        SchedulePolicy("lifo")
    with pytest.raises(ValueError):
        SchedulePolicy("srpf", -1)
