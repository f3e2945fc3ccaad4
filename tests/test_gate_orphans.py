"""A router killed with kill -9 never releases what it reserved at the gate. Its restarted process (same
instance, another boot id in its load reports) makes the gate drop the old process's reservations and
waiting requests at once, instead of after reservation_ttl_s (found by bench/faults.py: 574 budget tokens
held after kill -9 of router-0 under load)."""

from __future__ import annotations

from services.gate.admission import Admission, Admitted, Wait
from services.gate.config import GateSettings


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


def test_reports_without_a_boot_id_drop_nothing():
    a = gate()
    a.router_report("router-0", "", 0.0)
    assert isinstance(a.admit("r1", 10, 10, 0.1), Admitted)
    assert a.router_report("router-0", "", 1.0) == ([], []) and "r1" in a.reservations
    a.router_report("router-0", "boot-a", 2.0)  # an owner-less reservation is nobody's to drop
    assert a.router_report("router-0", "boot-b", 3.0) == ([], []) and "r1" in a.reservations
