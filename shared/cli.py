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


SERVICE_NAMES = ("router", "gate", "prefill", "decode")


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start the whole system on this machine (NATS, gate, prefill, decode, router)")
    p.add_argument("--model", help="model to serve (default smollm2-135m); same as --set up.model=...")
    p.add_argument("--port", type=int, help="router port (default 8000); same as --set up.port=...")
    p.add_argument("--config", help="TOML file with [up] and per-service sections, e.g. [prefill.engine]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. up.port=8080 or prefill.engine.num_blocks=4096")
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from shared.config import load_config
    from shared.up import UpConfig, run_up

    overrides = list(args.set)
    if args.model:
        overrides.append(f"up.model={args.model}")
    if args.port is not None:
        overrides.append(f"up.port={args.port}")
    return run_up(load_config(UpConfig, args.config, overrides))


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="health and load of every service, as reported on the bus")
    p.add_argument("--nats-url", help="default: the bus of the `moorage up` running from --run-dir")
    p.add_argument("--run-dir", default=".moorage")
    p.add_argument("--prefix", default="moorage", help="bus subject prefix")
    p.set_defaults(func=lambda a: __import__("shared.status", fromlist=["run_status"]).run_status(
        a.nats_url, a.run_dir, a.prefix))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run one service (what compose and systemd start)", add_help=False)
    p.add_argument("service", choices=SERVICE_NAMES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="--config FILE, --set KEY=VALUE, --print-config")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import importlib

    from shared.service import run_service

    config_module = importlib.import_module(f"services.{args.service}.config")
    config_cls = next(getattr(config_module, n) for n in dir(config_module)
                      if n.endswith("Config") and n.lower() == f"{args.service}config")
    serve = importlib.import_module(f"services.{args.service}.main").serve
    return run_service(args.service, config_cls, serve, args.rest)


def _add_passthrough(sub, name: str, help_: str, target: str) -> None:
    """A subcommand whose arguments belong to another module's own parser (benchmarks, traces)."""
    p = sub.add_parser(name, help=help_, add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _call(target, a.rest))


def _call(target: str, rest: list[str]) -> int:
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(rest)


def _bench(args: argparse.Namespace) -> int:
    targets = {"agentic": "bench.agentic.replay:main", "sweep": "bench.agentic.sweep:main"}
    if not args.rest or args.rest[0] not in targets:
        print(f"usage: moorage bench {{{','.join(targets)}}} [options]  (--help after the name for options)")
        return 2
    return _call(targets[args.rest[0]], args.rest[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moorage", description="moorage: disaggregated serving with a shared KV pool")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_up(sub)
    _add_serve(sub)
    _add_status(sub)
    _add_passthrough(sub, "trace", "agent traces: `synth` a corpus, `validate` one", "bench.agentic.synth:main")
    bench = sub.add_parser("bench", help="agentic replay (`bench agentic`) and topology sweeps (`bench sweep`)",
                           add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # includes ConfigError
        print(f"moorage {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
