"""The OpenAI-compatible server, end to end: real uvicorn on 127.0.0.1, the official `openai`
client and plain httpx, a tiny random-weight model made once for the module.

Servers (uvicorn in a thread shares this process's torch import, which dominates start-up):
  - `srv`: same engine flags as the offline `LLM` used as the reference; generation,
    streaming, metrics, disconnects and error shapes;
  - `guarded`: a model copy without a chat template, with --api-key, --max-num-seqs 1 and
    --max-queued-requests 1 (401, 429, missing template);
  - `subprocess_server`: `tokenloom serve` as its own process, stopped with SIGTERM while a
    stream is in flight (the stream finishes, the exit status is 0).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import (ThreadedServer, allow_context, copy_with_context, copy_without_chat_template,
                             make_tiny_model, metric, metric_values, sse_events, wait_until)
from tokenloom.bench.launcher import ServerProcess, free_port, start_server

ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "160", "--max-num-seqs", "32", "--seed", "0"]
ENGINE_KW = dict(max_model_len=256, num_kv_blocks=160, max_num_seqs=32, seed=0)
NAME = "tiny"
API_KEY = "sekret"
PROMPTS = [f"def function_{i}(x, y):\n    return" for i in range(16)]
MAX_TOKENS = 10
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


# ---- fixtures ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("srv") / "tiny")


@pytest.fixture(scope="module")
def subprocess_server(model_dir: Path, tmp_path_factory):
    """`tokenloom serve` as a real process (for the SIGTERM test).  Launched in the background
    at the start of the module, so its imports and model load overlap this process's."""
    port = free_port()
    log = tmp_path_factory.mktemp("srvlog") / "serve.log"
    long_ctx = copy_with_context(model_dir, tmp_path_factory.mktemp("srv3") / "tiny-16k", 16384)
    holder: dict = {}

    def launch() -> None:
        try:
            holder["server"] = start_server(str(long_ctx), ["--max-model-len", "16384", "--num-kv-blocks", "1100",
                                                             "--served-model-name", NAME, "--shutdown-timeout", "3"],
                                            port=port, log_path=log, timeout=240)
        except BaseException as e:  # surfaced when the test asks for the server
            holder["error"] = e

    t = threading.Thread(target=launch, daemon=True)
    t.start()

    def get() -> ServerProcess:
        t.join(300)
        if "error" in holder:
            raise holder["error"]
        return holder["server"]

    yield get
    t.join(300)  # never leave a half-started server behind
    if "server" in holder:
        holder["server"].stop()


