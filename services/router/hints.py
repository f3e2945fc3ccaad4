"""Agent hints: what a client may say about a request's urgency, in the forms agent harnesses send.

- `priority` in the body: vLLM's, lower is served first (default 0). moorage negates it.
- `nvext.agent_hints.priority`: Dynamo's, higher is served first. `nvext.agent_hints.latency_sensitivity`:
  seconds of head start in the admission queue on top of the priority's.
- the header `x-request-priority`: higher first, as Dynamo's.

One priority is kept, higher first, from the first of: the header, `nvext.agent_hints.priority`, the body's
`priority`. `latency_sensitivity` is bounded by the same ceiling: at most LATENCY_S_PER_LEVEL seconds per level
of it (none for a key whose ceiling is 0 or less), so it cannot buy more head start than the priority could.
`nvext.agent_hints.osl` (expected output tokens) makes the gate reserve min(max_tokens, osl x gate.osl_margin)
instead of max_tokens: more requests fit on decode; one that writes more is not cut.
`nvext.session_control` with `action: close` frees the session's KV once the request ended (prefill's
shared/sessions.py). It acts in the gate's queue (a head start of priority x gate.priority_step_s) and in prefill's
srpf order (a weight on the tokens left to compute, bounded: no starvation). A tenant may use priorities up
to its ceiling (router.max_priority, or router.tenant_max_priority[tenant]); above it, or malformed, is a 400
naming the field. Lower priorities are always allowed (down to MIN_PRIORITY).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.router.schemas import OpenAIError, Hinted

MIN_PRIORITY, MAX_PRIORITY = -1000, 1000  # what any field may say; the tenant's ceiling is lower
HEADER = "x-request-priority"
LATENCY_S_PER_LEVEL = 2.0  # latency_sensitivity a priority level allows (gate.priority_step_s's default)


@dataclass(frozen=True)
class Hints:
    priority: int = 0          # higher first
    latency_s: float = 0.0     # more head start in the gate's queue
    source: str = "priority"   # the field the priority came from, named in errors
    close_session: bool = False  # nvext.session_control.action == "close": free the session's KV after this request
    osl: int = 0               # nvext.agent_hints.osl: expected output tokens (0: not said)


def from_body(body: Hinted) -> Hints:
    agent = body.nvext.agent_hints if body.nvext else None
    control = body.nvext.session_control if body.nvext else None
    close = control is not None and control.action == "close"
    latency = (agent.latency_sensitivity if agent else None) or 0.0
    osl = (agent.osl if agent else None) or 0
    if agent is not None and agent.priority is not None:
        return Hints(agent.priority, latency, "nvext.agent_hints.priority", close, osl)
    return Hints(-body.priority if body.priority is not None else 0, latency, close_session=close, osl=osl)


def resolve(body: Hints, header: str | None, ceiling: int) -> Hints:
    """The request's hints: the header's priority over the body's, checked against the tenant's ceiling."""
    hints = body
    if header is not None:
        try:
            value = int(header.strip())
        except ValueError:
            raise OpenAIError(400, f"{HEADER} must be an integer, got {header[:32]!r}", param=HEADER) from None
        if not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise OpenAIError(400, f"{HEADER} must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value}", param=HEADER)
        hints = dataclasses.replace(body, priority=value, source=HEADER)
    allowed = max(0, ceiling) * LATENCY_S_PER_LEVEL
    if hints.latency_s > allowed:
        raise OpenAIError(400, f"nvext.agent_hints.latency_sensitivity {hints.latency_s:g} is above what this API "
                               f"key may use (at most {allowed:g} s)", param="nvext.agent_hints.latency_sensitivity")
    if hints.priority > ceiling:
        vllm = hints.source == "priority"  # said the other way round: lower first
        said, limit = (-hints.priority, f", i.e. priority >= {-ceiling}") if vllm else (hints.priority, "")
        raise OpenAIError(400, f"{hints.source} {said} is above what this API key may use (at most {ceiling} "
                               f"served first{limit})", param=hints.source)
    return hints
