"""Take docs/img/dashboard.png: a real server, a real load, the page in headless Chromium.

    python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png] [--seconds 54]

Serves the bundled model with a small token budget and KV pool, opens /dashboard in the
system's Chromium (Playwright, `executable_path`: no browser download), and drives a load
in three phases so the time series tell a story: a few short requests; a burst with long
prompts (prefill chunks fill the budget, requests queue, TTFT P95 climbs, the KV pool fills
and may preempt); then a steady mix.  The screenshot is taken during the last phase.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_fixtures import ThreadedServer  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402

WORDS = ("def class return import yield lambda while for if else try except with async await self "
         "value index result items list dict tuple print range len open file data model token").split()


def worker(base_url: str, stop: threading.Event, active: threading.Event, rng: random.Random, long_share: float) -> None:
    """Closed loop: one request after another while `active`; some with long prompts."""
    while not stop.is_set():
        if not active.is_set():
            time.sleep(0.05)
            continue
        n_words = rng.randint(90, 160) if rng.random() < long_share else rng.randint(4, 24)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
        try:
            httpx.post(base_url + "/v1/completions", timeout=120,
                       json={"model": "m", "prompt": prompt, "max_tokens": rng.randint(40, 110), "ignore_eos": True,
                             "temperature": 0.8})
        except httpx.HTTPError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--seconds", type=float, default=54.0, help="length of the load before the screenshot")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    a = ap.parse_args()

    from playwright.sync_api import sync_playwright

    srv = ThreadedServer(["--port", str(free_port()), "--served-model-name", "m", "--max-num-seqs", "10",
                          "--max-num-batched-tokens", "96", "--num-kv-blocks", "72", "--block-size", "16",
                          "--log-level", "warning", "--disable-access-log"]).start()
    stop = threading.Event()
    phases = [threading.Event() for _ in range(3)]
    rng = random.Random(0)
    threads = []
    # phase 0: 3 workers, short prompts; phase 1: +8 workers, mostly long; phase 2: +3 mixed
    for count, phase, long_share in ((3, 0, 0.1), (8, 1, 0.6), (3, 2, 0.3)):
        for _ in range(count):
            t = threading.Thread(target=worker, args=(srv.base_url, stop, phases[phase],
                                                      random.Random(rng.random()), long_share), daemon=True)
            t.start()
            threads.append(t)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=a.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1440, "height": 960}, device_scale_factor=1)
            page.goto(srv.base_url + "/dashboard")
            page.wait_for_function("document.getElementById('status').dataset.state === 'live'", timeout=30_000)
            third = a.seconds / 3
            phases[0].set()
            time.sleep(third)
            phases[1].set()
            time.sleep(third)
            phases[1].clear()  # the burst ends; its requests in flight finish
            phases[2].set()
            time.sleep(third)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=a.out, full_page=True)
            print(f"wrote {a.out}")
            browser.close()
    finally:
        stop.set()
        for ph in phases:
            ph.set()
        srv.stop()


if __name__ == "__main__":
    main()
