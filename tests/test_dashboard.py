"""The live dashboard, end to end: a real server, its event stream read with httpx, and the
page driven in a real headless Chromium (the distribution's package, via Playwright).

Servers (uvicorn in a thread, a tiny random-weight model):
  - `srv`: --api-key, a small token budget so a long prompt is split into prefill chunks;
  - `no_dash`: --no-dashboard.

Without Chromium or Playwright the browser test fails with how to install them; it is
skipped only when TOKENLOOM_NO_BROWSER=1 says so.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from server_fixtures import ThreadedServer, wait_until
from tokenloom.bench.launcher import free_port
from tokenloom.entrypoints.openai.dashboard_routes import COOKIE

API_KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BUDGET = 48  # --max-num-batched-tokens: the long prompt needs several steps (prefill chunks)
MAX_TOKENS = 12


def prompts(tag: str) -> list[str]:
    """Five short prompts and a long one (well over BUDGET tokens), starting with `tag` so
    that no test finds another's prompt in the prefix cache."""
    return [f"{tag}: request number {i}:" for i in range(5)] + [f"{tag}: " + "the quick brown fox jumps over the lazy dog " * 7]


UPDATE_KEYS = {"seq", "time", "interval", "config", "steps_in_update", "steps_total", "last_step", "steps",
               "rows_new", "rows_done", "running", "waiting", "kv", "preemptions", "tokens", "tokens_per_s",
               "latency"}


@pytest.fixture(scope="module")
def srv(tiny_llama):
    server = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "256",
                             "--num-kv-blocks", "160", "--max-num-seqs", "8", "--max-num-batched-tokens", str(BUDGET),
                             "--api-key", API_KEY, "--served-model-name", "tiny", "--log-level", "warning",
                             "--disable-access-log"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_dash(tiny_llama):
    server = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "256",
                             "--no-dashboard", "--log-level", "warning", "--disable-access-log"]).start()
    yield server
    server.stop()


class SSEReader:
    """Reads `event:` / `data:` pairs of a server-sent-event stream on a thread of its own."""

    def __init__(self, url: str, **kw: Any):
        self.url, self.kw = url, kw
        self.events: list[tuple[str, dict]] = []
        self.status: int | None = None
        self.ended_cleanly = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "SSEReader":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=30, **self.kw) as r:
                self.status = r.status_code
                name = "message"
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.append((name, json.loads(line[5:])))
                    if self._stop.is_set():
                        return
                self.ended_cleanly = True
        except BaseException as e:  # surfaced by the test
            self.error = e

    def updates(self) -> list[dict]:
        return [d for name, d in self.events if name == "update"]

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