@pytest.fixture(scope="module")
def srv(model_dir: Path, subprocess_server):
    server = ThreadedServer([str(model_dir), "--port", str(free_port()), *ENGINE_FLAGS,
                             "--served-model-name", NAME, "tiny-alias", "--log-level", "warning",
                             "--disable-access-log"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory, srv):
    """A model copy without a chat template, behind --api-key, one sequence at a time and at
    most one waiting request."""
    plain = allow_context(copy_without_chat_template(model_dir, tmp_path_factory.mktemp("srv2") / "tiny-plain"),
                          16384)
    server = ThreadedServer([str(plain), "--port", str(free_port()), "--max-model-len", "16384",
                             "--num-kv-blocks", "1100", "--max-num-seqs", "1", "--max-queued-requests", "1",
                             "--api-key", API_KEY, "--served-model-name", NAME, "--log-level", "warning",
                             "--disable-access-log"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from tokenloom import LLM

    return LLM(str(model_dir), **ENGINE_KW)


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, str]:
    """Greedy offline outputs of PROMPTS: what every greedy HTTP request must reproduce."""
    from tokenloom import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


@pytest.fixture
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _idle(base_url: str) -> bool:
    return (metric(base_url, "tokenloom:num_requests_running") == 0
            and metric(base_url, "tokenloom:num_requests_waiting") == 0
            and metric(base_url, "tokenloom:kv_cache_usage_perc") == 0)


def _error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


# ---- plain endpoints -------------------------------------------------------------

def test_info_endpoints(srv, model_dir):
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert httpx.get(srv.base_url + "/version").json()["version"]
    models = httpx.get(srv.base_url + "/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == NAME and card["object"] == "model" and card["owned_by"] == "tokenloom"
    assert card["max_model_len"] == 256 and isinstance(card["created"], int)
    assert [m["id"] for m in models["data"]] == [NAME, "tiny-alias"]

    tok = httpx.post(srv.base_url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 256
    assert httpx.post(srv.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat_tok = httpx.post(srv.base_url + "/tokenize", json={"messages": CHAT}).json()
    assert chat_tok["count"] > tok["count"]
    _error(httpx.post(srv.base_url + "/detokenize", json={"tokens": [10**6]}), 400, "tokens")


def test_serve_without_model_means_bundled():
    from tokenloom.config import EngineArgs
    from tokenloom.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "1"])
    assert args.model_tag is None and EngineArgs.from_cli_args(args).model is None


# ---- generation ------------------------------------------------------------------

def test_greedy_completions_match_offline(client, expected):
    prompts = PROMPTS[:4]
    for p in prompts[:2]:
        r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.object == "text_completion" and r.choices[0].text == expected[p]
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        # at most one KV block (16 tokens): its last token is always recomputed, so nothing is reused
        assert r.usage.prompt_tokens <= 16 and r.usage.prompt_tokens_details.cached_tokens == 0
    # several prompts in one request: one choice per prompt, in order
    r = client.completions.create(model="tiny-alias", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[p] for p in prompts]


def test_token_id_prompts(srv, client, expected):
    ids = httpx.post(srv.base_url + "/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[PROMPTS[0]]
    r = client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [PROMPTS[0] + expected[PROMPTS[0]]] * 2


def test_chat_matches_offline(client, llm):
    from tokenloom import SamplingParams

    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.outputs[0].text
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    r2 = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens <= 3 and want.outputs[0].text.startswith(r2.choices[0].message.content)


def test_streaming_completion_with_usage(client, expected):
    p = PROMPTS[5]
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    body, last = chunks[:-1], chunks[-1]
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in body) == expected[p]
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert last.usage.prompt_tokens <= 16 and last.usage.prompt_tokens_details.cached_tokens == 0  # one block at most


def _probe_prompt(tag: str) -> str:
    """A prompt of several KV blocks that no other request sends."""
    return f"cache probe {tag}: " + "".join(PROMPTS[:4])


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_the_prefix_cache_hit(client, stream):
    """cached_tokens is the prompt's full KV blocks found in the prefix cache: none the first
    time, all but the last (always recomputed) token's partial block the second time."""
    probe = _probe_prompt(f"stream={stream}")
    first = client.completions.create(model=NAME, prompt=probe, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 2 * 16 and first.usage.prompt_tokens_details.cached_tokens == 0
    if stream:
        chunks = list(client.completions.create(model=NAME, prompt=probe, max_tokens=2, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(model=NAME, prompt=probe, max_tokens=2, temperature=0).usage
    assert usage.prompt_tokens == n
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16  # --block-size 16 (the default)


def test_streaming_raw_sse_format(srv, expected):
    p = PROMPTS[6]
    with httpx.stream("POST", srv.base_url + "/v1/completions",
                      json={"model": NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.strip().split("\n\n"))
    events = sse_events(raw.splitlines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected[p]
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])  # no include_usage: no usage chunk


def test_streaming_chat(client, llm):
    from tokenloom import SamplingParams

    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_n_and_seed_reproducible(client):
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=3)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=98765, **kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa: E731
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    # the same seeded request streamed: per-index deltas reassemble the same texts
    got = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(seed=1234, stream=True, **kw):
        for ch in chunk.choices:
            got[ch.index] += ch.text
    assert [got[i] for i in range(3)] == texts(a)
    # n > 1 in chat too
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=5, n=2, seed=5, temperature=1.0)
    assert sorted(ch.index for ch in r.choices) == [0, 1]


def test_stop_strings(client, expected):
    p = next(p for p in PROMPTS if len(expected[p].strip()) >= 6)
    full = expected[p]
    stop = full[3:5]
    cut = full.find(stop)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    ch = r.choices[0]
    assert ch.text == full[:cut] and ch.finish_reason == "stop"
    assert ch.model_extra.get("stop_reason") == stop
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == full[:cut] + stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True))
    assert streamed == full[:cut]


def test_completion_logprobs_and_echo(client, expected):
    p = PROMPTS[2]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(d.values()) - x) < 1e-5 for d, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    if "\ufffd" not in r.choices[0].text:
        assert "".join(lp.tokens) == r.choices[0].text == expected[p]

    e = client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=1, echo=True)
    ch = e.choices[0]
    assert ch.text == p + expected[p]
    lp = ch.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert lp.text_offset[r.usage.prompt_tokens] == len(p)

    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                                            stream=True))
    toks = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offs = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert toks == r.choices[0].logprobs.tokens and offs == r.choices[0].logprobs.text_offset


