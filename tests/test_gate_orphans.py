"""Two leaks found by bench/faults.py, both at the router/gate seam.

1. A router killed with kill -9 never releases what it reserved at the gate. Its restarted process (same
instance, another boot id in its load reports) makes the gate drop the old process's reservations and
waiting requests at once, instead of after reservation_ttl_s (found by bench/faults.py: 574 budget tokens
held after kill -9 of router-0 under load).
2. An admit held by a gate that dies (or lost with the bus) is never answered: the router now watches the
gates while it waits, so the request ends (503, or a retry on another gate) when one is gone."""

from __future__ import annotations

import asyncio
import time

import opentelemetry.trace
import pytest

from services.gate.admission import Admission, Admitted, Rejected, Wait
from services.gate.config import GateSettings
from services.router.config import RouterSettings
from services.router.dispatch import Dispatch, InstanceLost, Job, RouterState
from services.router.routing import LoadTable, make_picker
from services.router.schemas import OpenAIError
from shared.engine.sampling import SamplingParams
from shared.bus import Subjects
from shared.logging import get_logger
from shared.messages import AdmitReply, LoadReport


def gate() -> Admission:
    a = Admission(GateSettings(budget_fraction=1.0))
    a.report("decode-0", 1000, 1000, True, 0.0)
    return a


def test_a_restarted_router_frees_what_its_previous_process_held():
    a = gate()
    assert a.router_report("router-0", "boot-a", 0.0) == ([], [])  # first seen: nothing to drop
    assert a.router_report("router-1", "boot-x", 0.0) == ([], [])
    assert isinstance(a.admit("r1", 300, 100, 0.1, owner="boot-a"), Admitted)
    assert isinstance(a.admit("r2", 300, 100, 0.1, owner="boot-x"), Admitted)   # another router's
    assert isinstance(a.admit("r3", 300, 100, 0.1, owner="boot-a"), Wait)       # over budget: waits
    assert a.router_report("router-0", "boot-a", 1.0) == ([], [])  # the same process again: nothing
    dropped, waiting = a.router_report("router-0", "boot-b", 2.0)  # restarted
    assert [r.request_id for r in dropped] == ["r1"] and waiting == ["r3"]
    assert set(a.reservations) == {"r2"} and not a.queue
    assert a.instances["decode-0"].reserved == 400
    assert a.counters["orphaned"] == 1 and a.counters["cancelled"] == 1
    assert a.release("r1", 3.0) == "duplicate"  # a late release of the dead process changes nothing
    a.check_integrity()


def test_an_exited_router_loses_what_it_held_at_once_and_its_late_reports_change_nothing():
    a = gate()
    a.router_report("router-0", "boot-a", 0.0)
    assert isinstance(a.admit("r1", 300, 100, 0.1, owner="boot-a"), Admitted)
    assert isinstance(a.admit("r2", 300, 400, 0.1, owner="boot-a"), Wait)
    dropped, waiting = a.router_exited("router-0", "boot-a", 0.2)
    assert [r.request_id for r in dropped] == ["r1"] and waiting == ["r2"]
    assert not a.reservations and not a.queue and a.counters["exited"] == 1
    assert a.router_report("router-0", "boot-a", 0.3) == ([], []) and "boot-a" not in a.router_seen
    assert a.router_exited("router-0", "", 0.4) == ([], [])  # nothing known of it any more
    a.check_integrity()


def test_an_exited_decode_is_not_chosen_until_a_new_process_reports():
    a = gate()
    a.report("decode-0", 1000, 1000, True, 0.0, boot="d1")
    assert a.instance_exited("decode-0", "d1")
    refused = a.admit("r1", 10, 10, 0.1)  # the only decode is gone: 503 with Retry-After, no wait
    assert isinstance(refused, Rejected) and refused.unavailable
    a.report("decode-0", 1000, 1000, True, 0.2, boot="d1")  # sent before it died, delivered after
    assert isinstance(a.admit("r2", 10, 10, 0.2), Rejected)
    a.report("decode-0", 1000, 1000, True, 1.0, boot="d2")  # restarted
    assert isinstance(a.admit("r3", 10, 10, 1.0), Admitted)
    assert not a.instance_exited("decode-0", "d0")  # an earlier process: the live one stays
    assert a.live(a.instances["decode-0"], 1.1)


