"""`tokenloom bench throughput`: offline throughput, optionally against HF transformers.

Every request of the workload goes to `LLM.generate` at once (arrival times are ignored:
this measures how fast the engine empties a full queue).  Reported: requests/s, output
tokens/s, total tokens/s, the step shape (batch occupancy, step time, engine overhead)
and peak RSS.  With `--baseline hf` the same requests then run through transformers'
`generate` in this process (same weights, dtype, threads; static batches of
`--baseline-batch-size`), and the speedup is the ratio of the two output-token rates
measured in this one run.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rich.console import Console

from tokenloom.measure import metrics, report
from tokenloom.bench.offline import (build_llm, current_rss_bytes, engine_vocab_range, peak_device_bytes,
                                     peak_rss_bytes, run_generate, warmup)
from tokenloom.measure.workloads import BenchRequest, workload_from_args, workload_stats


def _gib(x: int | None) -> float | None:
    return None if x is None else x / 2**30


def run_baseline(llm: Any, reqs: list[BenchRequest], *, batch_size: int, ignore_eos: bool, progress: bool) -> dict:
    from tokenloom.bench.hf_baseline import load_hf_model, run_hf_generate

    eng = llm.llm_engine
    rss_before = current_rss_bytes()
    model = load_hf_model(str(eng.model_path), eng.loaded.dtype, eng.loaded.device)
    tok = llm.get_tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (next(iter(eng.eos_token_ids), 0))
    # Untimed warm-up, as for the engine.
    run_hf_generate(model, reqs[:1], batch_size=1, ignore_eos=True, pad_token_id=pad)
    run = run_hf_generate(model, reqs, batch_size=batch_size, ignore_eos=ignore_eos, pad_token_id=pad,
                          eos_token_ids=sorted(eng.eos_token_ids), progress=progress)
    out = run.to_dict()
    # The process peak includes the engine, still loaded; the delta is HF's own share.
    out["peak_rss_gib"] = _gib(peak_rss_bytes())
    rss_after = current_rss_bytes()
    out["rss_added_gib"] = _gib(rss_after - rss_before) if rss_after and rss_before else None
    del model
    return out


def main(args: argparse.Namespace) -> int:
    console = Console()
    progress = not args.disable_tqdm
    llm = build_llm(args)
    eng = llm.llm_engine
    rss_loaded = current_rss_bytes()
    vocab = engine_vocab_range(llm)
    spec, reqs = workload_from_args(args, vocab, max_model_len=eng.config.max_model_len)
    if any(r.arrival_time > 0 for r in reqs):
        console.print("[yellow]note:[/yellow] bench throughput sends every request at once; "
                      "arrival times are ignored (use bench serve or bench sweep for rates)")
    console.print(f"[bold]bench throughput[/bold] model={eng.model_name} dtype={str(eng.loaded.dtype).replace('torch.', '')} "
                  f"device={eng.loaded.device} workload={spec.name} requests={len(reqs)}")

    warmup(llm, vocab)
    run = run_generate(llm, reqs, ignore_eos=spec.ignore_eos, progress=progress)
    summary = metrics.summarize(run.records, duration=run.duration_s)
    engine_res: dict[str, Any] = {
        "duration_s": run.duration_s,
        "num_requests": len(reqs),
        "completed": summary.completed,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "rss_after_load_gib": _gib(rss_loaded),
        "peak_rss_gib": _gib(peak_rss_bytes()),
        # The memory the engine needs by design: weights + the KV pool it allocates up
        # front.  Peak RSS beyond that is interpreter, tokenizer, activations, allocator.
        "weights_gib": _gib(eng.loaded.weight_bytes),
        "kv_pool_gib": _gib(eng.runner.kv_cache_bytes),
        "steps": run.steps.summary(),
    }
    # Set the peak against weights + KV where they live: host RSS on CPUs, the allocator's
    # peak on a GPU (whose host RSS holds neither).
    by_design = engine_res["weights_gib"] + engine_res["kv_pool_gib"]
    engine_res["peak_device_gib"] = _gib(peak_device_bytes(eng.loaded.device))
    if engine_res["peak_device_gib"]:
        engine_res["peak_device_over_weights_kv"] = engine_res["peak_device_gib"] / by_design
    elif engine_res["peak_rss_gib"]:
        engine_res["peak_rss_over_weights_kv"] = engine_res["peak_rss_gib"] / by_design
    results: dict[str, Any] = {"engine": engine_res, "latency": summary}

    if args.baseline == "hf":
        console.print(f"[bold]baseline[/bold] transformers generate, static batches of {args.baseline_batch_size}")
        hf = run_baseline(llm, reqs, batch_size=args.baseline_batch_size, ignore_eos=spec.ignore_eos,
                          progress=progress)
        results["hf"] = hf
        results["speedup"] = {
            "output_throughput": engine_res["output_throughput"] / hf["output_throughput"],
            "request_throughput": engine_res["request_throughput"] / hf["request_throughput"],
            "total_token_throughput": engine_res["total_token_throughput"] / hf["total_token_throughput"],
        }

    _print(console, results)
    if args.output_json:
        config = report.args_to_config(args)
        ec = eng.config
        config["resolved"] = {"model_path": ec.model, "dtype": str(eng.loaded.dtype), "device": ec.device,
                              "max_model_len": ec.max_model_len, "max_num_batched_tokens": ec.max_num_batched_tokens,
                              "num_kv_blocks": ec.num_kv_blocks}
        doc = report.build_report("throughput", config=config,
                                  workload={"spec": spec.to_dict(), "stats": workload_stats(reqs)},
                                  results=results)
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}")
    return 0 if summary.completed == len(reqs) else 1


def _print(console: Console, results: dict) -> None:
    from rich.table import Table

    e = results["engine"]
    hf = results.get("hf")
    t = Table(title="Offline throughput", title_justify="left")
    t.add_column("")
    t.add_column("tokenloom", justify="right")
    if hf:
        t.add_column("HF generate", justify="right")
        t.add_column("speedup", justify="right")
    rows = [("requests/s", "request_throughput", 3), ("output tokens/s", "output_throughput", 1),
            ("total tokens/s", "total_token_throughput", 1), ("duration (s)", "duration_s", 2),
            ("output tokens", "total_output_tokens", 0), ("peak RSS (GiB)", "peak_rss_gib", 2)]
    for label, key, digits in rows:
        cells = [label, report.fmt(e.get(key), digits)]
        if hf:
            cells.append(report.fmt(hf.get(key), digits))
            sp = e.get(key) / hf[key] if key.endswith("throughput") and hf.get(key) else None
            cells.append(f"{sp:.2f}x" if sp and math.isfinite(sp) else "")
        t.add_row(*cells)
    console.print(t)
    for key, what in (("peak_rss", "peak RSS"), ("peak_device", "peak device memory")):
        if e.get(f"{key}_over_weights_kv"):
            console.print(f"engine memory: weights {e['weights_gib']:.2f} GiB + KV pool {e['kv_pool_gib']:.2f} GiB; "
                          f"{what} {e[f'{key}_gib']:.2f} GiB = {100 * (e[f'{key}_over_weights_kv'] - 1):+.1f}%")
    if hf:
        console.print(f"peak RSS is the process's; HF's column includes the engine still loaded "
                      f"(HF added {report.fmt(hf.get('rss_added_gib'))} GiB)")
    console.print(report.dict_table(e["steps"], "Engine steps (batch quality)"))
    lat = results["latency"]
    console.print(report.latency_table(lat, "Per-request latency inside the offline run (ms)"))
