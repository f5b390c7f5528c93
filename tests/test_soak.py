"""A bounded soak: thousands of mixed requests against a real `tokenloom serve --api-key K`.

What an operator tries before exposing the server, shrunk to fit CI.  `tokenloom serve` runs as
its own process (so its RSS and file descriptors are its own) on a tiny random-weight model,
and 24 concurrent clients (asyncio + httpx, over TCP to 127.0.0.1) send a seeded, reproducible
mix: completions and chat, streamed and not, `n` up to 3, prompt lists and token-id prompts,
logprobs, stop strings, structured output (`guided_choice`, a small `json_schema`,
`response_format: json_object`); about 10% are streams whose client hangs up after a chunk or
three, about 5% are bad requests (invalid fields, unknown model, wrong or missing key, a prompt
longer than the context, malformed JSON, an invalid regex).

It asserts, over a warm-up and then `SOAK_REQUESTS` more requests:
  - no 5xx, and no error event inside a 200 stream;
  - every 200 is well formed: a JSON body in OpenAI's shape with `n` choices per prompt and a
    consistent `usage`; a stream whose every SSE line parses, whose chunks share one id, where
    each choice finishes exactly once, that ends with one `[DONE]`; a constrained answer that
    finished is in its language;
  - every bad request gets its documented status (400 / 401 / 404) in OpenAI's error shape;
  - once the server is idle: no request running or waiting and the KV cache empty
    (`tokenloom:kv_cache_usage_perc` on /metrics), the server's open file descriptors within
    `FD_SLACK` of the count after warm-up, its RSS within `RSS_GROWTH_BOUND_MB` of the RSS after
    warm-up (the issue's manual soak grew 5 MB over 10,000 requests), and no traceback in its log.

Nothing here measures time.  The figures (requests by status, RSS and fds at start and end, KV
at end, duration) are printed straight to the terminal whether or not pytest captures output,
recorded as junit properties, and written to `soak-summary.json` in the test's tmp dir (and to
`$TOKENLOOM_SOAK_SUMMARY` if set).  `pytest -m soak` selects this test alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from server_fixtures import make_tiny_model, metric, metric_values, wait_until
from tokenloom.bench.launcher import ServerProcess, start_server

pytestmark = pytest.mark.soak

SEED = 37
WARMUP_REQUESTS = 240
SOAK_REQUESTS = int(os.environ.get("TOKENLOOM_SOAK_REQUESTS", 2000))
CLIENTS = 24
API_KEY = "K"
NAME = "tiny"
MAX_MODEL_LEN = 128
# Sockets of closed connections and transient pipes settle within a few descriptors.
FD_SLACK = 8
# Measured growth after warm-up on this mix (2-core CPU box, 24 clients): 0.5-3.0 MB over 2,000
# requests and 3.1 MB over 8,000 (flat, not proportional), from ~377 MB.  32 MB is ten times
# that, room for allocator noise, and still catches a per-request leak of 16 KB.
RSS_GROWTH_BOUND_MB = 32.0
REQUEST_TIMEOUT_S = 180.0

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "import os\nimport sys\n", "class Stack:\n    def",
           "Once upon a time", "SELECT * FROM users WHERE", "for i in range(10):", "# TODO: fix the",
           "x = [1, 2, 3,", "Hello, my name is", "def main():\n", "while True:\n    if"]
STOPS = [" ", "e", "\n", "in", "()", "the", "x"]
CHOICES = ["yes", "no", "maybe later"]
DIGIT_SCHEMA = {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "ok": {"type": "boolean"}},
                "required": ["d", "ok"], "additionalProperties": False}


# ---- the request mix -------------------------------------------------------------------------

@dataclass
class Req:
    """One request of the mix and what its answer must look like."""

    i: int
    kind: str                      # "ok" | "disconnect" | "bad"
    path: str                      # /v1/completions or /v1/chat/completions
    body: dict[str, Any] | None    # JSON body, or None when `raw` is sent instead
    raw: bytes | None = None
    auth: str | None = "Bearer " + API_KEY
    feature: str = "plain"         # plain | logprobs | stop | choice | json_schema | json_object | <bad case>
    expect_status: int = 200
    expect_param: str | None = None
    expect_code: str | None = None
    choices: int = 1               # expected choices (n x prompts)
    cut_after: int = 0             # disconnect after this many data events

    @property
    def chat(self) -> bool:
        return self.path.endswith("chat/completions")

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    def describe(self) -> str:
        return f"#{self.i} {self.kind}/{self.feature} POST {self.path} " + (
            json.dumps(self.body)[:400] if self.body is not None else repr(self.raw))


def _messages(rng: random.Random) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "You are terse."})
    return msgs


def _ok(rng: random.Random, i: int) -> Req:
    chat = rng.random() < 0.5
    n = rng.choice([1, 1, 2, 3])
    body: dict[str, Any] = {"model": NAME, "max_tokens": rng.randint(1, 16), "n": n,
                            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    prompts = 1
    if chat:
        body["messages"] = _messages(rng)
    else:
        r = rng.random()
        if r < 0.1:
            body["prompt"] = rng.sample(PROMPTS, 2)
            prompts = 2
        elif r < 0.15:
            body["prompt"] = [rng.randint(3, 1000) for _ in range(rng.randint(1, 8))]
        else:
            body["prompt"] = rng.choice(PROMPTS)
    feature = rng.choices(["plain", "logprobs", "stop", "choice", "json_schema", "json_object"],
                          weights=[30, 20, 15, 12, 12, 11])[0]
    if feature == "logprobs":
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    elif feature == "stop":
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    elif feature == "choice":
        body["guided_choice"] = CHOICES
    elif feature == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT_SCHEMA}}
        body["max_tokens"] = 16
    elif feature == "json_object":
        body["response_format"] = {"type": "json_object"}
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Req(i, "ok", path, body, feature=feature, choices=n * prompts)


def _disconnect(rng: random.Random, i: int) -> Req:
    """A long stream whose client hangs up after 1-3 events, while the server is still generating."""
    req = _ok(rng, i)
    assert req.body is not None
    for k in ("guided_choice", "response_format", "stop"):  # nothing that could end it early
        req.body.pop(k, None)
    req.body.update(stream=True, max_tokens=rng.randint(40, 64), ignore_eos=True)
    req.kind, req.feature, req.cut_after = "disconnect", "disconnect", rng.randint(1, 3)
    return req


LONG_PROMPT = "hello " * 300  # > MAX_MODEL_LEN tokens
HUGE_PROMPT = "lorem ipsum " * 10_000  # 120 KB: refused by its length alone


def _bad(rng: random.Random, i: int) -> Req:
    comp, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, str, dict[str, Any] | None, dict[str, Any]]] = [
        ("temperature", comp, {"prompt": "x", "temperature": -1}, dict(expect_status=400, expect_param="temperature")),
        ("n0", comp, {"prompt": "x", "n": 0}, dict(expect_status=400, expect_param="n")),
        ("max_tokens_type", comp, {"prompt": "x", "max_tokens": "many"},
         dict(expect_status=400, expect_param="max_tokens")),
        ("top_p", chat, {"messages": msgs, "top_p": 1.5}, dict(expect_status=400, expect_param="top_p")),
        ("logprobs", comp, {"prompt": "x", "logprobs": 50}, dict(expect_status=400, expect_param="logprobs")),
        ("no_messages", chat, {"messages": []}, dict(expect_status=400, expect_param="messages")),
        ("regex", comp, {"prompt": "x", "max_tokens": 4, "guided_regex": "a(b"},
         dict(expect_status=400, expect_param="guided_regex")),
        ("unknown_model", chat, {"messages": msgs, "model": "gpt-4"},
         dict(expect_status=404, expect_param="model", expect_code="model_not_found")),
        ("too_long_prompt", comp, {"prompt": LONG_PROMPT, "max_tokens": 2},
         dict(expect_status=400, expect_param="prompt", expect_code="context_length_exceeded")),
        ("huge_prompt", chat, {"messages": [{"role": "user", "content": HUGE_PROMPT}], "max_tokens": 2},
         dict(expect_status=400, expect_param="messages", expect_code="context_length_exceeded")),
        ("too_many_tokens", chat, {"messages": msgs, "max_tokens": 10 * MAX_MODEL_LEN},
         dict(expect_status=400, expect_param="max_tokens")),
        ("wrong_key", comp, {"prompt": "x", "max_tokens": 2},
         dict(expect_status=401, expect_code="invalid_api_key", auth="Bearer not-" + API_KEY)),
        ("missing_key", chat, {"messages": msgs, "max_tokens": 2},
         dict(expect_status=401, expect_code="invalid_api_key", auth=None)),
        ("malformed_json", comp, None, dict(expect_status=400, expect_code="invalid_json")),
    ]
    feature, path, body, expect = rng.choice(cases)
    if body is not None:
        body = {"model": NAME, **body}
        if rng.random() < 0.3:
            body["stream"] = True  # refused before any stream starts: a plain JSON error
    raw = None if body is not None else b'{"model": "tiny", "prompt": "x",'
    return Req(i, "bad", path, body, raw=raw, feature=feature, **expect)


def request_mix(count: int, seed: int) -> list[Req]:
    """`count` requests, the same ones for the same seed: ~5% bad, ~10% cut streams, the rest valid."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        r = rng.random()
        out.append(_bad(rng, i) if r < 0.05 else _disconnect(rng, i) if r < 0.15 else _ok(rng, i))
    return out


