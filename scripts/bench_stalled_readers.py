"""What do clients that stop reading their streams cost everyone else?

    python scripts/bench_stalled_readers.py [--model DIR] [--clients 8] [--stalled 50] [--stall-seconds 30]
                                            [--out docs/results/2026-12-06-stalled-readers]

A real `tokenloom serve` subprocess (the tiny random-weight model unless --model) is driven
by this process.  `--clients` normal clients stream completions in a closed loop (send,
read every chunk as it comes, send again) for `--stall-seconds`; the time between two
content chunks of one response is the inter-token latency a client sees (ITL), and the
time to the first chunk its TTFT.  Alongside them, in the runs "with stalled readers",
`--stalled` clients each send a streaming request (n = `--stalled-n`, `--stalled-tokens`
tokens, ignore_eos) over a plain socket and then read nothing for `--stall-seconds`
(the issue's scene: 50 clients x n = 3, stalled for 30 s); afterwards they read their
streams to the end, or whatever the server left of them.

Four runs, each on a fresh server:

    pause off, alone            --max-unread-stream-tokens 0 --max-unsent-bytes 0 (the old behaviour)
    pause off, stalled readers
    pause on,  alone            the defaults
    pause on,  stalled readers

Reported per run: the normal clients' ITL p50 / p95 and TTFT p50 / p95 over the stall
window, over its second half, and from the moment every stalled sequence was paused on
(pause on: a stalled client is told from a reading one only once its socket buffers are
full, its own receive buffer included, so the stalled requests decode ~150 KB of chunks
first); p95 per 5 s; the peak KV use, running and paused sequences on /metrics during the
stall; and the server's RSS (VmRSS at start and end, VmHWM) from /proc.  The ratio that
matters is the normal clients' p95 ITL with stalled readers over the same load without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_fixtures import allow_context, make_tiny_model, metric_values  # noqa: E402

from tokenloom.bench.launcher import ServerProcess, launch_server  # noqa: E402

PROMPT = "Once upon a time"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(val.split()[0])
    return out


async def normal_client(url: str, model: str, max_tokens: int, until: float, t0: float, samples: list,
                        ttfts: list) -> int:
    """Stream completions back to back until `until`; record (time since t0, gap) per chunk gap."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    done = 0
    async with httpx.AsyncClient(timeout=600) as client:
        while time.monotonic() < until:
            start = time.monotonic()
            last = None
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if not any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        continue
                    now = time.monotonic()
                    if last is None:
                        ttfts.append((now - t0, now - start))
                    else:
                        samples.append((now - t0, now - last))
                    last = now
            done += 1
    return done


class StalledReader:
    """A streaming request over a plain socket whose client then reads nothing."""

    def __init__(self, host: str, port: int, body: dict, rcvbuf: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect((host, port))
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (host.encode(), len(data)) + data)
        self.received = 0
        self.stalled_error = False

    def drain(self) -> None:
        """Read the rest of the response (the client came back)."""
        self.sock.settimeout(600)
        tail = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                self.received += len(chunk)
                tail = (tail + chunk)[-4096:]
                if b"data: [DONE]" in tail:
                    break
        except OSError:
            pass
        self.stalled_error = b"stream_stalled" in tail
        self.sock.close()


