"""The faults that reach the KV handoff (tests/test_faults.py), on the same system with its pages deliberately not
registered with the Transfer Engine: every handoff is staged (gather on the pages' device into a scratch buffer,
landing slots, scatter), the path a GPU's KV takes, with decode reuse on. A disconnect storm, kill -9 of prefill
and of decode, and a NATS restart: no wrong token, no budget or KV left held, every request in flight ended
cleanly, and a new request answered within the bound (the same checks, `check_fault`)."""

from __future__ import annotations

import pytest

from bench.faults import QUICK, harness
from bench.faults_inject import FAULTS, Fault
from tests.test_faults import check_fault

pytestmark = pytest.mark.slow

STAGED = ("disconnect storm", "kill -9 prefill-0", "kill -9 decode-0", "NATS restart")


@pytest.fixture(scope="module")
def staged_faults(tmp_path_factory):
    extra = [f"{role}.transfer.register_pages=false" for role in ("prefill", "decode")]
    with harness(str(tmp_path_factory.mktemp("faults-staged")), QUICK, extra) as h:
        yield h


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.name in STAGED],
                         ids=[f.name.replace(" ", "_") for f in FAULTS if f.name in STAGED])
def test_fault_under_load_through_the_staged_handoff(staged_faults, fault: Fault):
    check_fault(staged_faults.run(fault), fault)