# ---- checking answers ------------------------------------------------------------------------

def _check_usage(req: Req, usage: Any, finishes: list[str | None]) -> list[str]:
    assert req.body is not None
    if not isinstance(usage, dict):
        return [f"usage is {usage!r}"]
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if not all(isinstance(v, int) for v in (p, c, t)):
        return [f"usage fields not integers: {usage}"]
    problems = []
    if p <= 0 or t != p + c:
        problems.append(f"usage inconsistent: {usage}")
    max_tokens = req.body["max_tokens"]
    # Each choice produced between 1 and max_tokens tokens; a choice cut by length produced exactly max_tokens.
    lo = sum(max_tokens if f == "length" else 1 for f in finishes)
    if not lo <= c <= len(finishes) * max_tokens:
        problems.append(f"completion_tokens {c} outside [{lo}, {len(finishes) * max_tokens}] for finishes {finishes}")
    return problems


def _check_constrained(req: Req, text: str, finish: str | None) -> list[str]:
    """A constrained answer that finished (not cut by max_tokens) is in the language asked for."""
    if finish != "stop":
        return []
    if req.feature == "choice" and text not in CHOICES:
        return [f"guided_choice answer {text!r} not one of {CHOICES}"]
    if req.feature in ("json_schema", "json_object"):
        try:
            doc = json.loads(text)
        except ValueError:
            return [f"{req.feature} answer finished but is not JSON: {text!r}"]
        if not isinstance(doc, dict):
            return [f"{req.feature} answer is not an object: {text!r}"]
        if req.feature == "json_schema" and not (set(doc) == {"d", "ok"} and type(doc["d"]) is int
                                                 and 0 <= doc["d"] <= 9 and type(doc["ok"]) is bool):
            return [f"json_schema answer does not validate: {text!r}"]
    return []


