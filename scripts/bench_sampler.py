"""What sampling costs per step: the sampler on [rows, vocab] logits, our CPU filters vs PyTorch's.

    python scripts/bench_sampler.py [--vocab 151936] [--rows 1,32] [--rounds 7]

For each row count, logit shape (flat: N(0, 1) logits, whose nucleus is most of the vocabulary;
peaked: N(0, 36)) and setting (temperature 1 with top_p 0.95, top_k 50, neither, or the top-5
logprobs of each sampled token), times `runner.sampler.sample` with our kernels
(kernels/cpu_sampling.cpp: sort-free top-k / top-p, one-pass logprob ranks and tops) and with
them switched off (PyTorch's ops: topk, and for top-p a partial sort of 1,024 candidates with a
full sort of rows whose nucleus lies past them; log_softmax, a comparison and topk for
logprobs), alternating in one process,
glibc's heap kept as the engine keeps it (kernels/glibc_heap.py).
Prints medians in ms per step (docs/performance.md, "Top-k and top-p without a sort").

    python scripts/bench_sampler.py --engine DIR [--quantization int8] [--rows 1,32]

instead times whole engine decode steps of the checkpoint in DIR (prompts of 128 tokens,
temperature 1, top_p 0.95), our top-p kernel against PyTorch's filters in the same engine,
alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from tokenloom import SamplingParams
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.kernels import glibc_heap
from tokenloom.runner.sampler import SamplingRow, sample

SETTINGS = {"top_p 0.95": {"top_p": 0.95}, "top_k 50": {"top_k": 50}, "neither": {}, "logprobs 5": {"logprobs": 5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine", metavar="DIR", help="time whole engine decode steps of this checkpoint")
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    if args.engine:
        return bench_engine(args)
    glibc_heap.keep_step_buffers()  # as the engine's model runner does: no page faults per step
    print(f"torch threads: {torch.get_num_threads()}; our kernels: {cpu_kernels.fused_enabled()}")
    g = torch.Generator().manual_seed(0)
    for n in (int(r) for r in args.rows.split(",")):
        for shape, spread in (("flat", 1.0), ("peaked", 6.0)):
            logits = torch.randn(n, args.vocab, generator=g) * spread
            for name, kw in SETTINGS.items():
                rows = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0, seed=i, **kw), [], [], frozenset(),
                                    torch.Generator().manual_seed(i)) for i in range(n)]
                times: dict[str, list[float]] = {"ours": [], "pytorch": []}
                for _ in range(args.rounds):
                    for way in times:
                        off = way == "pytorch"
                        with contextlib.ExitStack() as stack:
                            if off:
                                _pytorch_ops(stack)
                            t0 = time.perf_counter()
                            sample(logits, rows)
                            times[way].append(time.perf_counter() - t0)
                ours, theirs = (statistics.median(times[w]) * 1e3 for w in ("ours", "pytorch"))
                print(f"{n:3d} rows {shape:6s} {name:10s}  ours {ours:8.2f} ms   pytorch's {theirs:8.2f} ms   "
                      f"{theirs / ours:5.1f}x")


def _pytorch_ops(stack: contextlib.ExitStack) -> None:
    """Our sampling kernels off for the rest of `stack`: the sampler takes PyTorch's ops, as on
    a machine without them."""
    for name in ("top_p_mask", "top_k_mask", "logprob_rows"):
        stack.enter_context(mock.patch.object(cpu_kernels, name, return_value=None))


def bench_engine(args) -> None:
    from tokenloom import LLM

    for n in (int(r) for r in args.rows.split(",")):
        llm = LLM(args.engine, dtype="bfloat16", quantization=args.quantization, max_model_len=400,
                  max_num_seqs=n, num_kv_blocks=n * 26 + 8)
        eng = llm.llm_engine
        for i in range(n):
            eng.add_request(f"r{i}", {"prompt_token_ids": [5 + (i * 7 + j * 13) % 3000 for j in range(128)]},
                            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=200, ignore_eos=True, seed=i))
        while eng.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running):
            eng.step()
        times: dict[str, list[float]] = {"ours": [], "pytorch": []}
        for _ in range(args.rounds):
            for way in times:
                with contextlib.ExitStack() as stack:
                    if way == "pytorch":
                        _pytorch_ops(stack)
                    for _ in range(4):
                        t0 = time.perf_counter()
                        eng.step()
                        times[way].append(time.perf_counter() - t0)
        ours, theirs = (statistics.median(times[w]) * 1e3 for w in ("ours", "pytorch"))
        print(f"{n:3d} rows, {args.quantization or 'bf16'}, temperature 1, top_p 0.95: decode step {ours:7.1f} ms "
              f"with our filters, {theirs:7.1f} ms with PyTorch's ({theirs / ours:.2f}x)")
        del llm, eng


if __name__ == "__main__":
    main()
