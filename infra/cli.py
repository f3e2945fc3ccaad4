"""The `moorage` command. Each subcommand lives in its own module and is imported only when used."""

from __future__ import annotations

import argparse
import sys

from shared.engine.models import BUNDLED_MODELS


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run the engine in-process on one prompt and print the completion")
    p.add_argument("--model", default="smollm2-135m",
                   help=f"one of {', '.join(BUNDLED_MODELS)}, a .gguf file or a HF model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages the KV pool is split into")
    p.add_argument("--show-tokens", action="store_true", help="also print token ids and sources to stderr")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.models import load_model
    from shared.engine.sampling import SamplingParams
    from shared.logging import setup_logging

    setup_logging("generate", "cli", level="warning", json=False)  # stdout is the completion, nothing else
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompt_ids = (tok.chat_token_ids([{"role": "user", "content": args.prompt}]) if args.chat
                  else tok.encode(args.prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    blocks = -(-(len(prompt_ids) + args.max_tokens) // 16) + 1
    engine = Engine(loaded, EngineConfig(num_blocks=blocks, stages=args.stages))
    [seq] = engine.generate([prompt_ids], params)
    print(seq.output_text)
    if args.show_tokens:
        print(f"prompt_tokens={len(prompt_ids)} output_ids={seq.output_ids} finish={seq.finish_reason}",
              file=sys.stderr)
    return 0


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the presets, or say whether and how moorage would load a model "
                                      "(architecture, context, dtypes, KV bytes per token, tokenizer) without "
                                      "loading its weights")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="presets or paths (.gguf files, Hugging Face directories); none: every preset")
    p.add_argument("--json", action="store_true", help="one JSON object per model, on one line each")
    p.set_defaults(func=_models)


def _models(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from infra.model_report import PRESETS, inspect_model
    from shared.logging import setup_logging

    setup_logging("models", "cli", level="warning", json=False)
    reports = [inspect_model(m) for m in (args.models or list(PRESETS))]
    for r in reports:
        if args.json:
            print(json.dumps(dataclasses.asdict(r)))
        else:
            print("\n".join(r.lines() + ([f"  preset         {PRESETS[r.model]}"] if r.model in PRESETS else [])))
    return 0 if all(r.loadable for r in reports) else 1


SERVICES = {
    "router": "the OpenAI-compatible HTTP API: tokenization, prefill choice, dispatch on the bus",
    "gate": "KV admission per decode instance",
    "prefill": "prefill engine: device prefix cache, chunked prefill, KV handoff, the pool connector",
    "decode": "decode engine: landing slots, continuous batching, token stream",
    "master": "the KV pool's master (supervises mooncake_master)",
    "store": "a DRAM segment of the KV pool",
}
SERVICE_NAMES = tuple(SERVICES)


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start the whole system on this machine (NATS, gate, prefill, decode, router)")
    p.add_argument("--model", help="model to serve (default smollm2-135m); same as --set up.model=...")
    p.add_argument("--port", type=int, help="router port (default 8000); same as --set up.port=...")
    p.add_argument("--config", help="TOML file with [up] and per-service sections, e.g. [prefill.engine]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. up.port=8080 or prefill.engine.num_blocks=4096")
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from infra.up import UpConfig, run_up
    from shared.config import load_config

    overrides = list(args.set)
    if args.model:
        overrides.append(f"up.model={args.model}")
    if args.port is not None:
        overrides.append(f"up.port={args.port}")
    return run_up(load_config(UpConfig, args.config, overrides))


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="health and load of every service, as reported on the bus")
    p.add_argument("--nats-url", help="default: the bus of the `moorage up` running from --run-dir")
    p.add_argument("--run-dir", default=".moorage",
                   help="where the `moorage up` to ask about keeps its state (its up.run_dir; default %(default)s); "
                        "exits 1 saying so when no running system is found there")
    p.add_argument("--prefix", default="moorage", help="bus subject prefix")
    p.set_defaults(func=lambda a: __import__("infra.status", fromlist=["run_status"]).run_status(
        a.nats_url, a.run_dir, a.prefix))


# Subcommands whose arguments belong to another parser: main() hands them their argv before argparse
# sees it (argparse cannot pass a leading --help through to a REMAINDER), so `moorage trace --help`,
# `moorage bench --help` and `moorage serve --help` print help.
TRACE_TARGET = "bench.agentic.synth:main"
BENCHES = {
    "agentic": ("bench.agentic.replay:main", "AgentX-style replay of agent traces against moorage (starts a system)"),
    "tiers": ("bench.agentic.tiers:main", "tool pauses under memory pressure: lru, session, +prefetch, +disk, "
                                          "+compact and a measured ceiling, side by side (issue 29)"),
    "sweep": ("bench.agentic.sweep:main", "the same traces at several loads against several topologies"),
    "aiperf": ("bench.aiperf.main:main", "NVIDIA AIPerf replays agent traces against moorage + SmolLM2, pool on "
                                         "vs off (AIPerf in its own .venv-aiperf, made on first use)"),
}


def _listing(usage: str, entries: dict[str, str], footer: str) -> str:
    width = max(len(n) for n in entries)
    return "\n".join([usage, "", *(f"  {n.ljust(width)}  {h}" for n, h in entries.items()), "", footer])


def _dispatch(rest: list[str], names: dict[str, str], usage: str, footer: str, run) -> int:
    """`moorage <command> NAME ...` -> run(NAME, rest); no name: the listing on stderr, exit 2; -h/--help: on
    stdout, exit 0."""
    if rest and rest[0] in names:
        return run(rest[0], rest[1:])
    text = _listing(usage, names, footer)
    if rest[:1] in (["-h"], ["--help"]):
        print(text)
        return 0
    print(text, file=sys.stderr)
    if rest:
        print(f"\nerror: unknown name {rest[0]!r} (choose from {', '.join(names)})", file=sys.stderr)
    return 2


def _serve_main(rest: list[str]) -> int:
    return _dispatch(rest, SERVICES, f"usage: moorage serve {{{','.join(SERVICES)}}} [--config FILE] "
                     "[--set SECTION.KEY=VALUE] [--print-config]",
                     "Runs one service in the foreground (what compose and systemd start); "
                     "`moorage serve <service> --help` for its options.", _serve)


def service_config_class(service: str) -> type:
    import importlib

    config_module = importlib.import_module(f"services.{service}.config")
    return next(getattr(config_module, n) for n in dir(config_module)
                if n.endswith("Config") and n.lower() == f"{service}config")


def _serve(service: str, rest: list[str]) -> int:
    import importlib

    from shared.service import run_service

    serve = importlib.import_module(f"services.{service}.main").serve
    return run_service(service, service_config_class(service), serve, rest)


def _watch_main(rest: list[str]) -> int:
    return _dispatch(rest, SERVICES, f"usage: moorage watch {{{','.join(SERVICES)}}} [moorage serve options]",
                     "Runs `moorage serve <service>` as a child and announces its exit on the bus, so peers "
                     "act at once (compose's command; see infra/exits.py).",
                     lambda service, argv: _call("infra.exits:watch", service, argv))


def _exited_main(rest: list[str]) -> int:
    return _dispatch(rest, SERVICES, f"usage: moorage exited {{{','.join(SERVICES)}}} --config FILE",
                     "Announces on the bus that the service's process ended, from systemd's EXIT_CODE / "
                     "EXIT_STATUS / INVOCATION_ID (each unit's ExecStopPost; see infra/exits.py). Exits 0.",
                     lambda service, argv: _call("infra.exits:announce_systemd", service, argv))


def _bench_main(rest: list[str]) -> int:
    return _dispatch(rest, {n: h for n, (_, h) in BENCHES.items()},
                     f"usage: moorage bench {{{','.join(BENCHES)}}} [options]",
                     "`moorage bench <name> --help` for its options. Results go to runs/<name>-<time>/ "
                     "(gitignored) unless --out says otherwise.",
                     lambda name, argv: _call(BENCHES[name][0], argv))


def _call(target: str, *args) -> int:
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(*args)


def _trace_main(rest: list[str]) -> int:
    """`moorage trace show|breakdown`: request traces (infra/tracecli.py); synth|validate: agent traces."""
    from infra.tracecli import ACTIONS

    if rest[:1] and rest[0] in ACTIONS:
        return _call("infra.tracecli:main", rest)
    if rest[:1] not in (["-h"], ["--help"]):
        return _call(TRACE_TARGET, rest)
    try:
        _call(TRACE_TARGET, rest)  # the agent-trace actions' help (argparse exits)
    except SystemExit:
        pass
    print("\nrequest traces (OpenTelemetry spans of served requests):\n"
          "    show            one request's waterfall: show REQUEST_ID | show --last\n"
          "    breakdown       p50/p90/p99 per stage across requests [--since 10m]")
    return 0


PASSTHROUGH = {"trace": _trace_main, "bench": _bench_main, "serve": _serve_main, "watch": _watch_main,
               "exited": _exited_main, "deploy": lambda rest: _call("infra.deploy:main", rest)}


def _add_passthrough(sub, name: str, help_: str) -> None:
    """Listed in `moorage --help`; main() dispatches it before parsing."""
    p = sub.add_parser(name, help=help_, add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: PASSTHROUGH[name](a.rest))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="moorage", description="moorage: disaggregated serving with a shared KV pool")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_models(sub)
    _add_up(sub)
    _add_passthrough(sub, "serve", f"run one service ({', '.join(SERVICES)}): what compose and systemd start")
    _add_passthrough(sub, "watch", "run one service and announce its exit on the bus (compose's command)")
    _add_passthrough(sub, "exited", "announce that a service's process ended (systemd's ExecStopPost)")
    _add_status(sub)
    _add_passthrough(sub, "trace", "agent traces: `synth` a corpus, `validate` one; request traces: `show`, "
                                   "`breakdown`")
    _add_passthrough(sub, "deploy", "render a cluster's configs, systemd units and NATS routes from one inventory")
    _add_passthrough(sub, "bench", f"benchmarks against a started system: {', '.join(BENCHES)}")
    command = argv[0] if argv else None
    try:
        if command in PASSTHROUGH:
            return PASSTHROUGH[command](argv[1:])
        args = parser.parse_args(argv)
        return args.func(args)
    except ValueError as e:  # includes ConfigError
        print(f"moorage {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
