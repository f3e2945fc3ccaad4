"""A seeded synthetic corpus of agent sessions in the AgentX / weka trace format.

The shape follows what is published about the public corpus (cc-traces-weka-062126): a session's main
thread resends its whole conversation each turn with a small new suffix (median request 142K input
tokens of which 1.7K are new; ~65 main-thread requests), waits for tools and users between turns,
sometimes pauses for long enough that only a prefix of its history still matches afterwards, and now and
then fans out parallel subagents that build their own contexts and are joined before the next turn.

Every knob is a field of `SynthParams`, an input to the generator: nothing is tuned to a benchmark. One
factor, `scale`, multiplies every token count (contexts, new tokens, outputs, prefixes) so the same
shape fits a small machine; `max_context`, the machine's limit, is absolute. The corpus is a pure
function of the parameters: session `i` of seed `s` depends on nothing else (not even on how many
sessions are asked for).

Hash ids: ids are unique per session (`hash_id_scope` "local") unless `shared_prefix` puts the tools +
system prompt prefix in one corpus-wide id space ("global", every session's own ids then come from a
disjoint range). A context's last block may be partial; when later tokens fill it its content changes,
so it gets a new id. After a pause, every block from the cut point on gets a new id.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from bench.agentic.trace import (
    TraceError,
    TraceRequest,
    TraceSession,
    TraceSubagent,
    load_traces,
    summarize,
    write_traces,
)

ID_STRIDE = 1 << 32  # per-session id range when ids share one global space


@dataclass
class SynthParams:
    """Generator inputs. Token counts are at scale 1 (the public corpus) and are multiplied by `scale`;
    times are seconds. "median"/"sigma" pairs describe log-normal draws."""

    sessions: int = 8
    seed: int = 0
    scale: float = 1.0
    block_size: int = 64
    model: str = "tiny"
    subagent_model: str = ""  # "" = same as model
    # main thread
    turns: int = 65  # median main-thread requests per session
    turns_sigma: float = 0.4
    min_turns: int = 2
    median_context: int = 142_000  # median main-thread input tokens (sets where sessions start)
    context_sigma: float = 0.35  # spread of sessions' starting contexts
    system_tokens: int = 14_000  # tools + system prompt at the head of every main thread
    new_tokens: int = 1_700  # median new tokens per turn (previous reply + tool results / user text)
    new_tokens_sigma: float = 1.0
    out_tokens: int = 300  # median output tokens per request
    out_sigma: float = 1.0
    max_out_tokens: int = 8_000
    max_context: int = 0  # absolute cap on a request's input + output (not scaled; 0 = none): compacts
    compact_tokens: int = 20_000  # summary left after compaction (on top of the system prefix)
    shared_prefix: bool = False  # the system prefixes are identical across sessions (global scope)
    # waits
    think_median: float = 4.0  # tool execution between turns
    think_sigma: float = 1.2
    think_cap: float = 300.0
    user_turn_prob: float = 0.08  # the reply ends the turn and the user answers
    user_think_median: float = 45.0
    user_think_sigma: float = 1.0
    user_think_cap: float = 900.0
    pause_prob: float = 0.02  # a long pause after which only a prefix of the history matches
    pause_median: float = 1800.0
    pause_sigma: float = 0.8
    pause_cap: float = 7200.0
    pause_keep_min: float = 0.1  # share of the history (in blocks) still matching after a pause
    pause_keep_max: float = 0.5
    # recorded request times: api_time = api_base + out * api_per_out_token + in * api_per_in_token
    api_base: float = 0.8
    api_per_out_token: float = 0.02
    api_per_in_token: float = 0.0
    # subagents
    fanout_prob: float = 0.015  # a turn fans out parallel subagents
    fanout_min: int = 1
    fanout_max: int = 4
    subagent_turns: int = 8
    subagent_turns_sigma: float = 0.5
    subagent_system_tokens: int = 6_000  # a subagent's own system prompt (shared by a session's subagents)
    subagent_task_tokens: int = 1_500  # the task a subagent is given
    subagent_result_tokens: int = 1_000  # what each subagent returns to the main thread at the join
    subagent_think_median: float = 2.0
    subagent_types: str = "Explore,general-purpose"

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"synth parameter {what}")

        need(self.sessions >= 0, f"sessions must be >= 0, got {self.sessions}")
        need(self.scale > 0 and math.isfinite(self.scale), f"scale must be positive, got {self.scale}")
        need(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        need(self.turns >= 1 and self.min_turns >= 1, "turns and min_turns must be >= 1")
        for name in ("median_context", "new_tokens", "out_tokens", "max_out_tokens", "subagent_turns"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "compact_tokens", "subagent_system_tokens", "subagent_task_tokens",
                     "subagent_result_tokens", "api_base", "api_per_out_token", "api_per_in_token"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("turns_sigma", "context_sigma", "new_tokens_sigma", "out_sigma", "think_sigma",
                     "user_think_sigma", "pause_sigma", "subagent_turns_sigma"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("think_median", "user_think_median", "pause_median", "subagent_think_median",
                     "think_cap", "user_think_cap", "pause_cap"):
            need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        for name in ("user_turn_prob", "pause_prob", "fanout_prob", "pause_keep_min", "pause_keep_max"):
            need(0.0 <= getattr(self, name) <= 1.0, f"{name} must be in [0, 1], got {getattr(self, name)}")
        need(self.max_context >= 0, f"max_context must be >= 0, got {self.max_context}")
        need(not self.max_context
             or self.tokens(self.system_tokens) + self.tokens(self.compact_tokens)
             + self.tokens(self.subagent_system_tokens) + self.tokens(self.subagent_task_tokens)
             + self.tokens(self.max_out_tokens) < self.max_context,
             "max_context must exceed the scaled prefixes + compact_tokens + max_out_tokens")
        need(self.pause_keep_min <= self.pause_keep_max, "pause_keep_min must be <= pause_keep_max")
        need(1 <= self.fanout_min <= self.fanout_max, "needs 1 <= fanout_min <= fanout_max")
        need(bool(self.model), "model must not be empty")
        need(bool(self.type_list()), "subagent_types must name at least one type")

    def tokens(self, n: float) -> int:
        """A token count at scale 1 -> at this scale (at least 1)."""
        return max(1, round(n * self.scale))

    def type_list(self) -> list[str]:
        return [t.strip() for t in self.subagent_types.split(",") if t.strip()]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class _Ids:
    """Fresh hash ids for one session."""

    def __init__(self, start: int, limit: int):
        self.next = start
        self.limit = limit

    def __call__(self) -> int:
        if self.next >= self.limit:
            raise ValueError("session ran out of hash ids")
        self.next += 1
        return self.next - 1


class _Context:
    """A thread's context as block ids; the last block may be partial."""

    def __init__(self, bs: int, fresh: _Ids, prefix: list[int] | None = None):
        self.bs = bs
        self.fresh = fresh
        self.ids = list(prefix or [])
        self.length = len(self.ids) * bs

    def extend(self, n: int) -> None:
        if n <= 0:
            return
        if self.length % self.bs:
            self.ids.pop()  # the partial block fills up: its content changes, so does its id
        self.length += n
        while len(self.ids) < -(-self.length // self.bs):
            self.ids.append(self.fresh())

    def cut(self, keep_blocks: int) -> None:
        """Only the first `keep_blocks` blocks still match: the rest is the same length, new content."""
        for i in range(keep_blocks, len(self.ids)):
            self.ids[i] = self.fresh()

    def reset(self, keep_blocks: int) -> None:
        self.ids = self.ids[:keep_blocks]
        self.length = keep_blocks * self.bs


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma) if sigma > 0 else float(median)