def test_reports_without_a_boot_id_drop_nothing():
    a = gate()
    a.router_report("router-0", "", 0.0)
    assert isinstance(a.admit("r1", 10, 10, 0.1), Admitted)
    assert a.router_report("router-0", "", 1.0) == ([], []) and "r1" in a.reservations
    a.router_report("router-0", "boot-a", 2.0)  # an owner-less reservation is nobody's to drop
    assert a.router_report("router-0", "boot-b", 3.0) == ([], []) and "r1" in a.reservations



def test_a_router_silent_past_router_timeout_loses_what_it_held():
    """A router killed and never restarted (or cut off) sends no load report and no Release: what its process
    held is dropped after gate.router_timeout_s, not after reservation_ttl_s (900 s). Silence counts only
    from when the gate could hear (heard_since: its bus connection was restored then)."""
    a = Admission(GateSettings(budget_fraction=1.0, router_timeout_s=30.0))
    a.report("decode-0", 1000, 1000, True, 0.0)
    a.router_report("router-0", "boot-a", 0.0)
    a.router_report("router-1", "boot-x", 0.0)
    assert isinstance(a.admit("r1", 300, 100, 0.1, owner="boot-a"), Admitted)
    assert isinstance(a.admit("r2", 300, 100, 0.1, owner="boot-x"), Admitted)
    assert isinstance(a.admit("unknown-router", 10, 0, 0.2, owner="boot-never-reported"), Admitted)  # never
    #                                                        reported: never "gone" (the TTL still applies)
    assert isinstance(a.admit("r3", 500, 0, 0.2, owner="boot-a"), Wait)          # over budget: waits
    a.router_report("router-1", "boot-x", 20.0)                                   # still reporting
    out = a.expire(29.9)
    assert not out.gone and not out.gone_waiting
    out = a.expire(30.0, heard_since=25.0)                                        # deaf until 25: not yet
    assert not out.gone and not out.gone_waiting and "r1" in a.reservations
    a.router_report("router-1", "boot-x", 50.0)
    out = a.expire(55.0, heard_since=25.0)
    assert [r.request_id for r in out.gone] == ["r1"] and out.gone_waiting == ["r3"]
    assert set(a.reservations) == {"r2", "unknown-router"} and a.counters["router_gone"] == 1
    assert "router-0" not in a.routers and "boot-a" not in a.router_seen
    assert a.release("r1", 56.0) == "duplicate"
    a.router_report("router-0", "boot-b", 60.0)                                   # it comes back: a fresh start
    assert a.expire(61.0).gone == []
    a.check_integrity()


def test_router_timeout_zero_turns_the_silence_rule_off():
    a = Admission(GateSettings(budget_fraction=1.0, router_timeout_s=0.0))
    a.report("decode-0", 1000, 1000, True, 0.0)
    a.router_report("router-0", "boot-a", 0.0)
    assert isinstance(a.admit("r1", 300, 100, 0.1, owner="boot-a"), Admitted)
    out = a.expire(500.0)
    assert not out.gone and "r1" in a.reservations

# ---- the router side: an admit held by a gate that dies is not waited on for admission_timeout_s ----------
async def test_an_admit_held_by_a_gate_that_goes_ends_when_the_gate_is_gone_not_after_the_timeout():
    """Found by bench/faults.py: kill -9 of the gate (or of nats-server) while a request waited for its
    AdmitReply cost router.admission_timeout_s (40 s) before the 503."""
    asked = asyncio.Event()

    class SilentGateBus:  # the gate got the admit and died: no reply ever comes
        subjects = Subjects("moorage")
        nc = None

        async def request(self, subject, msg, reply_type, timeout):
            asked.set()
            await asyncio.sleep(timeout)
            raise AssertionError("waited for the admission timeout")

        async def publish(self, subject, msg):
            pass

    settings = RouterSettings(admission_timeout_s=40.0, overlap_admission=False)  # the admit alone, then submit
    loads = LoadTable(settings.instance_timeout_s)
    state = RouterState(settings, SilentGateBus(), None, 4096, loads, make_picker("p2c", loads, 60.0))
    for role in ("gate", "decode", "prefill"):
        state.picker.update(LoadReport(f"{role}-0", role, True, 1000, 1000), state.clock())
    d = Dispatch(state, Job("req-1", None, [1, 2, 3], SamplingParams(max_tokens=4)), opentelemetry.trace.INVALID_SPAN,
                 get_logger("test"), time.monotonic() + 60)
    start = asyncio.create_task(d.start())
    await asyncio.wait_for(asked.wait(), 5)
    t0 = time.monotonic()
    state.picker.update(LoadReport("gate-0", "gate", False, detail={"unhealthy": "stopped"}), state.clock())  # bye
    with pytest.raises(InstanceLost) as lost:
        await asyncio.wait_for(start, 5)
    assert lost.value.role == "gate" and lost.value.status == 503 and time.monotonic() - t0 < 1.0
    await d.close("test")
    await state.monitor.close()


