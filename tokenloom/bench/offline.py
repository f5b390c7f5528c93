"""Run a workload through the in-process engine and time it from its own step events.

Two ways in, same records out:

- all requests at once through the public `LLM.generate` (what `bench throughput` does);
- requests added to the `LLMEngine` when their arrival times come, stepping in between
  (what `bench sweep` does for finite request rates, so TTFT includes queueing exactly
  as a server would see it, without HTTP in the way).

Per-token times and each step's shape come from the engine's `StepEvent`s, kept by
`StepRecorder` (tokenloom/measure/steps.py, shared with the simulator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from tokenloom.measure.metrics import RequestRecord
from tokenloom.measure.steps import StepRecorder
from tokenloom.measure.workloads import BenchRequest


@dataclass
class OfflineRun:
    records: list[RequestRecord]
    duration_s: float
    steps: StepRecorder
    outputs: list[Any]  # RequestOutput, in workload order


def sampling_params_for(reqs: Sequence[BenchRequest], ignore_eos: bool, structured: Any = None) -> list:
    """`structured`: a `StructuredOutputsParams` every request's output must follow."""
    from tokenloom.sampling_params import SamplingParams

    # temperature 0: greedy, so the engine and the HF baseline do the same work.
    return [SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos, temperature=0.0, detokenize=True,
                           structured_outputs=structured)
            for r in reqs]


def _records(reqs: Sequence[BenchRequest], outputs: Sequence[Any], rec: StepRecorder, t0: float) -> list[RequestRecord]:
    records = []
    for req, out in zip(reqs, outputs):
        r = RequestRecord(prompt_len=req.prompt_len, arrival_time=req.arrival_time, group=req.group,
                          expected_output_len=req.output_len)
        err = getattr(out, "error", None)
        comp = out.outputs[0] if out.outputs else None
        if err or comp is None or comp.finish_reason in ("error", "abort"):
            r.success, r.error = False, err or f"finish_reason={comp.finish_reason if comp else None}"
            records.append(r)
            continue
        times = [t - t0 for t in rec.token_times.get(out.request_id, [])]
        r.output_len = len(comp.token_ids)
        r.token_times = times
        r.first_token_time = times[0] if times else None
        m = out.metrics
        # Latencies count from the workload's arrival time (t=0 for a burst), which is
        # also what the engine stamped as arrival when arrivals are honored.
        r.end_time = (m.finished_time - t0) if m and m.finished_time else (times[-1] if times else None)
        records.append(r)
    return records


def run_generate(llm: Any, reqs: Sequence[BenchRequest], *, ignore_eos: bool = True,
                 progress: bool = False, keep_events: bool = False, structured: Any = None) -> OfflineRun:
    """All requests at once through `LLM.generate` (arrival times ignored); `structured`: a
    `StructuredOutputsParams` applied to every request."""
    rec = StepRecorder(keep_events=keep_events)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
    params = sampling_params_for(reqs, ignore_eos, structured)
    llm.llm_engine.add_observer(rec)
    try:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=progress)
        duration = time.perf_counter() - t0
    finally:
        llm.llm_engine.remove_observer(rec)
    return OfflineRun(_records(reqs, outputs, rec, t0), duration, rec, outputs)


def run_with_arrivals(llm: Any, reqs: Sequence[BenchRequest], *, ignore_eos: bool = True,
                      progress: bool = False, keep_events: bool = False, id_prefix: str = "bench") -> OfflineRun:
    """Add each request to the engine when its arrival time comes; step in between.

    A request that arrives during a step is stamped with its true arrival time, so its
    TTFT includes waiting for that step to finish -- as it would on a server."""
    engine = llm.llm_engine
    rec = StepRecorder(keep_events=keep_events)
    params = sampling_params_for(reqs, ignore_eos)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_time)
    ids = [f"{id_prefix}-{i}" for i in range(len(reqs))]
    done: dict[str, Any] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="requests", unit="req", dynamic_ncols=True)
    engine.add_observer(rec)
    try:
        t0 = time.perf_counter()
        nxt = 0
        while nxt < len(order) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while nxt < len(order) and t0 + reqs[order[nxt]].arrival_time <= now:
                i = order[nxt]
                nxt += 1
                try:
                    engine.add_request(ids[i], {"prompt_token_ids": list(reqs[i].prompt_token_ids)}, params[i],
                                       arrival_time=t0 + reqs[i].arrival_time)
                except ValueError as e:
                    done[ids[i]] = _failed(ids[i], str(e))
                    if bar is not None:
                        bar.update(1)
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            elif nxt < len(order):
                time.sleep(max(0.0, t0 + reqs[order[nxt]].arrival_time - time.perf_counter()))
        duration = time.perf_counter() - t0
    finally:
        engine.remove_observer(rec)
        if bar is not None:
            bar.close()
    outputs = [done[i] for i in ids]
    return OfflineRun(_records(reqs, outputs, rec, t0), duration, rec, outputs)


def _failed(request_id: str, message: str) -> Any:
    from tokenloom.outputs import CompletionOutput, RequestOutput

    out = RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
                        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                        finished=True)
    out.error = message  # type: ignore[attr-defined]
    return out


def run_offline(llm: Any, reqs: Sequence[BenchRequest], *, ignore_eos: bool = True, progress: bool = False,
                honor_arrivals: bool = True, keep_events: bool = False) -> OfflineRun:
    """`run_with_arrivals` when any request arrives after t=0 (and arrivals are honored),
    else `run_generate`."""
    if honor_arrivals and any(r.arrival_time > 0 for r in reqs):
        return run_with_arrivals(llm, reqs, ignore_eos=ignore_eos, progress=progress, keep_events=keep_events)
    return run_generate(llm, reqs, ignore_eos=ignore_eos, progress=progress, keep_events=keep_events)


def warmup(llm: Any, vocab_range: tuple[int, int], prompt_len: int = 16, output_len: int = 4) -> None:
    """One short untimed request: the first forward pays one-time costs (allocator
    growth, lazy init, compile) that would otherwise land in the first measurement."""
    lo, hi = vocab_range
    ids = [lo + (i * 7919) % (hi - lo) for i in range(prompt_len)]
    run_generate(llm, [BenchRequest(ids, output_len)], ignore_eos=True)


# ---------------------------------------------------------------------------
# helpers shared by the offline commands
# ---------------------------------------------------------------------------


def build_llm(args: Any, **overrides: Any) -> Any:
    """`LLM` from parsed engine flags (plus overrides, e.g. a sweep point)."""
    from tokenloom.config import EngineArgs
    from tokenloom.entrypoints.llm import LLM

    ea = EngineArgs.from_cli_args(args, **overrides)
    kw = {k: v for k, v in ea.__dict__.items() if k != "model"}
    return LLM(ea.model, **kw)


def engine_vocab_range(llm: Any) -> tuple[int, int]:
    from tokenloom.measure.workloads import vocab_range_for

    return vocab_range_for(llm.get_tokenizer(), llm.llm_engine.vocab_size)


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process so far (monotonic over its life)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB
    except (ImportError, OSError):
        return None


def peak_device_bytes(device: Any) -> int | None:
    """Peak memory PyTorch's caching allocator has held on an accelerator (None on CPUs,
    where the weights and KV pool count in the process's RSS instead)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def current_rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None
