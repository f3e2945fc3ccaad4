"""`moorage bench aiperf`: NVIDIA AIPerf 0.13 replays a weka-format agent corpus against moorage (SmolLM2),
streaming, with the KV pool on and off, at several concurrencies; the results side by side.

For each pool setting a fresh system is started (`infra.up.launched`, pool off = `up.pool=false`; KV
sized from the traces as `moorage bench sweep` does, so device memory alone holds well under the
ceiling) and AIPerf runs once per concurrency against it: `--custom-dataset-type weka_trace`
(subagents replayed as recorded), `--request-count` = every request of the corpus and `--num-sessions` =
its sessions (each conversation replayed once: a lane that finishes early does not start one again),
server token counts, X-Session-ID from AIPerf's correlation id, think times capped at `--think-cap`.
Each concurrency uses its own
`--random-seed` (the same one with the pool on and off): AIPerf synthesizes each hash id's text from the
seed, so a later run cannot hit an earlier run's cache, while pool on and off see identical prompts.

Reported per (pool, concurrency): requests ok and errored (rejections = 429/503, and every error status),
AIPerf's cache-read share (`overall_usage_prompt_cache_read_pct`, from the server's cached_tokens) against
the traces' own ceiling for the requests sent (`theoretical_prefix_cache_hit`), TTFT p50/p90/p99 and ITL
p50. JSON + PNG go to runs/aiperf-<time>/ (gitignored) unless --out says otherwise; AIPerf's own artifacts,
the corpus and the systems' logs stay in that run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from bench.agentic import system
from bench.aiperf import corpus as corpus_mod
from bench.aiperf import env as env_mod
from bench.aiperf import runner, summary
from bench.aiperf.tokenizer import REPO_ID, ensure_tokenizer

KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K+V x 30 layers x 3 KV heads x 64 dims x fp32


def _cap(text: str) -> float | None:
    if text.strip().lower() in ("none", "inf", "off", "uncapped"):
        return None
    value = float(text)
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"--think-cap must be >= 0 seconds or 'none', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moorage bench aiperf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help=f"concurrency 1,2 over a tiny corpus ({corpus_mod.QUICK_SYNTH}): a few minutes")
    p.add_argument("--concurrency", default=None, help="comma-separated loads (default 1,2,4; --quick 1,2)")
    p.add_argument("--pools", default="on,off", help="pool settings to compare, comma-separated (default on,off)")
    p.add_argument("--traces", help="an existing weka-format corpus (file or directory; hash_id_scope local); "
                                    f"omit: one written by `moorage trace synth` ({corpus_mod.FULL_SYNTH})")
    p.add_argument("--seed", type=int, default=0,
                   help="corpus seed; AIPerf's --random-seed is this + the concurrency's index (default 0)")
    p.add_argument("--synth-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a `moorage trace synth` parameter of the corpus, e.g. sessions=4 (repeatable)")
    p.add_argument("--request-count", type=int, default=0,
                   help="requests per run (default 0: every request of the corpus, subagents' included)")
    p.add_argument("--think-cap", default="auto", metavar="S",
                   help="cap on each replayed delay between turns, s, or 'none' for the recorded delays "
                        "(default 10; --quick 1)")
    p.add_argument("--url", help="an already running router: one run per concurrency against it, reported as "
                                 "pool 'external' (no system is started)")
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m"],
                   help="served model (its GGUF also gives AIPerf's tokenizer)")
    p.add_argument("--work-dir", default=None,
                   help="corpus, AIPerf artifacts and system logs (default runs/aiperf-<time>/, gitignored)")
    p.add_argument("--out", default=None, help="JSON result (default <work-dir>/aiperf.json; e.g. "
                                               "bench/results/aiperf.json to update the committed one)")
    p.add_argument("--png", default=None, help="plot (default: --out with .png)")
    p.add_argument("--venv", default=env_mod.DEFAULT_VENV, help="AIPerf's own venv, created on first use "
                                                                "(default %(default)s)")
    p.add_argument("--python", default="python3", help="interpreter that creates that venv (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="per AIPerf run, s (default 3600; --quick 900)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="per request, s (default %(default)s)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="for each system to report ready, s (default %(default)s)")
    p.add_argument("--kv", choices=("default", "traces"), default="default",
                   help="default: KV as a user's `moorage up` sizes it from memory (the headline); traces: device "
                        "and decode KV sized from the traces, small enough that the pool matters (as the sweep)")
    p.add_argument("--aiperf-arg", action="append", default=[], metavar="ARG",
                   help="extra `aiperf profile` argument (repeatable), e.g. --aiperf-arg=--workers-max=2")
    system.add_system_args(p)
    p.set_defaults(run_dir=None, store_bytes=0)
    return p


def _store_bytes(sessions: list, stores: int) -> int:
    """Pool DRAM per store: the corpus' distinct prompt tokens x SmolLM2's KV bytes x 1.5, at least 256 MiB
    (the sweep's 256 MiB default is sized for `tiny`, whose KV is ~50x smaller per token)."""
    from bench.agentic.trace import iter_requests

    seen: set = set()
    distinct = 0
    for s in sessions:
        for _, r in iter_requests(s):
            for h in r.hash_ids:
                if (s.id, h) not in seen:
                    seen.add((s.id, h))
                    distinct += s.block_size
    need = int(1.5 * distinct * KV_BYTES_PER_TOKEN / max(1, stores))
    return max(256 << 20, -(-need // (1 << 20)) << 20)


def _machine() -> dict:
    from bench.agentic.sweep import _machine as machine

    return machine()


def run_matrix(args: argparse.Namespace, exe: Path, hf_home: Path, traces: str, sessions: list,
               pools: list[str], loads: list[int], request_count: int, work: Path, log=print) -> list[dict]:
    runs: list[dict] = []

    def one(pool: str, i: int, c: int, url: str, sys_info: dict) -> None:
        spec = runner.AiperfRun(url=url, traces=traces, concurrency=c, request_count=request_count,
                                sessions=len(sessions),
                                out_dir=str(work / "aiperf" / f"pool-{pool}-c{c}"), model=args.model,
                                tokenizer=REPO_ID, seed=args.seed + i, think_cap_s=args.think_cap,
                                request_timeout_s=args.request_timeout, extra_args=list(args.aiperf_arg))
        res = runner.run(exe, spec, hf_home, timeout_s=args.timeout)
        run = {"pool": pool, "concurrency": c, "seed": spec.seed, "request_count": request_count,
               "system": sys_info, "aiperf": {k: res[k] for k in ("rc", "wall_s", "log")} |
               {"artifacts": spec.out_dir, "command": " ".join(res["command"])}}
        if res["export"]:
            run["summary"] = summary.summarize_export(json.loads(Path(res["export"]).read_text()))
            s = run["summary"]
            log(f"   pool {pool} c={c}: {s['ok']} ok, {s['errors']} errors, cache read "
                f"{summary._f(s['cache_read'], '.1%')} / ceiling {summary._f(s['ceiling'], '.1%')}, TTFT p50 "
                f"{summary._f(s['ttft_s']['p50'])} s, ITL p50 {summary._f(s['itl_ms']['p50'])} ms "
                f"({res['wall_s']:.0f} s)")
        else:
            run["error"] = f"aiperf exit {res['rc']}, no {runner.EXPORT}; see {res['log']}"
            log(f"   pool {pool} c={c}: {run['error']}\n{runner.log_tail(res['log'])}")
        runs.append(run)

    if args.url:
        for i, c in enumerate(loads):
            one("external", i, c, args.url.rstrip("/").removesuffix("/v1"), {"url": args.url})
        return runs
    for pool in pools:
        if args.kv == "default":  # the user's system: only the pool switch and the model
            sets = [f"up.model={args.model}", f"up.pool={'true' if pool == 'on' else 'false'}", *args.set]
            notes = ["KV sized by moorage up from host memory (up.kv_memory)"]
        else:
            sets, notes = system.system_overrides(args, "shared" if pool == "on" else "none", sessions, max(loads))
        t0 = time.monotonic()
        try:
            with system.running_system(sets, Path(args.run_dir) / f"pool-{pool}",
                                       ready_timeout_s=args.ready_timeout) as url:
                info = {"overrides": sets, "notes": notes, "startup_s": round(time.monotonic() - t0, 1)}
                log(f"== pool {pool}: up in {info['startup_s']} s ({' '.join(sets)})")
                for i, c in enumerate(loads):
                    one(pool, i, c, url, info)
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:
            log(f"== pool {pool}: failed: {e}")
            runs += [{"pool": pool, "concurrency": c, "error": str(e)[:500],
                      "system": {"overrides": sets, "notes": notes}} for c in loads
                     if not any(r["pool"] == pool and r["concurrency"] == c for r in runs)]
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = "moorage bench aiperf"
    try:
        args.think_cap = (1.0 if args.quick else 10.0) if args.think_cap == "auto" else _cap(args.think_cap)
        loads = [int(c) for c in (args.concurrency or ("1,2" if args.quick else "1,2,4")).split(",") if c.strip()]
        pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    if not loads or min(loads) < 1 or any(p not in ("on", "off") for p in pools) or not pools:
        print(f"{name}: error: --concurrency needs positive integers, --pools a list of on/off", file=sys.stderr)
        return 2
    args.timeout = args.timeout or (900.0 if args.quick else 3600.0)
    work = Path(args.work_dir or f"runs/aiperf-{time.strftime('%Y%m%d-%H%M%S')}")
    args.out = args.out or str(work / "aiperf.json")
    args.run_dir = args.run_dir or str(work / "systems")
    t0 = time.monotonic()

    # the corpus first (cheap, and a bad --synth-set fails before anything is installed)
    try:
        if args.traces:
            traces, made_by = args.traces, None
        else:
            params = corpus_mod.synth_params(args.quick, args.seed, args.synth_set)
            traces = str(work / "traces")
            made_by = corpus_mod.write_corpus(params, traces)
        info, sessions = corpus_mod.describe(traces)
    except ValueError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    wrap = any("allow-dataset-wrap" in a for a in args.aiperf_arg)
    if max(loads) > info["sessions"] and not wrap:
        print(f"{name}: error: concurrency {max(loads)} > {info['sessions']} sessions in the corpus (AIPerf "
              f"refuses to reuse traces; add sessions or pass --aiperf-arg=--allow-dataset-wrap)", file=sys.stderr)
        return 2
    request_count = args.request_count or info["requests"]
    args.store_bytes = args.store_bytes or _store_bytes(sessions, args.stores)

    venv = env_mod.ensure_venv(args.venv, args.python)
    from shared.engine.models import smollm2_gguf_path

    hf_home = venv / "hf-home"
    ensure_tokenizer(hf_home, smollm2_gguf_path(), env_mod.venv_python(venv))
    version = env_mod.installed_version(venv)
    print(f"{name}: AIPerf {version}; corpus {traces}: {info['sessions']} sessions, {info['requests']} requests "
          f"({info['subagent_requests']} in {info['subagents']} subagents), prompts median "
          f"{info['median_input_tokens']:g} / max {info['max_input_tokens']} tokens, ceiling {info['ceiling']:.1%}; "
          f"pool {', '.join(pools) if not args.url else 'external'} x concurrency {loads}, {request_count} "
          f"requests per run, think cap {args.think_cap if args.think_cap is not None else 'none'}", flush=True)

    runs = run_matrix(args, env_mod.aiperf_exe(venv), hf_home, traces, sessions, pools, loads, request_count,
                      work, log=lambda m: print(m, flush=True))
    md = summary.table(runs)
    print()
    print(md)
    result = {"kind": "moorage-bench-aiperf", "aiperf_version": version,
              "params": {k: v for k, v in vars(args).items()},
              "corpus": {"traces": traces, "made_by": made_by, **info}, "machine": _machine(),
              "elapsed_s": round(time.monotonic() - t0, 1), "table": md, "runs": runs,
              "notes": ["cache read = AIPerf's overall_usage_prompt_cache_read_pct (server cached_tokens / prompt "
                        "tokens); ceiling = its theoretical_prefix_cache_hit over the requests sent",
                        "errors (rejected): every failed request (those answered 429/503)",
                        "TTFT and ITL as AIPerf measures them (ITL per request, then percentiles over requests)"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.png or str(out.with_suffix(".png"))
    if any(r.get("summary") for r in runs):
        summary.plot(runs, png, f"moorage bench aiperf{' (quick)' if args.quick else ''}: AIPerf {version}, "
                                f"{args.model}, {info['sessions']} sessions / {info['requests']} requests, "
                                f"ceiling {info['ceiling']:.0%}")
    else:
        png = None
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f" in {result['elapsed_s']:.0f} s (artifacts in {work})")
    failed = sum(1 for r in runs if not r.get("summary") or r["summary"]["errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