def check_json_answer(req: Req, data: Any) -> list[str]:
    """A non-streamed 200: OpenAI's completion or chat.completion object."""
    assert req.body is not None
    if not isinstance(data, dict):
        return ["body is not a JSON object"]
    obj, prefix = ("chat.completion", "chatcmpl-") if req.chat else ("text_completion", "cmpl-")
    problems = []
    if data.get("object") != obj or not str(data.get("id", "")).startswith(prefix) or data.get("model") != NAME \
            or not isinstance(data.get("created"), int):
        problems.append(f"envelope: object={data.get('object')!r} id={data.get('id')!r} model={data.get('model')!r}")
    choices = data.get("choices")
    if not isinstance(choices, list) or sorted(ch.get("index") for ch in choices) != list(range(req.choices)):
        return problems + [f"choices indices {[ch.get('index') for ch in choices or []]} for {req.choices} expected"]
    finishes = []
    for ch in choices:
        finish = ch.get("finish_reason")
        finishes.append(finish)
        if finish not in ("stop", "length"):
            problems.append(f"finish_reason {finish!r}")
        if req.chat:
            msg = ch.get("message") or {}
            text = msg.get("content")
            if msg.get("role") != "assistant" or not isinstance(text, str):
                problems.append(f"message {msg!r}")
                continue
        else:
            text = ch.get("text")
            if not isinstance(text, str):
                problems.append(f"text {text!r}")
                continue
        problems += _check_logprobs(req, ch.get("logprobs"), text)
        problems += _check_constrained(req, text, finish)
    return problems + _check_usage(req, data.get("usage"), finishes)


