"""Sessions expected back last (issues 29/30): agent sessions that paused for a tool keep their cached history
while sessions whose task ended give theirs up first, against plain LRU, one run.

    python -m bench.retention [--quick] [--out bench/results/retention.json]

Two systems, one after the other: `moorage up` with the tiny model, the pool off (so only the device caches
hold history), a prefill device cache of `device_blocks` blocks, and `router.retention` = `session` (the
router's SessionTurn after each answer) or `lru`. Against each, the same seeded script (chat API, greedy):
1. `sessions` sessions take their first turn, interleaved: even ones call a tool (`tool_choice: required`,
   a tool whose one argument is a digit, so the call always completes: finish_reason `tool_calls`), odd ones
   answer (no tools: the task ended). Each opens with its own `history_tokens`-byte system prompt
   (tiny's tokenizer: one token per byte); together they hold more than the device cache does.
2. `fillers` one-turn conversations of the same size (other agents' work) pass through.
3. Every session returns: first the tool sessions with the call and its result (a tool pause is short),
   then the others with a new question.
Reported per mode: each returning turn's cached tokens (usage.prompt_tokens_details) over its first turn's
prompt tokens, averaged over the tool sessions (expected back) and over the ended ones, and the prefill's
`session_blocks_demoted`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

from bench._util import LoadWatcher, md_table, system_bench_main
from bench.agentic.replay import TOOL



@dataclass(frozen=True)
class Size:
    sessions: int = 8
    history_tokens: int = 480
    fillers: int = 3
    device_blocks: int = 320     # 5,120 tokens: the tool sessions' histories (tools in the system prompt: ~1.1K
    #                              tokens each) and a little more, not the ended sessions' and the fillers' too
    max_tokens: int = 48
    tier: str = "device"         # device: the pool off; pool: device caches too small to keep anything, so
    #                              returning turns find their history in the pool (store_bytes of DRAM) or not
    store_bytes: int = 0


QUICK = Size(sessions=4, fillers=2, device_blocks=200)
FULL = Size()


def system_text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def chat(http: httpx.Client, messages: list[dict], session: str | None, size: Size, tools: str = "") -> dict:
    """tools: "" (none), "required" (a call, which always completes) or "auto" (offered, as an agent resends them)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": size.max_tokens, "temperature": 0}
    if tools:
        body.update(tools=[TOOL], tool_choice=tools, parallel_tool_calls=False)
        if tools == "required":  # the call in bytes (tiny's tokens): about 60
            body["max_tokens"] = max(size.max_tokens, 128)
    r = http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": session} if session else {})
    r.raise_for_status()
    return r.json()