def run_requests(base_url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Send every prompt at once (continuous batching has something to batch)."""

    def one(prompt: str) -> dict:
        r = httpx.post(base_url + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        r.raise_for_status()
        return r.json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def prompt_len(base_url: str, prompt: str) -> int:
    return httpx.post(base_url + "/tokenize", headers=AUTH, json={"prompt": prompt}).json()["count"]


# ---- the event stream (no browser) ---------------------------------------------------------------
def test_event_stream_is_rate_limited_and_carries_every_figure(srv):
    hub = srv.server.config.app.state.dashboard
    engine = srv.engine.engine
    assert not hub.running and hub.recorder not in engine.observers  # nothing runs without a page

    reader = SSEReader(srv.base_url + "/dashboard/events", headers=AUTH).start()
    wait_until(lambda: reader.events or reader.error, 30)
    assert reader.status == 200 and reader.error is None
    assert hub.running and hub.recorder in engine.observers
    name, hello = reader.events[0]
    assert name == "hello"
    assert hello["config"]["max_num_batched_tokens"] == BUDGET and hello["config"]["model"] == "tiny"

    sent = prompts("stream")
    run_requests(srv.base_url, sent)
    n = len(sent)
    assert wait_until(lambda: sum(len(u["rows_done"]) for u in reader.updates()) >= n, 30)
    reader.close()
    assert wait_until(lambda: not hub.running and hub.recorder not in engine.observers, 10)

    updates = reader.updates()
    for u in updates:
        assert UPDATE_KEYS <= set(u)
        assert set(u["kv"]) == {"used", "cached", "free", "total"} and u["kv"]["total"] == 160
        assert u["kv"]["used"] + u["kv"]["free"] == u["kv"]["total"]
        for series in ("ttft", "tpot", "itl"):
            assert set(u["latency"][series]) == {"p50", "p95", "n"}
    # Rate limit: the server's own clock puts >= one interval (0.25 s) between two updates,
    # each update aggregates several steps, and no step is lost on the way.
    times = [u["time"] for u in updates]
    assert all(b - a >= 0.2 for a, b in zip(times, times[1:])), times
    steps = [s for u in updates for s in u["steps"]]
    numbers = [s[0] for s in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert sum(u["steps_in_update"] for u in updates) == len(steps) > len(updates)

    # The picture's data: one row per request, several requests sharing a step, the long
    # prompt split into prefill chunks (kind 1) that end in a prefill (kind 2), then decodes.
    rows = {r[0]: r for u in updates for r in u["rows_new"]}
    assert len(rows) == n
    long_len = prompt_len(srv.base_url, sent[-1])
    long_row = next(r for r, info in rows.items() if info[2] == long_len)
    kinds = [c[1] for s in steps for c in s[5] if c[0] == long_row]
    assert kinds[:2] == [1, 1] and 2 in kinds and kinds[-1] == 0
    assert sum(c[2] for s in steps for c in s[5] if c[0] == long_row and c[1] != 0) == long_len
    assert max(len(s[5]) for s in steps) >= 2
    assert all(s[3] + s[4] <= BUDGET for s in steps)  # decode + prefill tokens within the budget
    assert {reason for u in updates for _, reason in u["rows_done"]} == {"length"}
    # Every request's first token, token gaps and TPOT are in the window.
    last = updates[-1]["latency"]
    assert last["ttft"]["n"] == n and last["tpot"]["n"] == n and last["itl"]["n"] == n * (MAX_TOKENS - 1)
    assert 0 < last["itl"]["p50"] <= last["itl"]["p95"]
    assert sum(u["tokens"]["generated"] for u in updates) == n * MAX_TOKENS
    assert sum(u["tokens"]["prefill"] for u in updates) >= long_len


def test_the_key_guards_page_and_stream(srv):
    url = srv.base_url
    for bad in ({}, {"params": {"key": "wrong"}}, {"headers": {"Authorization": "Bearer wrong"}},
                {"cookies": {COOKIE: "forged"}}):
        for path in ("/dashboard", "/dashboard/events"):
            r = httpx.get(url + path, **bad)
            assert r.status_code == 401, (path, bad)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    page = httpx.get(url + "/dashboard", params={"key": API_KEY})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert API_KEY not in page.cookies[COOKIE]  # the cookie proves the key without holding it
    # Self-contained: styles and script inline, nothing fetched from elsewhere.
    html = page.text
    assert "<canvas" in html and "EventSource" in html
    assert "src=" not in html and "http://" not in html and "https://" not in html
    # The cookie set from ?key= opens the stream (and so does the header, tested above).
    r = SSEReader(url + "/dashboard/events", cookies={COOKIE: page.cookies[COOKIE]}).start()
    wait_until(lambda: r.events or r.error, 30)
    r.close()
    assert r.status == 200 and r.events[0][0] == "hello"


def test_no_dashboard_is_404(no_dash):
    for path in ("/dashboard", "/dashboard/events"):
        r = httpx.get(no_dash.base_url + path)
        assert r.status_code == 404 and "error" in r.json()
    assert no_dash.server.config.app.state.dashboard is None


def test_shutdown_ends_open_streams(tiny_llama):
    """An event stream never ends by itself; stopping the server must end it cleanly."""
    server = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "256",
                             "--log-level", "warning", "--disable-access-log"]).start()
    reader = SSEReader(server.base_url + "/dashboard/events").start()
    wait_until(lambda: reader.events or reader.error, 30)
    server.stop()
    reader.close()
    assert reader.error is None and reader.ended_cleanly
    assert not server._thread.is_alive()


# ---- the page in a real browser ------------------------------------------------------------------
def chromium_or_fail() -> str:
    """The system's Chromium; fail (or skip, when TOKENLOOM_NO_BROWSER=1) without it."""
    skip = os.environ.get("TOKENLOOM_NO_BROWSER") == "1"
    exe = os.environ.get("TOKENLOOM_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    missing = None
    if exe is None:
        missing = "no Chromium on this machine: run scripts/setup-test-machine.sh (it apt-get installs chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "Playwright is not installed: `pip install -e '.[test]'`"
    if missing:
        if skip:
            pytest.skip(missing + " (skipped: TOKENLOOM_NO_BROWSER=1)")
        pytest.fail(missing + "; set TOKENLOOM_NO_BROWSER=1 to skip the browser test")
    return exe


def test_page_draws_steps_live_in_chromium(srv):
    exe = chromium_or_fail()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            assert page.goto(srv.base_url + "/dashboard").status == 401  # no key, no page
            assert page.goto(srv.base_url + f"/dashboard?key={API_KEY}").status == 200
            page.wait_for_function("document.getElementById('status').dataset.state === 'live'", timeout=30_000)
            step_before = int(page.get_attribute("#stat-step", "data-value"))

            sent = prompts("browser")
            run_requests(srv.base_url, sent)
            # Columns are released over an update interval, and the last steps' events can reach
            # the page after the requests have returned: wait for the picture to catch up.
            page.wait_for_function(
                f"(() => {{ const b = document.getElementById('batch').dataset;"
                f" return +b.rows >= {len(sent)} && +b.chunkCells >= 2 && +b.prefillCells >= {len(sent)}"
                f" && +b.decodeCells >= {len(sent) * (MAX_TOKENS - 1)}"
                f" && +b.columns === +document.getElementById('dash').dataset.stepsSeen; }})()", timeout=30_000)
            batch = {k: int(v) for k, v in page.eval_on_selector("#batch", "e => ({...e.dataset})").items()}
            step_after = int(page.get_attribute("#stat-step", "data-value"))
            assert step_after > step_before
            assert batch["rows"] == len(sent) and batch["visibleRows"] >= 2
            assert batch["decodeCells"] >= len(sent) * (MAX_TOKENS - 1)
            # Every step the stream carried is a column on the page.
            assert batch["columns"] == int(page.get_attribute("#dash", "data-steps-seen")) >= MAX_TOKENS
            assert int(page.get_attribute("#dash", "data-updates")) >= 1
            assert page.inner_text("#stat-ttft") != "–"
            # The canvas is really painted: some pixel in the picture is the decode green.
            painted = page.evaluate("""() => { const c = document.getElementById('batch');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                for (let i = 0; i < d.length; i += 4) if (d[i] === 34 && d[i+1] === 197 && d[i+2] === 94) return true;
                return false; }""")
            assert painted
            assert errors == []
        finally:
            browser.close()


# ---- the aggregator on its own -------------------------------------------------------------------
def test_aggregator_counts_speculative_tokens_and_percentiles():
    """A step that appended several tokens (speculative decoding's accepted drafts) counts
    them all, and spreads the gap since the previous token over them."""
    from tokenloom.core.events import StepEntry, StepEvent
    from tokenloom.dashboard.aggregate import Aggregator, percentile
    from tokenloom.dashboard.recorder import StepRecord

    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0

    def entry(phase: str, n: int, before: int, **kw) -> StepEntry:
        return StepEntry("r", phase, n, [1] * n, before, before + n, 4, **kw)

    steps = [entry("prefill", 4, 0, sampled_token_id=9),
             entry("decode", 1, 4, sampled_token_id=9),
             entry("decode", 3, 5, sampled_token_id=9, finished=True, finish_reason="length")]
    if hasattr(steps[2], "generated_token_ids"):
        steps[2].generated_token_ids = [7, 8, 9]
    records = [StepRecord(StepEvent(i, 1.0 + i, 2.0 + i, 0.5, [e], kv_blocks_used=1, kv_blocks_total=8), 0,
                          (("r", 0.5),) if i == 0 else ()) for i, e in enumerate(steps)]
    agg = Aggregator({})
    agg.ingest(records)
    u = agg.update(5.0)
    spec = 3 if hasattr(steps[2], "generated_token_ids") else 1
    assert u["tokens"]["generated"] == 2 + spec
    assert [c[1] for s in u["steps"] for c in s[5]] == [2, 0, 0]  # prefill, then decodes
    lat = u["latency"]
    assert lat["ttft"] == {"p50": 1.5, "p95": 1.5, "n": 1}  # arrival 0.5 -> first token at 2.0
    assert lat["itl"]["n"] == 1 + spec and lat["itl"]["p95"] == 1.0
    assert lat["tpot"]["n"] == 1 and lat["tpot"]["p50"] == pytest.approx(2.0 / (1 + spec))
    assert u["rows_done"] == [[0, "length"]]