def watch_metrics(url: str, stop: threading.Event, t0: float, series: list) -> None:
    """Sample KV use, running and paused sequences every half second: (time since t0, {...})."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            try:
                text = client.get(url + "/metrics").text
            except httpx.HTTPError:
                continue
            series.append((time.monotonic() - t0, {
                key: sum(metric_values(text, name))
                for key, name in (("kv", "tokenloom:kv_cache_usage_perc"), ("running", "tokenloom:num_requests_running"),
                                  ("paused", "tokenloom:num_requests_paused"))}))
            stop.wait(0.5)


def final_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = {"kv": "tokenloom:kv_cache_usage_perc", "running": "tokenloom:num_requests_running",
             "paused": "tokenloom:num_requests_paused", "pauses": "tokenloom:num_stream_pauses_total",
             "stalled_aborts": "tokenloom:num_stalled_stream_aborts_total"}
    return {k: sum(metric_values(text, n)) for k, n in names.items()}


def run_once(args, server: ServerProcess, stalled: int) -> dict:
    url = server.base_url
    # warm-up: one request end to end
    httpx.post(url + "/v1/completions", json={"model": args.served_name, "prompt": PROMPT, "max_tokens": 8},
               timeout=300).raise_for_status()
    mem_start = proc_status(server.proc.pid)
    series: list = []
    stop = threading.Event()
    body = {"model": args.served_name, "prompt": PROMPT, "max_tokens": args.stalled_tokens, "n": args.stalled_n,
            "temperature": 0.8, "seed": 1, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    watcher = threading.Thread(target=watch_metrics, args=(url, stop, t0, series), daemon=True)
    watcher.start()
    readers = [StalledReader(server.host, server.port, body, args.stalled_rcvbuf) for _ in range(stalled)]
    samples: list = []
    ttfts: list = []
    until = t0 + args.stall_seconds

    async def clients() -> list[int]:
        return await asyncio.gather(*(normal_client(url, args.served_name, args.client_tokens, until, t0, samples,
                                                    ttfts) for _ in range(args.clients)))

    completed = asyncio.run(clients())
    during = final_metrics(url)
    mem_during = proc_status(server.proc.pid)
    # the stalled clients come back and read whatever is left
    threads = [threading.Thread(target=r.drain) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        end = final_metrics(url)
        if end["kv"] == 0 and end["running"] == 0 and end["paused"] == 0:
            break
        time.sleep(0.5)
    stop.set()
    watcher.join()
    mem_end = proc_status(server.proc.pid)
    half = args.stall_seconds / 2
    itl = [g for _, g in samples]
    itl2 = [g for t, g in samples if t >= half]
    ttft = [g for _, g in ttfts]
    during_stall = [m for t, m in series if t <= args.stall_seconds]
    peaks = {k: max((m[k] for m in during_stall), default=0.0) for k in ("kv", "running", "paused")}
    # when every stalled sequence was paused (pause on), and the others' ITL from then on
    all_paused = next((t for t, m in series if stalled and m["paused"] >= stalled * args.stalled_n), None)
    itl_steady = [g for t, g in samples if all_paused is not None and t >= all_paused]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 1)

    buckets = []
    for lo in range(0, int(args.stall_seconds), 5):
        xs = [g for t, g in samples if lo <= t < lo + 5]
        buckets.append({"from_s": lo, "n": len(xs), "p95_ms": ms(pct(xs, 95))})

    return {
        "stalled_readers": stalled,
        "normal_requests_completed": sum(completed),
        "itl_ms": {"n": len(itl), "p50": ms(pct(itl, 50)), "p95": ms(pct(itl, 95))},
        "itl_second_half_ms": {"n": len(itl2), "p50": ms(pct(itl2, 50)), "p95": ms(pct(itl2, 95))},
        "all_stalled_paused_at_s": None if all_paused is None else round(all_paused, 1),
        "itl_after_all_paused_ms": {"n": len(itl_steady), "p50": ms(pct(itl_steady, 50)),
                                    "p95": ms(pct(itl_steady, 95))},
        "itl_p95_by_5s": buckets,
        "ttft_ms": {"n": len(ttft), "p50": ms(pct(ttft, 50)), "p95": ms(pct(ttft, 95))},
        "peak_during_stall": {k: round(v, 3) for k, v in peaks.items()},
        "peak_kv_after_stall": round(max((m["kv"] for t, m in series if t > args.stall_seconds), default=0.0), 3),
        "at_stall_end": during,
        "at_end": end,
        "stalled_streams_ended_with_stall_error": sum(r.stalled_error for r in readers),
        "stalled_bytes_read_after_stall": sum(r.received for r in readers),
        "rss_kb": {"start": mem_start["VmRSS"], "stall_end": mem_during["VmRSS"], "end": mem_end["VmRSS"],
                   "high_water": mem_end["VmHWM"]},
    }


CONFIGS = {
    "pause off": ["--max-unread-stream-tokens", "0", "--max-unsent-bytes", "0"],
    "pause on": [],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the tiny random-weight test model, made here)")
    ap.add_argument("--clients", type=int, default=8, help="normal streaming clients (closed loop)")
    ap.add_argument("--client-tokens", type=int, default=64, help="max_tokens of a normal request")
    ap.add_argument("--stalled", type=int, default=50, help="clients that stop reading")
    ap.add_argument("--stalled-n", type=int, default=3, help="n of a stalled client's request")
    ap.add_argument("--stalled-tokens", type=int, default=2000, help="max_tokens of a stalled client's request")
    ap.add_argument("--stalled-rcvbuf", type=int, default=0,
                    help="SO_RCVBUF of a stalled client's socket (default 0: the OS default)")
    ap.add_argument("--stall-seconds", type=float, default=30.0)
    ap.add_argument("--stalled-stream-timeout", type=float, default=60.0,
                    help="the server's --stalled-stream-timeout (pause-on runs)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=40000,
                    help="the server's KV pool (default: the stalled requests, run to the end, fill ~half of it)")
    ap.add_argument("--served-name", default="tiny")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeat", type=int, default=1, help="alone / stalled pairs per configuration (alternating)")
    ap.add_argument("--out", type=Path, help="write results.json and summary.md here")
    args = ap.parse_args()

    model = args.model
    if model is None:
        path = Path("/tmp/tokenloom-bench-stalled/tiny")
        if not path.exists():
            allow_context(make_tiny_model(path), 16384)
        model = str(path)

    results = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
               "runs": {}}
    plan = [(c, k, s) for c in args.configs for k in range(args.repeat) for s in (0, args.stalled)]
    for cfg, rep, stalled in plan:
        flags = ["--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(args.num_kv_blocks),
                 "--seed", "0", "--served-model-name", args.served_name,
                 "--disable-access-log", "--log-level", "warning",
                 "--stalled-stream-timeout", str(args.stalled_stream_timeout), *CONFIGS[cfg]]
        name = f"{cfg}, {'stalled readers' if stalled else 'alone'}" + (f" #{rep + 1}" if args.repeat > 1 else "")
        print(f"== {name}", flush=True)
        with launch_server(model, flags) as server:
            r = run_once(args, server, stalled)
        r["server_flags"] = flags
        results["runs"][name] = r
        print(json.dumps(r, indent=1), flush=True)

    lines = ["| run | requests done | others' ITL p50 / p95 (ms) | 2nd half p50 / p95 | after all paused p50 / p95 "
             "(from s) | TTFT p50 / p95 (ms) | peak KV / running / paused in the stall | RSS start / end / "
             "high-water (MB) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        i, i2, i3, t, p, m = (r["itl_ms"], r["itl_second_half_ms"], r["itl_after_all_paused_ms"], r["ttft_ms"],
                              r["peak_during_stall"], r["rss_kb"])
        steady = f"{i3['p50']} / {i3['p95']} ({r['all_stalled_paused_at_s']})" if i3["n"] else "-"
        lines.append(f"| {name} | {r['normal_requests_completed']} | {i['p50']} / {i['p95']} | {i2['p50']} / {i2['p95']} "
                     f"| {steady} | {t['p50']} / {t['p95']} "
                     f"| {p['kv']:.2f} / {p['running']:.0f} / {p['paused']:.0f} "
                     f"| {m['start'] / 1024:.0f} / {m['end'] / 1024:.0f} / {m['high_water'] / 1024:.0f} |")
    for cfg in args.configs:
        for k in range(args.repeat):
            tag = f" #{k + 1}" if args.repeat > 1 else ""
            alone = results["runs"].get(f"{cfg}, alone{tag}")
            stalled = results["runs"].get(f"{cfg}, stalled readers{tag}")
            if not (alone and stalled and alone["itl_ms"]["p95"] and stalled["itl_ms"]["p95"]):
                continue
            ratios = {"whole": stalled["itl_ms"]["p95"] / alone["itl_ms"]["p95"],
                      "second_half": stalled["itl_second_half_ms"]["p95"] / alone["itl_second_half_ms"]["p95"]}
            if stalled["itl_after_all_paused_ms"]["n"]:
                ratios["after_all_paused"] = stalled["itl_after_all_paused_ms"]["p95"] / alone["itl_ms"]["p95"]
            results.setdefault("p95_itl_ratio", {})[cfg + tag] = {k2: round(v, 2) for k2, v in ratios.items()}
            lines.append(f"\n{cfg}{tag}: others' p95 ITL with stalled readers / alone = "
                         + ", ".join(f"{v:.2f}x ({k2.replace('_', ' ')})" for k2, v in ratios.items()))
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
