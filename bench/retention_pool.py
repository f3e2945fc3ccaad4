"""Sessions expected back last, in the pool (issue 29): the agent sessions that paused for a tool find their
history in the pool after other work overflowed it, where plain LRU lost it; one run.

    python -m bench.retention_pool [--quick] [--out bench/results/retention-pool.json]

bench/retention.py's script and systems, with the tier moved: the pool on (one store of `store_bytes`), a
prefill device cache of 1.5K tokens (one tool session's turn: the router names a session for every
conversation, and with `session` retention the device keeps the tool sessions' blocks while ended ones go
first, so a larger cache would serve them itself), decode reuse off, and saves free to hold 90% of that cache
while they wait (`pool.save_max_held_fraction`; at the default 25% a cache this small makes every save go at
once, before its turn ended: a production cache holds many prompts). With
`router.retention = session` prefill's save of each session turn waits for the turn's end (SessionTurn):
a tool call soft-pins the new chunks (Mooncake evicts them once no unpinned object is left), an answer that
ends the task leaves them unpinned, and so do the fillers (no session). With `lru` nothing is pinned. The
first turns and fillers write about twice what the pool keeps (it evicts at 90% full).
"""

from __future__ import annotations

from bench._util import system_bench_main
from bench.retention import Size, plot, report, run

MiB = 1 << 20
# tiny: 4 KiB of KV per token, a 256-token chunk is 1 MiB; a first turn of ~1.1K tokens saves 4 chunks
QUICK = Size(sessions=4, fillers=6, device_blocks=96, tier="pool", store_bytes=16 * MiB)
FULL = Size(sessions=8, fillers=3, device_blocks=96, tier="pool", store_bytes=24 * MiB)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "retention-pool", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
