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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moorage", description="moorage: disaggregated serving with a shared KV pool")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"moorage {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
