"""What one request's trace must look like (shared by the jsonl and the Phoenix tests): every span's
parent and service, for a request whose history was restored from the pool and handed off in rounds."""

from __future__ import annotations

import httpx
import torch

# span -> (its parent's name, the service that records it); router.request is the root
EXPECTED = {
    "router.request": (None, "router"),
    "gate.admit": ("router.request", "gate"),
    "store.lookup": ("router.request", "prefill"),
    "store.restore": ("router.request", "prefill"),
    "prefill.queue": ("router.request", "prefill"),
    "prefill.compute": ("router.request", "prefill"),
    "kv.handoff": ("router.request", "prefill"),
    "kv.gather": ("kv.handoff", "prefill"),
    "kv.write": ("kv.handoff", "prefill"),
    "decode.slot_grant": ("kv.handoff", "decode"),  # but the first: see EARLY
    "decode.scatter": ("kv.handoff", "decode"),
    "decode.generate": ("router.request", "decode"),
}

# The staged handoff asks for its first landing slot while the prompt's last step computes, before kv.handoff
# begins: that one grant is the request's child, as the direct handoff's early page grant is.
EARLY = ("decode.slot_grant", "router.request")

# A system whose one prefill has 80 device blocks (1,280 tokens of tiny's KV): a second history in the
# same session evicts the first, so its next turn restores 2 chunks from the pool. The handoff is the
# staged one (gather, landing slots, scatter: the direct handoff's spans are checked in test_e2e.py),
# and small slots make it several rounds.
SYSTEM = ["up.model=tiny", "up.store_bytes=67108864", "up.ready_timeout_s=180", "up.stores=1",
          "prefill.engine.num_blocks=80", "prefill.pool.min_restore_tokens=256", "decode.engine.num_blocks=512",
          "prefill.transfer.direct=false", "prefill.transfer.slot_bytes=262144", "decode.transfer.slot_bytes=262144",
          "decode.transfer.slots=4"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(base: str, prompt: list[int], session: str, max_tokens: int = 8) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=300, headers={"X-Session-ID": session}, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def restored_turn(base: str, session: str = "traced") -> list[str]:
    """Three requests of one session; the last restores its history from the pool. Their request ids."""
    history = tokens(1, 700)
    first = complete(base, history, session)
    evict = complete(base, tokens(2, 1200), session)
    last = complete(base, history + tokens(3, 60), session)
    assert last["usage"]["moorage"]["store"] > 0, last["usage"]
    return ["req-" + b["id"].split("-", 1)[1] for b in (first, evict, last)]


def arrived(spans: list[dict]) -> bool:
    """Whether every span of the trace has arrived: each expected name, and as many gathers, writes and scatters
    as its kv.handoff says it made (exporters send in batches, and a trace UI may store a batch before the one
    sent ahead of it)."""
    names = [s["name"] for s in spans]
    if not set(EXPECTED) <= set(names):
        return False
    handoff = next(s for s in spans if s["name"] == "kv.handoff")["attributes"]
    return (names.count("kv.gather") >= handoff.get("writes", 0)
            and min(names.count("kv.write"), names.count("decode.scatter")) >= handoff.get("rounds", 0))


def check_tree(spans: list[dict]) -> dict[str, list[dict]]:
    """Asserts one trace's parentage and services against EXPECTED; returns its spans by name."""
    assert len({s["trace_id"] for s in spans}) == 1
    by_id = {s["span_id"]: s for s in spans}
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    missing = set(EXPECTED) - set(by_name)
    assert not missing, f"missing spans: {sorted(missing)} (have {sorted(by_name)})"
    handoff = by_name["kv.handoff"][0]["attributes"]
    early = 0
    for s in spans:
        parent = by_id.get(s["parent_span_id"]) if s["parent_span_id"] else None
        want_parent, want_service = EXPECTED.get(s["name"], ("router.request", None))  # store.save etc.
        got = parent["name"] if parent else None
        if (s["name"], got) == EARLY:
            early += 1
        else:
            assert got == want_parent, f"{s['name']}: parent {got}"
        if want_service:
            assert s["service"] == want_service, f"{s['name']} recorded by {s['service']}"
    assert early == (1 if handoff["early_grant"] else 0), f"{early} early slot grants, handoff {handoff}"
    # one kv.gather per window (= per landing slot written), one kv.write and one decode.scatter per round
    # (a round writes every gathered window it holds credits for)
    writes, rounds = handoff["writes"], handoff["rounds"]
    counts = {n: len(by_name[n]) for n in ("kv.gather", "kv.write", "decode.scatter")}
    assert writes >= 2 and counts["kv.gather"] == writes, f"handoff {handoff}, spans {counts}"
    assert len(by_name["kv.write"]) == rounds and sum(s["attributes"]["windows"] for s in by_name["kv.write"]) == writes
    assert len(by_name["decode.scatter"]) == rounds
    assert len(by_name["decode.generate"]) == 1  # one span per request, not per token
    return by_name