def test_logit_bias_and_allowed_token_ids(client, expected):
    """OpenAI's logit_bias (string token ids -> bias) forces or bans tokens; vLLM's
    allowed_token_ids limits the choice; both on completions and chat."""
    forced = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={"7": 100})
    assert forced.choices[0].text == client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body={"allowed_token_ids": [7]}).choices[0].text
    ids = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0,
                                    logit_bias={"7": 100}).choices[0].logprobs.tokens
    assert len(ids) == 4 and len(set(ids)) == 1  # the same forced token every step
    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].text == expected[PROMPTS[0]]  # the bias was the request's own
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={"7": 100})
    assert chat.choices[0].message.content == forced.choices[0].text[:len(chat.choices[0].message.content)]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.bytes == list(t.token.encode())
    assert "".join(t.token for t in content) == r.choices[0].message.content  # each token's text in context
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_sixteen_concurrent_streams(srv, expected):
    async def one(client: openai.AsyncOpenAI, p: str) -> tuple[str, str | None]:
        text, finish = "", None
        stream = await client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    results = asyncio.run(main())
    assert [t for t, _ in results] == [expected[p] for p in PROMPTS]
    assert all(f in ("stop", "length") for _, f in results)
    assert wait_until(lambda: _idle(srv.base_url), 10)