# ---- 3. a Release lost with the bus: the router's Holdings frees it ---------------------------------------
def test_holdings_drop_what_the_router_no_longer_lists_after_the_grace():
    """Found by bench/faults.py: kill -9 (or a restart) of nats-server under load left one reservation
    (211 tokens) held after the load stopped: its Release went out while the bus was down."""
    a = Admission(GateSettings(budget_fraction=1.0, holdings_grace_s=5.0))
    a.report("decode-0", 1000, 1000, True, 0.0)
    assert isinstance(a.admit("lost", 300, 100, 0.0, owner="boot-a"), Admitted)
    assert isinstance(a.admit("live", 100, 100, 0.0, owner="boot-a"), Admitted)
    assert isinstance(a.admit("other", 100, 100, 0.0, owner="boot-x"), Admitted)     # another router's
    assert isinstance(a.admit("fresh", 100, 100, 4.0, owner="boot-a"), Admitted)     # within the grace
    assert isinstance(a.admit("queued", 400, 0, 0.5, owner="boot-a"), Wait)          # over budget: waits
    assert isinstance(a.admit("queued-live", 10, 0, 0.5, owner="boot-a"), Wait)      # behind it (FIFO)
    dropped, waiting = a.reconcile("boot-a", {"live", "queued-live"}, 6.0)
    assert [r.request_id for r in dropped] == ["lost"] and waiting == ["queued"]
    assert set(a.reservations) == {"live", "other", "fresh"} and list(a.queue) == ["queued-live"]
    assert a.instances["decode-0"].reserved == 600 and a.counters["reconciled"] == 1
    assert a.release("lost", 7.0) == "duplicate"   # the lost Release, if it turns up after all
    assert a.reconcile("", set(), 100.0) == ([], [])  # an owner-less list names nobody
    assert a.reconcile("boot-unknown", set(), 100.0) == ([], [])
    a.check_integrity()


class _AdmitBus:
    """The gate's side of one admit: `reply` (an AdmitReply) or `error` (the reply never came)."""
    subjects = Subjects("moorage")
    nc = None

    def __init__(self, reply=None, error: Exception | None = None):
        self.reply, self.error, self.published = reply, error, []

    async def request(self, subject, msg, reply_type, timeout):
        if self.error is not None:
            raise self.error
        return self.reply

    async def publish(self, subject, msg):
        self.published.append(msg)


async def _dispatch(bus) -> tuple[RouterState, Dispatch]:
    settings = RouterSettings(overlap_admission=False)  # the admit alone, then submit
    loads = LoadTable(settings.instance_timeout_s)
    state = RouterState(settings, bus, None, 4096, loads, make_picker("p2c", loads, 60.0))
    for role in ("gate", "decode", "prefill"):
        state.picker.update(LoadReport(f"{role}-0", role, True, 1000, 1000), state.clock())
    return state, Dispatch(state, Job("req-1", None, [1, 2, 3], SamplingParams(max_tokens=4)), opentelemetry.trace.INVALID_SPAN,
                           get_logger("test"), time.monotonic() + 60)


async def test_the_router_lists_an_admit_whose_reply_was_lost_until_it_sent_the_release():
    state, d = await _dispatch(_AdmitBus(error=asyncio.TimeoutError()))
    with pytest.raises(OpenAIError) as e:
        await d.start()
    assert e.value.status == 503 and state.holding == {"req-1"}  # the gate may have reserved it: listed until released
    await d.close("admit timed out")
    assert state.holding == set() and [m.KIND for m in d.bus.published] == ["release"]
    await state.monitor.close()


async def test_a_refused_admit_is_not_listed_and_not_released():
    state, d = await _dispatch(_AdmitBus(reply=AdmitReply("req-1", "rejected", reason="full", retry_after_s=1.0)))
    with pytest.raises(OpenAIError) as e:
        await d.start()
    assert e.value.status == 429 and state.holding == set()
    await d.close("rejected")
    assert d.bus.published == []
    await state.monitor.close()
