"""The weka-format corpus AIPerf replays: written by `moorage trace synth` (or given with --traces).

Sized for SmolLM2 on a 2-core CPU (8K context, prefill ~300 tok/s): the public corpus' shape with every
token count x `scale`, so prompts stay within ~1-6K tokens, `max_context` (absolute) keeps every request
well inside the 8K context, and subagents are on (AIPerf's weka loader replays them as concurrent child
conversations, joined before the parent's next turn). Hash ids stay per session ("local" scope): AIPerf's
weka loader rejects a "global" one.
"""

from __future__ import annotations

import shlex
from pathlib import Path

# `moorage trace synth` flags (SynthParams fields) of the two sizes; --synth-set KEY=VALUE overrides any
FULL_SYNTH = {"sessions": 6, "scale": 0.02, "turns": 10, "min_turns": 3, "fanout_prob": 0.08, "fanout_max": 3,
              "subagent_turns": 3, "out_tokens": 800, "max_context": 7168, "model": "smollm2-135m"}
QUICK_SYNTH = {"sessions": 2, "scale": 0.01, "turns": 3, "min_turns": 3, "turns_sigma": 0.0, "fanout_prob": 0.5,
               "fanout_max": 2, "subagent_turns": 2, "out_tokens": 800, "max_context": 7168,
               "model": "smollm2-135m"}


def synth_params(quick: bool, seed: int = 0, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The synth parameters: the size's defaults, the seed, then KEY=VALUE overrides (SynthParams fields)."""
    from dataclasses import fields

    from bench.agentic.synth import SynthParams

    types = {f.name: type(f.default) for f in fields(SynthParams)}
    params = {**(QUICK_SYNTH if quick else FULL_SYNTH), "seed": seed}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise ValueError(f"--synth-set {item!r}: expected KEY=VALUE with KEY one of {', '.join(types)}")
        tp = types[key]
        params[key] = (value.lower() in ("1", "true", "yes", "on")) if tp is bool else tp(value)
    return params


def synth_argv(params: dict, out: str | Path) -> list[str]:
    """The `moorage trace synth` arguments that write `params` to `out`."""
    argv = ["synth", "--out", str(out)]
    for k, v in params.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            argv += [flag, str(v)]
    return argv


def write_corpus(params: dict, out: str | Path) -> str:
    """Write the corpus with `moorage trace synth` (in-process); the equivalent command line."""
    from bench.agentic.synth import main as trace_main

    argv = synth_argv(params, out)
    code = trace_main(argv)
    if code != 0:
        raise RuntimeError(f"moorage trace {shlex.join(argv)} failed (exit {code})")
    return "moorage trace " + shlex.join(argv)


def describe(traces: str | Path) -> tuple[dict, list]:
    """(summary, sessions) of what AIPerf will replay: sessions, requests (subagents' included), the reuse
    ceiling, the longest prompt."""
    from bench.agentic.trace import load_traces, summarize

    sessions = load_traces(traces)
    s = summarize(sessions)
    for scope in {x.hash_id_scope for x in sessions}:
        if scope != "local":
            raise ValueError(f"{traces}: hash_id_scope {scope!r}; AIPerf's weka loader takes only 'local'")
    return {"sessions": s["sessions"], "requests": s["requests"], "main_requests": s["main_requests"],
            "subagent_requests": s["subagent_requests"], "subagents": s["subagents"],
            "prompt_tokens": s["prompt_tokens"], "output_tokens": s["output_tokens"],
            "median_input_tokens": s["median_input_tokens"], "max_input_tokens": s["max_input_tokens"],
            "ceiling": s["ceiling"]}, sessions