def _check_logprobs(req: Req, lp: Any, text: str) -> list[str]:
    assert req.body is not None
    wanted = req.body.get("logprobs")
    if wanted is None or wanted is False:
        return [] if lp is None else [f"logprobs not asked for but sent: {str(lp)[:200]}"]
    max_tokens = req.body["max_tokens"]
    if req.chat:
        content = (lp or {}).get("content")
        if not isinstance(content, list) or not 1 <= len(content) <= max_tokens:
            return [f"chat logprobs content {str(content)[:200]}"]
        top = req.body.get("top_logprobs", 0)
        for tok in content:
            if not isinstance(tok.get("logprob"), float) or len(tok.get("top_logprobs", [])) != top:
                return [f"chat logprob entry {tok} (top_logprobs={top})"]
        return []
    tokens = (lp or {}).get("tokens")
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= max_tokens:
        return [f"completion logprobs tokens {str(tokens)[:200]}"]
    n_fields = {k: len(lp.get(k) or []) for k in ("token_logprobs", "text_offset", "top_logprobs")}
    if set(n_fields.values()) != {len(tokens)}:
        return [f"completion logprobs lengths {n_fields} vs {len(tokens)} tokens"]
    if "stop" not in req.body and "".join(tokens) != text:
        return [f"logprob tokens {tokens!r} do not concatenate to the text {text!r}"]
    return []


