"""Online serving benchmark: stream a workload at `/v1/completions` and time every chunk.

Each request is sent when its arrival time comes (and, with `--max-concurrency C`, only
while fewer than C are in flight), as an OpenAI completions call with the prompt given
as token ids, `max_tokens` = its output length, `temperature` 0, `ignore_eos` (unless
`--respect-eos`) and `stream: true` with `stream_options.include_usage`, so the last
chunk reports how many tokens were really generated.  The arrival time of every
streamed chunk is recorded; `metrics.summarize` turns those timelines into TTFT, TPOT,
ITL, E2E, throughput and goodput.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from tokenloom.measure.metrics import RequestRecord
from tokenloom.measure.workloads import BenchRequest


@dataclass
class ServeRun:
    """Raw outcome of one serving run: per-request records on the run's clock (t=0 at start)."""

    records: list[RequestRecord]
    duration_s: float  # start of the run to the last response
    model: str
    base_url: str


async def fetch_model_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any] | None:
    """First entry of GET /v1/models (id, and max_model_len where the server reports it)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return data[0] if data else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def completion_payload(req: BenchRequest, model: str, ignore_eos: bool,
                       extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if extra_body:
        body.update(extra_body)
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                            record: RequestRecord, clock_zero: float) -> RequestRecord:
    """POST one streaming completion, filling `record` (times relative to `clock_zero`)."""
    now = lambda: time.perf_counter() - clock_zero  # noqa: E731
    record.send_time = now()
    usage_tokens: int | None = None
    usage_prompt: int | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                record.success = False
                record.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                record.end_time = now()
                return record
            async for line in resp.aiter_lines():
                t = now()
                if not line.startswith("data:"):
                    continue  # SSE comments / blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(_error_message(json.dumps(chunk)))
                # Every chunk with a choice carries new tokens, even when their text is
                # still empty (an incomplete UTF-8 sequence held back by the detokenizer).
                if chunk.get("choices"):
                    if record.first_token_time is None:
                        record.first_token_time = t
                    record.token_times.append(t)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    usage_prompt = usage.get("prompt_tokens", usage_prompt)
        record.end_time = now()
        record.output_len = usage_tokens if usage_tokens is not None else len(record.token_times)
        if usage_prompt is not None:
            record.prompt_len = usage_prompt
        if record.output_len == 0 or record.first_token_time is None:
            record.success = False
            record.error = "no tokens received"
    except Exception as e:  # one failed request is a data point, not the end of the run
        record.success = False
        record.error = f"{type(e).__name__}: {e}"[:500]
        record.end_time = now()
    return record


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return body[:300]


async def run_requests(base_url: str, requests: Sequence[BenchRequest], *, model: str | None = None,
                       max_concurrency: int | None = None, ignore_eos: bool = True,
                       num_warmups: int = 1, progress: bool = True, timeout: float | None = None,
                       extra_body: dict[str, Any] | None = None) -> ServeRun:
    """Send `requests` at their arrival times; return every request's timeline."""
    base_url = base_url.rstrip("/")
    url = base_url + "/v1/completions"
    # The pool must not become a hidden concurrency limit: size it to what we may open.
    pool = max_concurrency or max(1, len(requests))
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        # Always make one cheap call first: the client's first request pays one-time
        # setup (~80 ms of blocking work) that would otherwise delay every send after it.
        info = await fetch_model_info(client, base_url)
        if model is None:
            model = info["id"] if info else "default"

        for i in range(num_warmups):
            # Warm-up requests pay one-time costs (allocator, first-kernel, lazy imports)
            # outside the measured window.
            w = requests[i % len(requests)]
            rec = RequestRecord(prompt_len=w.prompt_len)
            warm = BenchRequest(w.prompt_token_ids, min(w.output_len, 4))
            await stream_completion(client, url, completion_payload(warm, model, ignore_eos, extra_body), rec, 0.0)
            if not rec.success:
                raise RuntimeError(f"warm-up request failed: {rec.error}")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = _progress(len(requests), progress)
        clock_zero = time.perf_counter()

        async def one(req: BenchRequest) -> RequestRecord:
            delay = clock_zero + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(prompt_len=req.prompt_len, arrival_time=req.arrival_time,
                                group=req.group, expected_output_len=req.output_len)
            payload = completion_payload(req, model, ignore_eos, extra_body)
            if sem is None:
                await stream_completion(client, url, payload, rec, clock_zero)
            else:
                async with sem:
                    await stream_completion(client, url, payload, rec, clock_zero)
            if bar is not None:
                bar.update(1)
            return rec

        try:
            records = await asyncio.gather(*(one(r) for r in requests))
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - clock_zero
    return ServeRun(records=list(records), duration_s=duration, model=model, base_url=base_url)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