def test_prefix_cache_reported(srv, client):
    long_prompt = "import os\nimport sys\n" * 12  # several full KV blocks
    before_q = metric(srv.base_url, "tokenloom:prefix_cache_queries_total")
    before_h = metric(srv.base_url, "tokenloom:prefix_cache_hits_total")
    client.completions.create(model=NAME, prompt=long_prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=NAME, prompt=long_prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    assert metric(srv.base_url, "tokenloom:prefix_cache_queries_total") > before_q
    assert metric(srv.base_url, "tokenloom:prefix_cache_hits_total") >= before_h + 16


def test_metrics_exported(srv, client):
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    text = httpx.get(srv.base_url + "/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "iteration_tokens_total_count"]:
        assert f"tokenloom:{name}{{" in text, name
    assert metric(srv.base_url, "tokenloom:request_success_total", finished_reason="length") > 0
    assert metric(srv.base_url, "tokenloom:generation_tokens_total") > 0
    assert metric(srv.base_url, "tokenloom:time_to_first_token_seconds_count") > 0
    assert metric(srv.base_url, "tokenloom:inter_token_latency_seconds_count") > 0
    assert "vllm:" not in text and "python_gc" not in text  # our own registry, not the global one


def test_metrics_observer_serves_an_offline_run_too(llm):
    from tokenloom import SamplingParams
    from tokenloom.engine.metrics_observer import EngineMetrics

    m = EngineMetrics("offline").attach(llm.llm_engine)
    try:
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        m.observe_outputs(outs)
    finally:
        llm.llm_engine.remove_observer(m.on_step)
    text = m.render().decode()
    assert metric_values(text, "tokenloom:generation_tokens_total") == [sum(len(o.outputs[0].token_ids) for o in outs)]
    assert metric_values(text, "tokenloom:e2e_request_latency_seconds_count") == [3.0]
    assert metric_values(text, "tokenloom:prompt_tokens_total") == [sum(len(o.prompt_token_ids) for o in outs)]
    assert metric_values(text, "tokenloom:kv_cache_usage_perc") == [0.0]


# ---- disconnects -----------------------------------------------------------------

def test_stream_disconnect_aborts_and_frees_kv(guarded):
    srv, auth = guarded, {"Authorization": f"Bearer {API_KEY}"}
    aborted = metric(srv.base_url, "tokenloom:request_success_total", finished_reason="abort")
    # ~16k tokens: still running when the client leaves, however fast the machine decodes
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 16000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=auth, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data:")
            if got == 3:
                break
        assert metric(srv.base_url, "tokenloom:kv_cache_usage_perc") > 0
        # the engine steps on its own thread: the event loop keeps answering meanwhile
        t0 = time.monotonic()
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 2.0
    # the connection is closed: the request must be aborted and its KV blocks returned
    assert wait_until(lambda: _idle(srv.base_url), 10), httpx.get(srv.base_url + "/metrics").text
    assert metric(srv.base_url, "tokenloom:request_success_total", finished_reason="abort") == aborted + 1


def test_nonstream_disconnect_aborts(subprocess_server):
    srv = subprocess_server()  # 16k tokens of context (the SIGTERM test below stops it)
    aborted = metric(srv.base_url, "tokenloom:request_success_total", finished_reason="abort")
    # 4 x 4,000 tokens: far longer than the 0.1 s the client waits for the response however fast
    # the machine decodes; connecting and sending get the default time, so the request arrives.
    body = {"model": NAME, "prompt": PROMPTS[4], "max_tokens": 4000, "n": 4, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.1))
    assert wait_until(lambda: metric(srv.base_url, "tokenloom:request_success_total", finished_reason="abort")
                      == aborted + 4, 10)  # one per completion
    assert wait_until(lambda: _idle(srv.base_url), 10)


# ---- errors ----------------------------------------------------------------------

def test_error_statuses_and_shape(srv, client):
    url = srv.base_url + "/v1/completions"
    curl = srv.base_url + "/v1/chat/completions"
    post = lambda u, body: httpx.post(u, json=body)  # noqa: E731
    e = _error(httpx.post(url, content=b'{"prompt": "x",', headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    _error(post(url, {"prompt": 12}), 400, "prompt")
    _error(post(url, {}), 400, "prompt")
    _error(post(url, {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
    _error(post(url, {"prompt": "x", "temperature": -1}), 400, "temperature")
    _error(post(url, {"prompt": "x", "top_p": 1.5}), 400, "top_p")
    _error(post(url, {"prompt": "x", "n": 0}), 400, "n")
    _error(post(url, {"prompt": "x", "logprobs": 50}), 400, "logprobs")
    _error(post(url, {"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _error(post(url, {"prompt": "x", "presence_penalty": 5}), 400, "presence_penalty")
    _error(post(url, {"prompt": []}), 400, "prompt")
    _error(post(url, {"prompt": [[1, 2], [999999]]}), 400, "prompt")
    _error(post(url, {"prompt": "x", "seed": 2**70}), 400, "seed")
    _error(post(url, {"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias")
    _error(post(url, {"prompt": "x", "logit_bias": {"5": 200}}), 400, "logit_bias")
    e = _error(post(curl, {"messages": CHAT, "logit_bias": {"99999999": 1}}), 400, "logit_bias")
    assert "vocabulary" in e["message"]
    _error(post(url, {"prompt": "x", "allowed_token_ids": []}), 400, "allowed_token_ids")
    n_long = httpx.post(srv.base_url + "/tokenize", json={"prompt": "hello " * 300}).json()["count"]
    e = _error(post(url, {"prompt": "hello " * 300}), 400, "prompt")
    assert "256" in e["message"] and str(n_long) in e["message"]  # both lengths: the prompt's and the limit
    e = _error(post(url, {"prompt": "x", "max_tokens": 1000}), 400, "max_tokens")
    assert "256" in e["message"] and "1000" in e["message"]
    e = _error(post(url, {"prompt": "x", "model": "gpt-4"}), 404, "model")
    assert e["code"] == "model_not_found"
    _error(post(curl, {"messages": []}), 400, "messages")
    _error(post(curl, {"messages": [{"content": "no role"}]}), 400)
    _error(post(curl, {"messages": CHAT, "top_logprobs": 2}), 400, "top_logprobs")
    _error(post(curl, {"messages": CHAT, "max_completion_tokens": 5000}), 400)
    _error(httpx.get(srv.base_url + "/v1/nothing-here"), 404)
    _error(httpx.get(url), 405)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt="x", temperature=-3)
    assert ei.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    assert wait_until(lambda: _idle(srv.base_url), 5)


def test_bad_requests_do_not_disturb_running_ones(srv, expected):
    p = PROMPTS[7]
    body = {"model": NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
        for i, event in enumerate(sse_events(r.iter_lines())):
            if event == "[DONE]":
                break
            text += event["choices"][0]["text"]
            if i == 0:  # while it runs, throw garbage at the server
                for bad in ({"prompt": "x", "temperature": -1}, {"prompt": [10**7]}, {"prompt": "y" * 5000}):
                    assert httpx.post(srv.base_url + "/v1/completions", json=bad).status_code == 400
    assert text == expected[p]


# ---- the guarded server, and a real process for signals ------------------------------

def test_api_key(guarded):
    server = guarded
    url = server.base_url
    body = {"model": NAME, "prompt": "x", "max_tokens": 2}
    e = _error(httpx.post(url + "/v1/completions", json=body), 401)
    assert e["code"] == "invalid_api_key"
    _error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(url + "/v1/models"), 401)
    _error(httpx.post(url + "/v1/completions", content=b"{bad", headers={"content-type": "application/json"}), 401)
    assert httpx.get(url + "/health").status_code == 200  # liveness and metrics stay open
    assert httpx.get(url + "/metrics").status_code == 200
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert c.completions.create(model=NAME, prompt="x", max_tokens=2).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def test_missing_chat_template_is_400(guarded):
    server = guarded
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": NAME, "messages": CHAT},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    e = _error(r, 400, "messages")
    assert "chat template" in e["message"] and "--chat-template" in e["message"]


def test_queue_full_is_429(guarded):
    server = guarded
    url, auth = server.base_url, {"Authorization": f"Bearer {API_KEY}"}
    # ~16k tokens: still running while the test queues and refuses others, however fast the machine
    long = {"model": NAME, "prompt": "a", "max_tokens": 16000, "ignore_eos": True, "temperature": 0, "stream": True}
    waiting_result: dict = {}

    def second() -> None:  # queued behind the long one (--max-num-seqs 1)
        waiting_result["resp"] = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                                            json={"model": NAME, "prompt": "b", "max_tokens": 3})

    with httpx.stream("POST", url + "/v1/completions", json=long, headers=auth, timeout=60) as r:
        it = r.iter_lines()
        next(line for line in it if line.startswith("data:"))  # the long request is running
        t = threading.Thread(target=second)
        t.start()
        assert wait_until(lambda: metric(url, "tokenloom:num_requests_waiting") >= 1, 10)
        r = httpx.post(url + "/v1/completions", headers=auth, json={"model": NAME, "prompt": "c"})
        e = _error(r, 429)
        assert e["code"] == "queue_full" and r.headers["retry-after"] == "1"
    # leaving the stream aborts the long request; the queued one then runs to completion
    t.join(60)
    assert waiting_result["resp"].status_code == 200
    assert wait_until(lambda: _idle(url), 10)


def test_sigterm_finishes_in_flight_and_exits_0(subprocess_server):
    """SIGTERM: stop accepting; a short stream finishes, one that outlives the grace period
    (--shutdown-timeout 3) is aborted with an error chunk and [DONE]; exit status 0."""
    server = subprocess_server()
    url = server.base_url + "/v1/completions"
    long_events: list = []

    def long_stream() -> None:
        # ~16k tokens: far more than the 3 s grace, however fast the machine decodes
        body = {"model": NAME, "prompt": "e", "max_tokens": 16000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            long_events.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_until(lambda: metric(server.base_url, "tokenloom:num_requests_running") >= 1, 30)
    body = {"model": NAME, "prompt": "d", "max_tokens": 20, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        it = r.iter_lines()
        next(line for line in it if line.startswith("data:"))
        server.proc.send_signal(signal.SIGTERM)
        events = sse_events(it)
    assert events[-1] == "[DONE]"  # the short in-flight stream was allowed to finish
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    t.join(60)
    assert long_events[-1] == "[DONE]"
    assert long_events[-2]["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=2)
