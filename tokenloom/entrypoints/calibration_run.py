"""Measuring the engine for the simulator's calibration: the plan run on the real engine.

`run_calibration` runs the real engine over `sim.calibration_plan`'s fixed plan of requests,
chosen to produce a spread of step shapes -- decode batches of 1 to 16, single prefills of 8 to 384
tokens, a long prompt chunked at 512 tokens (chunks with and without a logits row,
attention at 500-900 positions), decode batches at ~600 tokens of context, a mixed
burst -- and records every `StepEvent`, which carries both the step's duration and the
model's share of it (`forward_time`).  By default ("serve" mode) it measures the engine
as `bench serve` uses it: a real `tokenloom serve` process fed over HTTP by a streaming
client, because on a machine with few cores the server's event loop and the client
take CPU from the forward pass (served steps are measurably slower than
`LLM.generate`'s there); "offline" mode runs `LLM.generate` in this process, for
predicting offline benchmarks.

With `neighbors` > 0 (serve mode), that many more servers of the same model run beside
the measured one, each kept busy by a steady stream of requests of its own, as the other
replicas of `serve --data-parallel-size N` are: replicas on one host share its memory
bandwidth and caches, so one replica alone steps faster than it does among its fleet.

Run as `python -m tokenloom.entrypoints.calibration_run --steps-out FILE -- serve MODEL [flags]`
it is that calibration server: `tokenloom serve` whose engine logs every step.

It runs the engine through `bench`'s client and launcher and `entrypoints`' server, so it
stands above both `bench` and `sim`: the simulator never imports it.  The `tokenloom` command
hands `run_calibration` to `sim.calibrate` (a `sim.calibration_plan.MeasureEngine`) for the
commands that calibrate when nothing is cached.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenloom.sim.calibration_plan import (CALIBRATION_MODES, StepRow, calibration_plan, decode_step_s,
                                            engine_limits, event_row, samples_from)
from tokenloom.sim.fit import Sample

def _requests(items: Sequence[tuple[list[int], int, float]], step_s: float) -> list:
    from tokenloom.measure.workloads import BenchRequest

    return [BenchRequest(p, o, arrival_time=a * step_s) for p, o, a in items]


def run_calibration(model: str, dtype: str = "auto", *, block_size: int = 16, mode: str = "serve",
                    num_threads: int | None = None, neighbors: int = 0, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> tuple[list[Sample], float, dict]:
    """Run the calibration plan on the real engine; ([(entries, period_s, forward_s)], median gap_s, info).

    mode "serve" (the default) measures the engine the way `bench serve` uses it: a real
    `tokenloom serve` process, fed the plan over HTTP by a streaming client in this
    process, so the steps pay for the server's event loop and the client sharing the
    machine; the server reports its steps through the engine's observer API.
    mode "offline" runs `LLM.generate` in this process (no HTTP, no client).
    """
    if mode not in CALIBRATION_MODES:
        raise ValueError(f"calibration mode must be one of {CALIBRATION_MODES}, got {mode!r}")
    log = log or (lambda s: None)
    if mode == "serve":
        return _run_calibration_served(model, dtype, block_size=block_size, num_threads=num_threads, seed=seed,
                                       neighbors=neighbors, log=log)
    if neighbors:
        raise ValueError("busy neighbors are servers: calibrate them in serve mode")
    from tokenloom.bench.offline import run_offline
    from tokenloom.measure.workloads import vocab_range_for
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    limits = engine_limits(model, block_size)
    llm = LLM(model, dtype=dtype, num_threads=num_threads, seed=seed, **limits)
    events: list = []
    llm.add_observer(events.append)
    vocab = vocab_range_for(llm.get_tokenizer(), llm.llm_engine.vocab_size)
    plan = calibration_plan(vocab, limits["max_model_len"], seed)
    # Warm-up: the first forward passes pay one-time costs (allocator, lazy init).
    llm.generate([{"prompt_token_ids": list(range(vocab[0], vocab[0] + 16))}] * 2,
                 SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), use_tqdm=False)
    runs: list[list] = []
    step_s = 0.0
    for name, items in plan:
        events.clear()
        t0 = time.perf_counter()
        run_offline(llm, _requests(items, step_s), ignore_eos=True)
        runs.append([event_row(ev) for ev in events])
        step_s = step_s or decode_step_s(runs[-1])
        log(f"  {name}: {len(events)} steps in {time.perf_counter() - t0:.1f} s")
    samples, gap = samples_from(runs)
    info = {"mode": mode, "threads": _torch_threads(), "dtype": str(llm.llm_engine.loaded.dtype).replace("torch.", "")}
    del llm
    return samples, gap, info


def _rows_between(steps_file: Path, t0: float, t1: float) -> list[StepRow]:
    """Steps the calibration server has logged so far that started in [t0, t1]."""
    rows = []
    for line in steps_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            if t0 <= r["start"] <= t1:
                rows.append((r["entries"], r["start"], r["end"], r["forward"]))
    return rows


def _run_calibration_served(model: str, dtype: str, *, block_size: int, num_threads: int | None, seed: int,
                            log: Callable[[str], None], neighbors: int = 0) -> tuple[list[Sample], float, dict]:
    import signal
    import subprocess
    import sys
    import tempfile

    from tokenloom.bench.launcher import ServerProcess, free_port
    from tokenloom.runner.worker_procs import die_with_parent
    from tokenloom.bench.serve import run_serve_benchmark
    from tokenloom.measure.workloads import BenchRequest, vocab_range_for_model

    limits = engine_limits(model, block_size)
    flags = ["--dtype", dtype, "--max-num-seqs", str(limits["max_num_seqs"]),
             "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
             "--max-model-len", str(limits["max_model_len"]), "--block-size", str(block_size),
             "--num-kv-blocks", str(limits["num_kv_blocks"]), "--enable-prefix-caching", "--seed", str(seed),
             "--disable-access-log", "--log-level", "warning"]
    if num_threads:
        flags += ["--num-threads", str(num_threads)]
    steps_file = Path(tempfile.mkstemp(prefix="tokenloom-calib-steps-", suffix=".jsonl")[1])
    log_file = Path(tempfile.mkstemp(prefix="tokenloom-calib-serve-", suffix=".log")[1])
    port = free_port()
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.calibration_run", "--steps-out", str(steps_file), "--",
           "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_file, "wb") as out:
        # The server dies with this process (SIGTERM on its death, SIGKILL included), as bench's do.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent(signal.SIGTERM))
    server = ServerProcess(proc=proc, host="127.0.0.1", port=port, log_path=log_file, cmd=cmd)
    marks: list[tuple[str, float, float]] = []
    busy = None
    try:
        server.wait_healthy(timeout=600)
        vocab = vocab_range_for_model(model)
        plan = calibration_plan(vocab, limits["max_model_len"], seed)
        if neighbors:
            log(f"  starting {neighbors} busy neighbor server(s)")
            busy = _BusyNeighbors(model, flags, neighbors, vocab, seed)
        warm = [BenchRequest(list(range(vocab[0], vocab[0] + 16)), 3)] * 2
        run_serve_benchmark(server.base_url, warm, num_warmups=1, progress=False)
        step_s = 0.0
        for name, items in plan:
            t0 = time.perf_counter()
            run_serve_benchmark(server.base_url, _requests(items, step_s), num_warmups=0, progress=False)
            marks.append((name, t0, time.perf_counter()))
            if not step_s:  # the first item is a decode batch: it sets the arrival unit
                step_s = decode_step_s(_rows_between(steps_file, t0, marks[-1][2]))
    finally:
        if busy is not None:
            busy.stop()
        server.stop()
    rows = [json.loads(line) for line in steps_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps_file.unlink(missing_ok=True)
    if server.proc.returncode not in (0, None) and not rows:
        raise RuntimeError(f"the calibration server failed:\n{server.log_tail()}")
    log_file.unlink(missing_ok=True)
    # Group the server's steps by plan item (both clocks are perf_counter on one machine).
    runs = []
    for name, t0, t1 in marks:
        evs = [(r["entries"], r["start"], r["end"], r["forward"]) for r in rows if t0 <= r["start"] <= t1]
        runs.append(evs)
        log(f"  {name}: {len(evs)} steps in {t1 - t0:.1f} s (served)")
    samples, gap = samples_from(runs)
    return samples, gap, {"mode": "serve", "dtype": dtype, "neighbors": neighbors}


class _BusyNeighbors:
    """`n` plain servers with the calibration server's flags, each fed without pause by a
    client thread: bursts of 8 requests of 16-64 prompt and 64-192 output tokens, so that a
    neighbour spends its time in decode steps, streaming its weights, as a replica of a busy
    fleet mostly does.  (With longer prompts and shorter outputs it spent much of its time in
    compute-bound prefills, and on a CPU whose one core nearly fills the memory bus the
    calibration read a replica's stream faster than two replicas get: docs/scaling.md.)"""

    def __init__(self, model: str, flags: Sequence[str], n: int, vocab: tuple[int, int], seed: int):
        import threading

        from tokenloom.bench.launcher import start_server

        self._stop = threading.Event()
        self.servers = []
        try:
            for _ in range(n):
                self.servers.append(start_server(model, list(flags), timeout=600))
        except BaseException:
            self.stop()
            raise
        self.threads = [threading.Thread(target=self._feed, args=(s.base_url, vocab, seed + 1 + i), daemon=True)
                        for i, s in enumerate(self.servers)]
        for t in self.threads:
            t.start()

    def _feed(self, base_url: str, vocab: tuple[int, int], seed: int) -> None:
        from tokenloom.bench.serve import run_serve_benchmark
        from tokenloom.measure.workloads import WorkloadSpec, generate_workload

        burst = 0
        while not self._stop.is_set():
            burst += 1
            reqs = generate_workload(WorkloadSpec(name="random", num_prompts=8, input_len=(16, 64),
                                                  output_len=(64, 192), vocab_range=vocab, seed=seed * 1000 + burst))
            try:
                run_serve_benchmark(base_url, reqs, num_warmups=0, progress=False)
            except Exception:  # the server was stopped under it: the calibration is over
                return

    def stop(self) -> None:
        self._stop.set()
        for s in self.servers:
            s.stop()
        for t in getattr(self, "threads", []):
            t.join(timeout=30)


def _serve_with_step_log(argv: Sequence[str]) -> int:
    """`python -m tokenloom.entrypoints.calibration_run --steps-out FILE -- serve MODEL [flags]`: `tokenloom serve`
    whose engine also writes every StepEvent's shape and times to FILE (one JSON line each)."""
    import argparse

    from tokenloom.entrypoints.cmd_serve import register
    from tokenloom.entrypoints.openai.api_server import build_server

    if len(argv) < 3 or argv[0] != "--steps-out" or argv[2] != "--":
        raise SystemExit("usage: python -m tokenloom.entrypoints.calibration_run --steps-out FILE -- serve MODEL [flags]")
    steps_out, rest = argv[1], list(argv[3:])
    parser = argparse.ArgumentParser(prog="tokenloom")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(rest)
    if args.model_tag is not None:
        args.model = args.model_tag
    server, engine = build_server(args)
    with open(steps_out, "w", encoding="utf-8") as f:
        def record(ev: Any) -> None:  # on the engine thread, after the step: not inside its timing
            entries, start, end, fwd = event_row(ev)
            f.write(json.dumps({"entries": entries, "start": start, "end": end, "forward": fwd}) + "\n")
            f.flush()  # the calibrating client reads the log while the server runs

        engine.engine.add_observer(record)
        server.run()
        f.flush()
    return 0


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    import sys

    sys.exit(_serve_with_step_log(sys.argv[1:]))