class _SessionBuilder:
    def __init__(self, p: SynthParams, index: int):
        self.p = p
        self.rng = random.Random(f"moorage-synth:{p.seed}:{index}")
        self.sid = f"synth-{p.seed}-{index:05d}"
        bs = p.block_size
        if p.shared_prefix:
            # ids 1..ID_STRIDE-1 are the corpus-wide prefixes; each session owns its own stride above
            self.fresh = _Ids((index + 1) * ID_STRIDE, (index + 2) * ID_STRIDE)
            n_sys = p.tokens(p.system_tokens) // bs if p.system_tokens else 0
            n_sub = p.tokens(p.subagent_system_tokens) // bs if p.subagent_system_tokens else 0
            self.sys_ids = list(range(1, 1 + n_sys))
            self.sub_sys_ids = list(range(1 + n_sys, 1 + n_sys + n_sub))
        else:
            self.fresh = _Ids(1, ID_STRIDE)
            n_sys = p.tokens(p.system_tokens) // bs if p.system_tokens else 0
            self.sys_ids = [self.fresh() for _ in range(n_sys)]
            self.sub_sys_ids = None  # made on first fan-out
        self.model = p.model
        self.sub_model = p.subagent_model or p.model
        self.agents = 0

    def input_cap(self) -> int:
        """The largest input: max_context less room for the largest output."""
        p = self.p
        return p.max_context - self.tok(p.max_out_tokens) if p.max_context else 1 << 62

    # ------------------------------------------------------------ draws

    def tok(self, n: float) -> int:
        return self.p.tokens(n)

    def draw_out(self) -> int:
        p = self.p
        return max(1, min(self.tok(p.max_out_tokens), round(_lognormal(self.rng, p.out_tokens, p.out_sigma)
                                                                  * p.scale)))

    def draw_new(self) -> int:
        p = self.p
        return max(1, round(_lognormal(self.rng, p.new_tokens, p.new_tokens_sigma) * p.scale))

    def draw_wait(self, median: float, sigma: float, cap: float) -> float:
        return min(cap, _lognormal(self.rng, median, sigma))

    def api_time(self, n_in: int, n_out: int) -> float:
        p = self.p
        return p.api_base + n_out * p.api_per_out_token + n_in * p.api_per_in_token

    def request(self, t: float, model: str, ctx: _Context, out: int, input_types: list[str], stop: str,
                think: float) -> TraceRequest:
        return TraceRequest(
            t=round(t, 3), type="s", model=model, in_tokens=ctx.length, out_tokens=out,
            hash_ids=list(ctx.ids), input_types=list(input_types),
            output_types=["text"] if stop == "end_turn" else ["text", "tool_use"], stop=stop,
            api_time=round(self.api_time(ctx.length, out), 3), think_time=round(think, 3),
        )

    def grow(self, ctx: _Context, n: int, sys_blocks: int, max_ctx: int) -> bool:
        """Append n tokens; past `max_ctx` the thread compacts to its system prefix plus a summary.
        Returns False when even that cannot fit."""
        if ctx.length + n > max_ctx:
            ctx.reset(min(sys_blocks, len(ctx.ids)))
            ctx.extend(self.tok(self.p.compact_tokens))
            if ctx.length + n > max_ctx:
                n = max_ctx - ctx.length
                if n <= 0:
                    return False
        ctx.extend(n)
        return True

    # ------------------------------------------------------------ threads

    def subagent(self, spawn: float) -> TraceSubagent:
        p, rng, bs = self.p, self.rng, self.p.block_size
        self.agents += 1
        agent_id = f"agent_{self.agents:03d}"
        sys_tokens = self.tok(p.subagent_system_tokens) if p.subagent_system_tokens else 0
        if self.sub_sys_ids is None:
            self.sub_sys_ids = [self.fresh() for _ in range(sys_tokens // bs)]
        ctx = _Context(bs, self.fresh, self.sub_sys_ids)
        ctx.extend(sys_tokens - ctx.length + self.tok(p.subagent_task_tokens))
        max_ctx = self.input_cap()
        n_turns = max(1, round(_lognormal(rng, p.subagent_turns, p.subagent_turns_sigma)))
        requests: list[TraceRequest] = []
        think = min(p.think_cap, rng.uniform(0.05, 0.5))
        prev_end = spawn
        for k in range(n_turns):
            t = prev_end + think
            out = self.draw_out()
            last = k == n_turns - 1
            requests.append(self.request(t, self.sub_model, ctx, out, ["text"] if k == 0 else ["tool_result"],
                                         "end_turn" if last else "tool_use", think))
            prev_end = t + self.api_time(ctx.length, out)
            if last:
                break
            think = self.draw_wait(p.subagent_think_median, p.think_sigma, p.think_cap)
            if not self.grow(ctx, max(self.draw_new(), out), len(self.sub_sys_ids), max_ctx):
                break
        return TraceSubagent(
            t=round(spawn, 3), agent_id=agent_id, subagent_type=rng.choice(p.type_list()), status="completed",
            duration_ms=int(round((prev_end - spawn) * 1000)), requests=requests, models=[self.sub_model],
            total_tokens=sum(r.in_tokens + r.out_tokens for r in requests), tool_use_count=len(requests) - 1,
        )

    def session(self) -> TraceSession:
        p, rng, bs = self.p, self.rng, self.p.block_size
        n_turns = max(p.min_turns, round(_lognormal(rng, p.turns, p.turns_sigma)))
        max_ctx = self.input_cap()
        sys_tokens = self.tok(p.system_tokens) if p.system_tokens else 0
        # Start so that, growing by the mean new tokens per turn, the middle request is near the median.
        mean_new = p.new_tokens * math.exp(p.new_tokens_sigma ** 2 / 2)
        start_median = max(p.median_context - mean_new * p.turns / 2, p.system_tokens + p.new_tokens)
        start = round(_lognormal(rng, start_median, p.context_sigma) * p.scale)
        start = max(sys_tokens + 1, min(start, max_ctx // 2))
        ctx = _Context(bs, self.fresh, self.sys_ids)
        ctx.extend(start - ctx.length)
        sys_blocks = len(self.sys_ids)

        items: list[TraceRequest | TraceSubagent] = []
        think, input_types, prev_end = 0.0, ["text"], 0.0
        for k in range(n_turns):
            t = prev_end + think
            out = self.draw_out()
            last = k == n_turns - 1
            u = rng.random()
            if last:
                event = "end"
            elif u < p.pause_prob:
                event = "pause"
            elif u < p.pause_prob + p.user_turn_prob:
                event = "user"
            elif u < p.pause_prob + p.user_turn_prob + p.fanout_prob:
                event = "fanout"
            else:
                event = "tool"
            stop = "tool_use" if event in ("tool", "fanout") else "end_turn"
            items.append(self.request(t, self.model, ctx, out, input_types, stop, think))
            prev_end = t + self.api_time(ctx.length, out)
            if last:
                break
            growth = max(self.draw_new(), out)
            if event == "pause":
                think = self.draw_wait(p.pause_median, p.pause_sigma, p.pause_cap)
                keep = rng.uniform(p.pause_keep_min, p.pause_keep_max)
                full = ctx.length // bs
                ctx.cut(min(full, max(sys_blocks, int(keep * full))))
                input_types = ["text"]
            elif event == "user":
                think = self.draw_wait(p.user_think_median, p.user_think_sigma, p.user_think_cap)
                input_types = ["text"]
            elif event == "fanout":
                width = rng.randint(p.fanout_min, p.fanout_max)
                spawn = prev_end + rng.uniform(0.05, 0.5)
                subs = [self.subagent(spawn) for _ in range(width)]
                items.extend(subs)
                join = max(s.t + (s.duration_ms or 0) / 1000 for s in subs)
                think = (join - prev_end) + rng.uniform(0.05, 0.5)
                growth += width * self.tok(p.subagent_result_tokens)
                input_types = ["tool_result"]
            else:
                think = self.draw_wait(p.think_median, p.think_sigma, p.think_cap)
                input_types = ["tool_result"]
            if not self.grow(ctx, growth, sys_blocks, max_ctx):
                break
        models = [self.model] if self.sub_model == self.model or self.agents == 0 else [self.model, self.sub_model]
        return TraceSession(id=self.sid, models=models, block_size=bs,
                            hash_id_scope="global" if p.shared_prefix else "local", requests=items,
                            system_tokens=sys_tokens)


def synthesize(params: SynthParams) -> list[TraceSession]:
    """The corpus for `params`: deterministic, and session i depends only on (params, seed, i)."""
    params.validate()
    return [_SessionBuilder(params, i).session() for i in range(params.sessions)]


# ---------------------------------------------------------------- CLI: moorage trace synth|validate


def _add_param_flags(p: argparse.ArgumentParser) -> None:
    for f in fields(SynthParams):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default {default})")
        else:
            p.add_argument(flag, dest=f.name, type=type(default), default=None, metavar=type(default).__name__.upper(),
                           help=f"(default {default})")


def build_parser(prog: str = "moorage trace") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="agent-session traces (AgentX / weka format)")
    sub = parser.add_subparsers(dest="action", required=True)
    s = sub.add_parser("synth", help="write a seeded synthetic corpus shaped like the public one")
    s.add_argument("--out", required=True, help="a directory (one <index>-<id>.json per session), or X.jsonl / X.json")
    _add_param_flags(s)
    v = sub.add_parser("validate", help="validate traces strictly and print a summary")
    v.add_argument("path", help="a trace file or a directory of *.json / *.jsonl")
    v.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    s = summary
    print(f"sessions {s['sessions']}  requests {s['requests']} (main {s['main_requests']}, "
          f"subagent {s['subagent_requests']} in {s['subagents']} subagents)  "
          f"median main requests/session {s['median_main_requests_per_session']:g}")
    print(f"prompt tokens {s['prompt_tokens']}  output tokens {s['output_tokens']}  "
          f"median input {s['median_input_tokens']:g}  max input {s['max_input_tokens']}")
    print(f"reuse ceiling {s['ceiling']:.2%} ({s['reusable_tokens']} of {s['prompt_tokens']} prompt tokens)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = f"moorage trace {args.action}"
    try:
        if args.action == "synth":
            overrides = {f.name: getattr(args, f.name) for f in fields(SynthParams)
                         if getattr(args, f.name) is not None}
            params = SynthParams(**overrides)
            sessions = synthesize(params)
            out = Path(args.out)
            written = write_traces(sessions, out)
            if out.suffix not in (".json", ".jsonl"):
                (out / "synth_params.txt").write_text(json.dumps(params.to_json(), indent=2) + "\n")
            print(f"wrote {len(sessions)} sessions to {out} ({len(written)} files)")
            _print_summary(summarize(sessions), False)
            return 0
        sessions = load_traces(args.path)
        _print_summary(summarize(sessions), args.json)
        return 0
    except TraceError as e:
        print(f"{name}: invalid trace: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