def check_stream(req: Req, lines: list[str], complete: bool) -> list[str]:
    """A streamed 200: every line is `data: <json>` or blank, one id throughout, each choice
    finishes exactly once, the usage chunk (if asked for) comes last, then one [DONE].  A stream
    the client cut (`complete=False`) is checked as far as it got."""
    assert req.body is not None
    obj, prefix = ("chat.completion.chunk", "chatcmpl-") if req.chat else ("text_completion", "cmpl-")
    problems: list[str] = []
    events: list[Any] = []
    for line in lines:
        if line == "":
            continue
        if not line.startswith("data: "):
            return [f"SSE line is not data: {line[:200]!r}"]
        payload = line[6:]
        if payload == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            return [f"SSE data does not parse: {payload[:200]!r}"]
    if not complete:
        events = [e for e in events if e != "[DONE]"]
    elif not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return [f"stream does not end with one [DONE] ({len(events)} events, last {str(events[-1:])[:200]})"]
    chunks = [e for e in events if e != "[DONE]"]
    if any(not isinstance(e, dict) or "error" in e for e in chunks):
        return [f"error event in a 200 stream: {next(str(e) for e in chunks if 'error' in e)[:400]}"]
    ids = {e.get("id") for e in chunks}
    if len(ids) > 1 or not all(str(i).startswith(prefix) for i in ids):
        problems.append(f"chunk ids {sorted(map(str, ids))[:4]}")
    if any(e.get("object") != obj or e.get("model") != NAME for e in chunks):
        problems.append("chunk object/model wrong")
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage_chunks = [e for e in chunks if e.get("usage")]
    for e in chunks:
        for ch in e.get("choices", []):
            idx = ch.get("index")
            if not isinstance(idx, int) or not 0 <= idx < req.choices:
                problems.append(f"chunk choice index {idx!r}")
                continue
            if idx in finishes:
                problems.append(f"choice {idx} has a chunk after its finish_reason")
            piece = (ch.get("delta") or {}).get("content") if req.chat else ch.get("text")
            if piece is not None and not isinstance(piece, str):
                problems.append(f"chunk content {piece!r}")
                continue
            texts[idx] = texts.get(idx, "") + (piece or "")
            if ch.get("finish_reason") is not None:
                finishes[idx] = ch["finish_reason"]
    if not complete:
        return problems
    if sorted(finishes) != list(range(req.choices)) or not set(finishes.values()) <= {"stop", "length"}:
        problems.append(f"finish reasons {finishes} for {req.choices} choices")
    for idx, finish in finishes.items():
        problems += _check_constrained(req, texts.get(idx, ""), finish)
    if (req.body.get("stream_options") or {}).get("include_usage"):
        if len(usage_chunks) != 1 or usage_chunks[0] is not chunks[-1] or usage_chunks[0].get("choices") != []:
            problems.append(f"usage chunks: {len(usage_chunks)}, last chunk {str(chunks[-1:])[:200]}")
        else:
            problems += _check_usage(req, usage_chunks[0]["usage"], [finishes[i] for i in sorted(finishes)])
    elif usage_chunks:
        problems.append("usage chunk sent without stream_options.include_usage")
    return problems


def check_error(req: Req, status: int, data: Any) -> list[str]:
    """A refused request: its documented status and OpenAI's error shape."""
    problems = [] if status == req.expect_status else [f"status {status}, expected {req.expect_status}"]
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"} \
            or not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return problems + [f"error body not OpenAI-shaped: {str(data)[:300]}"]
    if req.expect_param is not None and err["param"] != req.expect_param:
        problems.append(f"error param {err['param']!r}, expected {req.expect_param!r}")
    if req.expect_code is not None and err["code"] != req.expect_code:
        problems.append(f"error code {err['code']!r}, expected {req.expect_code!r}")
    return problems


# ---- running the mix -------------------------------------------------------------------------

@dataclass
class Tally:
    by_status: Counter = field(default_factory=Counter)       # "200", "400", ..., "error:<exc>"
    by_kind: Counter = field(default_factory=Counter)
    constrained_checked: int = 0
    failures: list[str] = field(default_factory=list)


async def _send(client: httpx.AsyncClient, req: Req, tally: Tally) -> None:
    headers = {"content-type": "application/json"}
    if req.auth is not None:
        headers["authorization"] = req.auth
    content = req.raw if req.raw is not None else json.dumps(req.body).encode()
    problems: list[str] = []
    excerpt = ""
    try:
        async with client.stream("POST", req.path, content=content, headers=headers) as resp:
            status = resp.status_code
            if status == 200 and req.stream:
                lines: list[str] = []
                events, cut = 0, False
                async for line in resp.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        events += 1
                        if req.cut_after and events >= req.cut_after:
                            cut = True
                            break  # hang up: leaving the block closes the connection mid-stream
                problems = check_stream(req, lines, complete=not cut)
                excerpt = "\n".join(lines[-6:])[-1200:]
            else:
                raw = await resp.aread()
                excerpt = raw[:1200].decode(errors="replace")
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = None
                    problems = [f"{status} body is not JSON"]
                if data is not None:
                    problems = check_json_answer(req, data) if status == 200 and req.kind != "bad" else \
                        check_error(req, status, data)
    except httpx.HTTPError as e:
        status_key = f"error:{type(e).__name__}"
        tally.by_status[status_key] += 1
        tally.by_kind[req.kind] += 1
        tally.failures.append(f"{req.describe()}\n  -> {type(e).__name__}: {e}")
        return
    tally.by_status[str(status)] += 1
    tally.by_kind[req.kind] += 1
    if req.kind == "ok" and req.feature in ("choice", "json_schema", "json_object"):
        tally.constrained_checked += 1
    if status != req.expect_status and not problems:
        problems = [f"status {status}, expected {req.expect_status}"]
    if problems:
        tally.failures.append(f"{req.describe()}\n  -> {status}: {'; '.join(problems[:3])}\n  body: {excerpt}")


