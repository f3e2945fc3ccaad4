"""Orphans: requests an engine still serves for a router that has let go of them.

Every `router.holdings_interval_s` a router publishes its `Holdings`: the requests its process still
serves. The gate reads it to free lost Releases; prefill and decode read it to end what nobody waits for
any more. A request is an orphan when the router instance that sent it lists it no longer, and it has
been here at least `grace_s` (a Holdings may be sent just before the request it omits): its router
process was killed (the restarted one lists only its own requests) or ended it and the Cancel was lost.
Without this, a request submitted before the gate's answer (overlapped admission) whose router then died
would hold its KV until `assign_timeout_s`, and a decode would generate up to max_tokens for nobody.

A router process that ends is announced by its supervisor (InstanceExited): `exit_holdings` is the empty
list it can no longer send, and engines apply it with no grace. A router that dies unannounced and never
comes back sends nothing: its requests end by their own timeouts. Pure logic, clock passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from shared.messages import Holdings, InstanceExited

ORPHAN_REASON = "its router no longer holds it (restarted or lost the request)"


class Served(NamedTuple):
    """One request an engine serves: its bus id, the router instance that sent it ("" = unknown: never
    an orphan) and when it arrived (monotonic seconds)."""
    request_id: str
    router: str
    since: float


def orphans(served: Iterable[Served], msg: Holdings, now: float, grace_s: float) -> list[str]:
    """The request ids in `served` that `msg`'s router sent, no longer lists and that arrived at least
    `grace_s` before `now`."""
    if not msg.router or not all(isinstance(rid, str) for rid in msg.request_ids):
        return []  # never end requests on a list we cannot read
    held = set(msg.request_ids)
    cutoff = now - grace_s
    return [s.request_id for s in served
            if s.router == msg.router and s.request_id not in held and s.since <= cutoff]


def exit_holdings(msg: InstanceExited) -> Holdings:
    """What an ended router process holds: nothing (apply with grace 0: it can send no request any more)."""
    return Holdings(msg.instance, msg.boot, [])
