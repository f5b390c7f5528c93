"""CLI: `tokenloom generate` (offline completions) and `tokenloom make-model`."""

from __future__ import annotations

import argparse
import sys

from tokenloom.config import EngineArgs, parse_size


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1)


def sampling_params_from_args(args: argparse.Namespace):
    from tokenloom.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def _generate(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.llm import LLM

    prompts = args.prompts or ["def quicksort(arr):"]
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    outs = llm.generate(prompts, sampling_params_from_args(args), use_tqdm=False)
    for o in outs:
        if o.error:
            print(f"error: {o.error}", file=sys.stderr)
            continue
        for c in o.outputs:
            sys.stdout.write(f"{o.prompt if o.prompt is not None else ''}{c.text}\n")
            if args.verbose:
                sys.stdout.write(f"  [finish_reason={c.finish_reason} tokens={len(c.token_ids)}]\n")
            sys.stdout.write("-" * 40 + "\n")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from tokenloom.model.tools.make_model import make_model

    path = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, init_std=args.init_std,
                      max_shard_bytes=parse_size(args.max_shard_size) if args.max_shard_size else None)
    print(f"wrote {args.preset} ({args.dtype}, random weights) to {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions offline")
    p.add_argument("prompts", nargs="*", help="prompt text(s); default: 'def quicksort(arr):'")
    p.add_argument("-v", "--verbose", action="store_true")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=_generate)

    from tokenloom.model.tools.presets import PRESETS

    m = sub.add_parser("make-model", help="write a random-weight HF model directory in a real architecture's shape")
    m.add_argument("--preset", required=True, choices=sorted(PRESETS))
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--init-std", type=float, default=None)
    m.add_argument("--max-shard-size", default=None, help="shard the weights, e.g. 500MB")
    m.set_defaults(func=_make_model)