async def _run_mix(base_url: str, reqs: list[Req], tally: Tally) -> None:
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
            while not queue.empty():
                await _send(client, queue.get_nowait(), tally)

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))


# ---- the server and its footprint -------------------------------------------------------------

@pytest.fixture(scope="module")
def soak_server(tmp_path_factory) -> ServerProcess:
    model = make_tiny_model(tmp_path_factory.mktemp("soak") / "tiny")
    log = tmp_path_factory.mktemp("soaklog") / "serve.log"
    server = start_server(str(model), ["--api-key", API_KEY, "--served-model-name", NAME,
                                       "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512",
                                       "--max-num-seqs", "32", "--seed", "0", "--log-level", "warning",
                                       "--disable-access-log"],
                          log_path=log, timeout=300)
    yield server
    server.stop()


def _idle(base_url: str) -> bool:
    return (metric(base_url, "tokenloom:num_requests_running") == 0
            and metric(base_url, "tokenloom:num_requests_waiting") == 0
            and metric(base_url, "tokenloom:kv_cache_usage_perc") == 0)


def _finished_by_reason(base_url: str) -> dict[str, float]:
    """The server's own count of finished requests by finish reason (aborts are the hung-up streams)."""
    text = httpx.get(base_url + "/metrics").text
    return {r: sum(metric_values(text, "tokenloom:request_success_total", finished_reason=r))
            for r in ("stop", "length", "abort", "error")}


def _footprint(proc: psutil.Process) -> dict[str, float]:
    children = proc.children(recursive=True)
    child_rss = 0
    for c in children:
        try:
            child_rss += c.memory_info().rss
        except psutil.Error:
            pass
    return {"rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(), "sockets": _open_connections(proc),
            "children": len(children),
            "children_rss_mb": child_rss / 2**20}


def _open_connections(proc: psutil.Process) -> int:
    """TCP connections of the server other than its listening socket."""
    return sum(1 for c in proc.net_connections() if c.status != psutil.CONN_LISTEN)


def _settle(base_url: str, proc: psutil.Process) -> dict[str, float]:
    """Wait until nothing runs, the KV cache is empty and the server has closed the sockets of
    the clients that left (a moment after they go), then measure."""
    wait_until(lambda: _idle(base_url), 120, 0.25)
    wait_until(lambda: _open_connections(proc) == 0, 30, 0.25)
    return _footprint(proc)