def drive(url: str, size: Size) -> list[dict]:
    rows = []
    with httpx.Client(base_url=url, timeout=120) as http:
        convs = {}
        for i in range(size.sessions):  # 1. first turns, interleaved
            tool = i % 2 == 0
            msgs = [{"role": "system", "content": system_text(i, size.history_tokens)},
                    {"role": "user", "content": f"task {i}"}]
            out = chat(http, msgs, f"s{i}", size, "required" if tool else "")
            choice = out["choices"][0]
            assert choice["finish_reason"] == ("tool_calls" if tool else choice["finish_reason"]), choice
            convs[i] = (msgs + [choice["message"]], out["usage"]["prompt_tokens"], tool)
        for j in range(size.fillers):  # 2. other work passes through
            chat(http, [{"role": "system", "content": system_text(1000 + j, size.history_tokens)},
                        {"role": "user", "content": "filler"}], None, size)
        # 3. every session returns: the tool sessions first (a tool pause is short), then the ended ones
        for i, (msgs, first_prompt, tool) in sorted(convs.items(), key=lambda kv: not kv[1][2]):
            last = msgs[-1]
            if tool:
                call = last["tool_calls"][0]
                nxt = msgs + [{"role": "tool", "tool_call_id": call["id"], "content": "done"}]
            else:
                nxt = msgs[:-1] + [{"role": "assistant", "content": last.get("content") or ""},
                                   {"role": "user", "content": "and then?"}]
            out = chat(http, nxt, f"s{i}", size, "auto" if tool else "")
            u = out["usage"]
            rows.append({"session": i, "expected_back": tool, "first_prompt_tokens": first_prompt,
                         "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                         "history_share_cached": round(u["prompt_tokens_details"]["cached_tokens"] / first_prompt, 4)})
    return rows


def run_mode(size: Size, retention: str, run_dir: str, overrides: list[str]) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config

    tier = (["up.pool=false"] if size.tier == "device" else
            ["up.pool=true", "up.stores=1", f"up.store_bytes={size.store_bytes}", "decode.transfer.decode_reuse=false",
             "up.disk_bytes=0",  # the DRAM pool's retention policy: no disk tier to bring back what it evicts
             "prefill.pool.save_max_held_fraction=0.9"])
    sets = ["up.model=tiny", "up.port=0", *tier, f"up.run_dir={run_dir}",
            f"prefill.engine.num_blocks={size.device_blocks}", "decode.engine.num_blocks=2048",
            f"router.router.retention={retention}", *overrides]
    cfg = load_config(UpConfig, overrides=sets, env={})
    with launched(cfg) as (launcher, url):
        watcher = LoadWatcher(launcher.nats.url, "bench-retention")
        try:
            t0 = time.perf_counter()
            rows = drive(url, size)
            wall = time.perf_counter() - t0
            time.sleep(1.5)  # one more load report
            prefill = next((r.detail for _, r in watcher.latest.values() if r.role == "prefill"), {})
        finally:
            watcher.close()
    return {"retention": retention, "overrides": sets, "wall_s": round(wall, 2), "rows": rows,
            "prefill_sessions": prefill.get("sessions"), "prefill_pool": prefill.get("pool")}


def summarize(mode: dict) -> dict:
    def mean(rows):
        return round(sum(r["history_share_cached"] for r in rows) / len(rows), 4) if rows else None
    back = [r for r in mode["rows"] if r["expected_back"]]
    ended = [r for r in mode["rows"] if not r["expected_back"]]
    return {"retention": mode["retention"], "expected_back_history_cached": mean(back),
            "ended_history_cached": mean(ended), "returning_turns": len(mode["rows"]),
            "blocks_demoted": (mode.get("prefill_sessions") or {}).get("session_blocks_demoted"),
            **{k: (mode.get("prefill_pool") or {}).get(k) for k in ("restored_chunks", "saved_chunks",
                                                                     "saved_pinned_chunks")}}


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    modes = [run_mode(size, r, f"{run_dir}/{r}", list(overrides)) for r in ("lru", "session")]
    return {"params": {"size": size.__dict__, "quick": size.sessions < FULL.sessions}, "modes": modes,
            "summary": [summarize(m) for m in modes]}


def report(result: dict) -> str:
    rows = [[s["retention"], s["expected_back_history_cached"], s["ended_history_cached"], s["returning_turns"],
             s["blocks_demoted"], s.get("saved_pinned_chunks"), s.get("restored_chunks")] for s in result["summary"]]
    return md_table(["router.retention", "history cached: sessions expected back", "ended sessions", "returning turns",
                     "prefill blocks demoted", "pool chunks saved pinned", "pool chunks restored"], rows)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [s["retention"] for s in result["summary"]]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [s["expected_back_history_cached"] or 0 for s in result["summary"]], 0.4,
           label="expected back (tool call)")
    ax.bar([i + 0.2 for i in x], [s["ended_history_cached"] or 0 for s in result["summary"]], 0.4,
           label="task ended (answer)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("share of the history still cached on return")
    where = "the pool" if result["params"]["size"].get("tier") == "pool" else "the device cache"
    ax.set_title(f"returning turns after other work filled {where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "retention", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
