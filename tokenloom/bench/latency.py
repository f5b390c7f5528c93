"""`tokenloom bench latency`: one batch, fixed lengths, timed end to end and per step.

A batch of `--batch-size` requests, each `--input-len` prompt tokens and exactly
`--output-len` generated tokens, is run `--num-iters` times (after warm-up iterations).
Per iteration: batch latency (first add to last token).  From the step events: the
prefill steps (the seed's TTFT part) and the decode steps, whose time is the seed's
"one decode step" -- every request in the batch gets one token per step.

`--structured-output KIND` runs each iteration twice, unconstrained and with every
request's output held to a grammar (in alternating order), and reports the median
full-batch decode step of each and their ratio: what grammar masks cost a step.
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console

from tokenloom.measure import metrics, report
from tokenloom.bench.offline import build_llm, engine_vocab_range, run_generate
from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, generate_workload


def fixed_batch(batch_size: int, input_len: int, output_len: int, vocab: tuple[int, int], seed: int) -> list[BenchRequest]:
    spec = WorkloadSpec(name="random", num_prompts=batch_size, input_len=(input_len, input_len),
                        output_len=(output_len, output_len), vocab_range=vocab, seed=seed)
    return generate_workload(spec)


# The grammars `--structured-output` times: a JSON schema of the kind tool calls and
# extraction send, any JSON object, and a regular expression.
_BENCH_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "tags", "address"]}


def bench_grammar(kind: str):
    from tokenloom.sampling_params import StructuredOutputsParams

    return {"json_object": StructuredOutputsParams(json_object=True),
            "json_schema": StructuredOutputsParams(json=_BENCH_SCHEMA),
            "regex": StructuredOutputsParams(regex=r"([a-z]+ ){1,200}[0-9]+")}[kind]


def full_batch_decode_ms(run, batch_size: int) -> list[float]:
    s = run.steps
    return [d * 1e3 for i, d in enumerate(s.durations) if not s.num_prefill_tokens[i] and s.num_decode[i] == batch_size]


def main(args: argparse.Namespace) -> int:
    console = Console()
    llm = build_llm(args, max_num_seqs=max(args.max_num_seqs, args.batch_size))
    eng = llm.llm_engine
    if args.input_len + args.output_len > eng.config.max_model_len:
        raise ValueError(f"--input-len + --output-len ({args.input_len + args.output_len}) "
                         f"exceeds max_model_len ({eng.config.max_model_len})")
    vocab = engine_vocab_range(llm)
    console.print(f"[bold]bench latency[/bold] model={eng.model_name} batch={args.batch_size} "
                  f"in={args.input_len} out={args.output_len} iters={args.num_iters}")
    latencies: list[float] = []
    prefill_ms: list[float] = []
    decode_ms: list[float] = []
    decode_fwd_ms: list[float] = []
    ttft_ms: list[float] = []
    grammar = bench_grammar(args.structured_output) if args.structured_output else None
    constrained_ms: list[float] = []
    plain_ms: list[float] = []  # the unconstrained twins of the constrained runs
    for it in range(args.num_iters_warmup + args.num_iters):
        # A fresh seed per iteration: identical prompts would hit the prefix cache after
        # the first and time a different (cheaper) prefill.
        reqs = fixed_batch(args.batch_size, args.input_len, args.output_len, vocab, seed=args.seed + it)
        twin = None
        if grammar is not None and it % 2:  # alternate which of the pair runs first
            twin = run_generate(llm, fixed_batch(args.batch_size, args.input_len, args.output_len, vocab,
                                                 seed=args.seed + 10_000 + it), structured=grammar)
        run = run_generate(llm, reqs, ignore_eos=True, progress=False)
        if grammar is not None and twin is None:
            twin = run_generate(llm, fixed_batch(args.batch_size, args.input_len, args.output_len, vocab,
                                                 seed=args.seed + 10_000 + it), structured=grammar)
        if it < args.num_iters_warmup:
            continue
        if twin is not None:
            constrained_ms += full_batch_decode_ms(twin, args.batch_size)
            plain_ms += full_batch_decode_ms(run, args.batch_size)
        latencies.append(run.duration_s)
        s = run.steps
        for i, d in enumerate(s.durations):
            if s.num_prefill_tokens[i]:
                prefill_ms.append(d * 1e3)
            elif s.num_decode[i] == args.batch_size:  # full-batch decode steps only
                decode_ms.append(d * 1e3)
                decode_fwd_ms.append(s.forward_times[i] * 1e3)
        ttft_ms += [metrics.ttft(r) * 1e3 for r in run.records if metrics.ttft(r) is not None]

    lat = metrics.distribution(latencies, scale=1.0)
    dec = metrics.distribution(decode_ms)
    results = {
        "batch_latency_s": lat,
        "ttft_ms": metrics.distribution(ttft_ms),
        "prefill_step_ms": metrics.distribution(prefill_ms),
        "decode_step_ms": dec,
        "decode_forward_ms": metrics.distribution(decode_fwd_ms),
        "decode_engine_overhead_ms": float(np.mean(decode_ms) - np.mean(decode_fwd_ms)) if decode_ms else None,
        "decode_tokens_per_s": args.batch_size / (dec.median / 1e3) if decode_ms else None,
        "output_tokens_per_s": args.batch_size * args.output_len / lat.median if latencies else None,
    }
    if grammar is not None:
        plain, masked = np.median(plain_ms) if plain_ms else None, np.median(constrained_ms) if constrained_ms else None
        results["structured_output"] = {
            "kind": args.structured_output, "unconstrained_decode_step_ms": plain,
            "constrained_decode_step_ms": masked, "constrained_full_batch_steps": len(constrained_ms),
            "cost": (masked / plain - 1.0) if plain and masked else None}
    rows = []
    for name in ("batch_latency_s", "ttft_ms", "prefill_step_ms", "decode_step_ms", "decode_forward_ms"):
        d = results[name]
        rows.append({"metric": name, "n": d.count, "mean": d.mean, "median": d.median,
                     "p90": d.percentiles["p90"], "p99": d.percentiles["p99"]})
    console.print(report.rows_table(rows, "Latency", digits=3))
    console.print(report.dict_table({k: results[k] for k in ("decode_engine_overhead_ms", "decode_tokens_per_s",
                                                             "output_tokens_per_s")}, "Decode"))
    if grammar is not None:
        console.print(report.dict_table(results["structured_output"],
                                        "Structured output (median full-batch decode step, same run)"))
    if args.output_json:
        doc = report.build_report("latency", config=report.args_to_config(args), results=results,
                                  workload={"batch_size": args.batch_size, "input_len": args.input_len,
                                            "output_len": args.output_len})
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}")
    return 0