def test_soak_mixed_traffic_leaks_nothing(soak_server: ServerProcess, tmp_path: Path, record_property,
                                          capsys) -> None:
    url = soak_server.base_url
    proc = psutil.Process(soak_server.proc.pid)
    reqs = request_mix(WARMUP_REQUESTS + SOAK_REQUESTS, SEED)
    boot = _footprint(proc)

    warm = Tally()
    asyncio.run(_run_mix(url, reqs[:WARMUP_REQUESTS], warm))
    start = _settle(url, proc)

    tally = Tally()
    finished_before = _finished_by_reason(url)
    t0 = time.monotonic()
    asyncio.run(_run_mix(url, reqs[WARMUP_REQUESTS:], tally))
    duration = time.monotonic() - t0
    end = _settle(url, proc)
    finished = {k: v - finished_before.get(k, 0) for k, v in _finished_by_reason(url).items()}
    kv_end = metric(url, "tokenloom:kv_cache_usage_perc")
    running_end = metric(url, "tokenloom:num_requests_running") + metric(url, "tokenloom:num_requests_waiting")
    log_text = Path(soak_server.log_path).read_text(errors="replace")

    summary = {
        "requests": len(reqs), "warmup": WARMUP_REQUESTS, "soak": SOAK_REQUESTS, "clients": CLIENTS,
        "by_status": dict(sorted((warm.by_status + tally.by_status).items())),
        "soak_by_status": dict(sorted(tally.by_status.items())),
        "soak_by_kind": dict(sorted(tally.by_kind.items())),
        "soak_server_finished_by_reason": finished,
        "constrained_answers_checked": warm.constrained_checked + tally.constrained_checked,
        "rss_mb": {"boot": round(boot["rss_mb"], 1), "start": round(start["rss_mb"], 1), "end": round(end["rss_mb"], 1),
                   "growth": round(end["rss_mb"] - start["rss_mb"], 1), "bound": RSS_GROWTH_BOUND_MB},
        "fds": {"boot": boot["fds"], "start": start["fds"], "end": end["fds"], "slack": FD_SLACK,
                "open_connections_start": start["sockets"], "open_connections_end": end["sockets"]},
        "children": {"start": start["children"], "end": end["children"],
                     "rss_mb_end": round(end["children_rss_mb"], 1)},
        "kv_cache_usage_end": kv_end, "running_or_waiting_end": running_end,
        "soak_duration_s": round(duration, 1), "server_log": str(soak_server.log_path),
        "failures": len(warm.failures) + len(tally.failures),
    }
    out = tmp_path / "soak-summary.json"
    out.write_text(json.dumps(summary, indent=1))
    if os.environ.get("TOKENLOOM_SOAK_SUMMARY"):
        Path(os.environ["TOKENLOOM_SOAK_SUMMARY"]).write_text(json.dumps(summary, indent=1))
    for k, v in summary.items():
        record_property(f"soak_{k}", json.dumps(v))
    line = (f"soak: {summary['requests']} requests ({CLIENTS} clients) by status {summary['by_status']}; "
            f"RSS {start['rss_mb']:.1f} -> {end['rss_mb']:.1f} MB after warm-up (boot {boot['rss_mb']:.1f}); "
            f"fds {start['fds']} -> {end['fds']}; KV at end {kv_end}; soak {duration:.1f} s; summary {out}")
    with capsys.disabled():
        print("\n" + line)

    failures = warm.failures + tally.failures
    assert not failures, f"{len(failures)} malformed or unexpected answers; first ones:\n" + "\n\n".join(failures[:8])
    assert not any(k.startswith("5") or k.startswith("error") for k in summary["by_status"]), summary["by_status"]
    assert kv_end == 0 and running_end == 0, f"KV usage {kv_end}, {running_end} running or waiting when idle"
    assert end["fds"] <= start["fds"] + FD_SLACK, f"open fds grew: {summary['fds']}"
    assert end["rss_mb"] - start["rss_mb"] <= RSS_GROWTH_BOUND_MB, f"RSS grew: {summary['rss_mb']}"
    assert "Traceback" not in log_text, log_text[max(0, log_text.find("Traceback") - 200):][:3000]
    assert finished["error"] == 0, f"requests the server finished with an error: {finished}"
    # The mix did what it says: bad requests were sent, constrained answers checked, and hung-up
    # streams were aborted by the server while they were still generating.
    assert tally.by_kind["bad"] > 0 and tally.constrained_checked > 0 and finished["abort"] > 0, \
        f"kinds {dict(tally.by_kind)}, constrained {tally.constrained_checked}, finished {finished}"
