"""What a GPU decode step costs, eager against CUDA graphs: launches, kernels, time.

    python scripts/gpu_decode_report.py --model DIR [--dtype bfloat16] [--batch-sizes 1,32]
        [--context 512] [--output-json FILE]

For each mode (`--enforce-eager`, then CUDA graphs) it builds the engine once (graph
capture time and memory are read from the runner), brings B requests of `--context`
prompt tokens to decoding, and over a few decode-only steps counts, with the torch
profiler, the host's kernel launches (cudaLaunchKernel and friends, cudaGraphLaunch) and
the kernels the GPU ran, and times the steps (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenloom import LLM, SamplingParams

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _decoding(llm: LLM, batch: int, context: int, steps: int) -> list[str]:
    eng = llm.llm_engine
    rids = [f"r{batch}-{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, 1000, (context,), generator=g).tolist()
        eng.add_request(rids[i], {"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True))
    while not (len(eng.scheduler.running) == batch and not eng.scheduler.waiting
               and all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running)):
        eng.step()
    return rids


def measure(llm: LLM, batch: int, context: int, steps: int = 20) -> dict:
    eng = llm.llm_engine
    rids = _decoding(llm, batch, context, steps + 8)
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCH_CALLS)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset")))
    eng.abort_request(rids)
    while eng.has_unfinished_requests():
        eng.step()
    return {"batch": batch, "context": context, "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_min": min(times) * 1e3, "host_launches_per_step": launches / 3, "gpu_kernels_per_step": kernels / 3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--output-json")
    a = ap.parse_args()
    batches = [int(x) for x in a.batch_sizes.split(",")]
    doc = {"model": a.model, "dtype": a.dtype, "device": torch.cuda.get_device_name(), "modes": {}}
    for mode, eager in (("eager", True), ("cuda_graphs", False)):
        t = time.perf_counter()
        llm = LLM(a.model, dtype=a.dtype, device="cuda", max_model_len=a.context + 256,
                  max_num_seqs=max(batches), enforce_eager=eager)
        runner = llm.llm_engine.runner
        g = runner.graphs
        info = {"attention_backend": runner.attn.name, "engine_start_s": time.perf_counter() - t,
                "graphs": None if g is None else {"sizes": g.sizes, "capture_s": g.capture_seconds,
                                                  "memory_mib": g.graph_memory_bytes / 2**20}}
        info["points"] = [measure(llm, b, a.context) for b in batches]
        doc["modes"][mode] = info
        print(mode, json.dumps(info, indent=1), flush=True)
        del llm, runner, g
        torch.cuda.empty_cache()
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
