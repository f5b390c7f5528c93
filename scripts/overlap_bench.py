"""Decode throughput and step time with `--async-scheduling` off and on (wall clock).

    python scripts/overlap_bench.py --model DIR [--device cuda] [--dtype bfloat16]
        [--batch-sizes 1,256] [--context 512] [--steps 64] [--repeats 3]
        [--modes off,on] [--kv-cache-memory 6GiB] [--output-json FILE]

Step events cannot time an overlapped step (its host work for step N+1 runs while step N
computes), so this times the engine from outside: for each batch size it brings B requests
of `--context` random prompt tokens to decoding, then times `--steps` calls of
`engine.step()` while every request decodes, and reports the median over `--repeats` of
the wall time per step and the tokens per second those steps produced.  Each mode builds
its own engine in this process, one after the other (`--kv-cache-memory` keeps the KV
pool the same size for both).  On a CPU both modes do the same work in the same order --
the forward pass is synchronous -- so expect equal figures there.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from tokenloom import EngineArgs, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine


def _window(eng: LLMEngine, batch: int, context: int, steps: int, seed: int) -> tuple[float, int]:
    """(seconds, tokens) of `steps` engine steps while all `batch` requests decode."""
    rng = random.Random(seed)
    hi = min(eng.vocab_size, len(eng.tokenizer)) - 1
    budget = eng.config.max_num_batched_tokens
    max_tokens = -(-batch * context // budget) + steps + 4  # none ends inside the window
    rids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, [rng.randint(10, hi) for _ in range(context)],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seen: dict[str, int] = {}
    while len(seen) < batch or min(seen.values()) < 1:  # prefill, until every request has a token
        for o in eng.step():
            seen[o.request_id] = len(o.outputs[0].token_ids)
    before = sum(seen.values())
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        for o in eng.step():
            seen[o.request_id] = len(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    tokens = sum(seen.values()) - before
    eng.abort_request(rids)
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()  # collects (and drops) a step launched ahead for the aborted requests
    return dt, tokens


def measure(args: argparse.Namespace, on: bool) -> dict:
    eng = LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                               kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch_sizes),
                               async_scheduling=on, seed=0))
    _window(eng, min(args.batch_sizes), 64, 4, seed=99)  # warm-up: kernels compiled, pools grown
    points = []
    for b in args.batch_sizes:
        runs = [_window(eng, b, args.context, args.steps, seed=r) for r in range(args.repeats)]
        step_ms = statistics.median(dt / args.steps * 1e3 for dt, _ in runs)
        tok_s = statistics.median(n / dt for dt, n in runs)
        points.append({"batch": b, "context": args.context, "steps": args.steps, "step_ms": step_ms,
                       "tokens_per_s": tok_s, "runs": [{"seconds": dt, "tokens": n} for dt, n in runs]})
        print(f"async_scheduling={'on ' if on else 'off'} batch {b:>3} ctx {args.context}: "
              f"step {step_ms:.3f} ms, {tok_s:,.0f} tok/s", flush=True)
    result = {"async_scheduling": on, "steps_launched_ahead": eng.num_steps_ahead, "device": str(eng.device),
              "device_name": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu",
              "dtype": args.dtype, "model": args.model, "points": points}
    eng.shutdown()
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="off,on")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    modes = [m.strip() == "on" for m in args.modes.split(",") if m.strip()]
    results = [measure(args, on) for on in modes]
    if [r["async_scheduling"] for r in results] == [False, True]:
        for off, on in zip(results[0]["points"], results[1]["points"]):
            print(f"batch {off['batch']:>3}: tokens/s on/off {on['tokens_per_s'] / off['tokens_per_s']:.3f}, "
                  f"step {off['step_ms']:.3f} ms off -> {on['step_ms']:.3f} ms on")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