def run_serve_benchmark(base_url: str, requests: Sequence[BenchRequest], **kw: Any) -> ServeRun:
    """Blocking wrapper around `run_requests`."""
    return asyncio.run(run_requests(base_url, requests, **kw))


def max_model_len_of(model_info: dict[str, Any] | None) -> int | None:
    if not model_info:
        return None
    v = model_info.get("max_model_len")
    return int(v) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else None


# ---------------------------------------------------------------------------
# `tokenloom bench serve`
# ---------------------------------------------------------------------------


def _vocab_range(args: Any, info: dict[str, Any] | None) -> tuple[int, int]:
    """Which token ids to draw prompts from: --vocab-size, else the tokenizer/model
    directory (--tokenizer, --launch, or the server's model id when it is a local path)."""
    from pathlib import Path

    from tokenloom.measure.workloads import MIN_TOKEN_ID, vocab_range_for, vocab_range_for_model

    if args.vocab_size:
        return (MIN_TOKEN_ID if args.vocab_size > MIN_TOKEN_ID + 1 else 0), args.vocab_size
    served = (info or {}).get("id")
    for src in (args.tokenizer, args.launch, served):
        if src and Path(src).is_dir():
            return vocab_range_for_model(src)
    if args.tokenizer or args.launch:
        from transformers import AutoTokenizer

        return vocab_range_for(AutoTokenizer.from_pretrained(args.tokenizer or args.launch))
    raise ValueError("cannot tell which token ids the model accepts; "
                     "pass --vocab-size N or --tokenizer DIR")


def _model_max_len(args: Any, info: dict[str, Any] | None) -> int | None:
    from pathlib import Path

    if args.max_model_len:
        return args.max_model_len
    if (m := max_model_len_of(info)) is not None:
        return m
    if args.launch and (Path(args.launch) / "config.json").exists():
        from tokenloom.specs.model_spec import load_config, max_position_embeddings

        return max_position_embeddings(load_config(args.launch)[0])
    return None


def main(args: Any) -> int:
    from rich.console import Console

    from tokenloom.measure import metrics, report
    from tokenloom.bench.launcher import engine_flags_from_args, start_server
    from tokenloom.measure.workloads import workload_from_args, workload_stats

    console = Console()
    if bool(args.base_url) == bool(args.launch):
        raise ValueError("give exactly one of --base-url URL or --launch MODEL")
    slos = metrics.parse_goodput(args.goodput)
    percentiles = metrics.parse_percentiles(args.percentiles)

    server = None
    engine_flags: list[str] = []
    if args.launch:
        engine_flags = engine_flags_from_args(args)
        if args.data_parallel_size != 1:
            engine_flags += ["--data-parallel-size", str(args.data_parallel_size)]
        console.print(f"[bold]launching[/bold] tokenloom serve {args.launch} {' '.join(engine_flags)}")
        server = start_server(args.launch, engine_flags, timeout=args.server_timeout, log_path=args.server_log)
    try:
        base_url = args.base_url or server.base_url
        try:
            info = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0).json()["data"][0]
        except Exception:
            info = None
        vocab = _vocab_range(args, info)
        spec, reqs = workload_from_args(args, vocab, _model_max_len(args, info))
        model = args.served_model_name or (info or {}).get("id") or args.launch or "default"
        console.print(f"[bold]bench serve[/bold] {base_url} model={model} workload={spec.name} "
                      f"requests={len(reqs)} rate={spec.request_rate} concurrency={args.max_concurrency or 'unlimited'}")
        run = run_serve_benchmark(base_url, reqs, model=model, max_concurrency=args.max_concurrency,
                                  ignore_eos=spec.ignore_eos, num_warmups=args.num_warmups,
                                  progress=not args.disable_tqdm, timeout=args.request_timeout)
    finally:
        if server is not None:
            server.stop()

    summary = metrics.summarize(run.records, duration=run.duration_s, goodput_slos=slos, percentiles=percentiles)
    groups = metrics.summarize_by_group(run.records, duration=run.duration_s, goodput_slos=slos,
                                        percentiles=percentiles)
    report.print_summary(summary, title=f"bench serve: {spec.name}", groups=groups, console=console)
    if args.output_json:
        config = report.args_to_config(args)
        config["engine_flags"] = engine_flags
        config["model_name"] = run.model
        doc = report.build_report(
            "serve", config=config,
            workload={"spec": spec.to_dict(), "stats": workload_stats(reqs)},
            results={"summary": summary, "groups": groups},
            server={"base_url": run.base_url, "model_info": info, "launched": bool(args.launch)},
        )
        if not args.no_save_requests:
            doc["requests"] = report.to_jsonable([r.to_dict() for r in run.records])
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}")
    return 0 if summary.completed else 1
