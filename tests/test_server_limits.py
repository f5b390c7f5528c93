"""What one request may cost, what a request may not do, and the client gaps closed.

Two real servers on 127.0.0.1 (uvicorn in a thread, a tiny random-weight model):
  - `roomy`: default limits and a 16k context: the defaults are on, a 5 MB prompt is refused
    without stalling a running stream, request chat templates are refused, malformed text is
    a 400, a failure's 500 carries no exception text, and the compatibility routes work;
  - `strict`: every limit set small by its flag, --api-key, --trust-request-chat-template.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import ThreadedServer, allow_context, make_tiny_model, metric, wait_until
from tokenloom.bench.launcher import free_port

NAME = "tiny"
KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return allow_context(make_tiny_model(tmp_path_factory.mktemp("limits") / "tiny"), 16384)


@pytest.fixture(scope="module")
def roomy(model_dir: Path):
    srv = ThreadedServer([str(model_dir), "--port", str(free_port()), "--max-model-len", "16384",
                          "--num-kv-blocks", "1100", "--seed", "0", "--served-model-name", NAME,
                          "--log-level", "critical", "--disable-access-log"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict(model_dir: Path, roomy):
    srv = ThreadedServer([str(model_dir), "--port", str(free_port()), "--max-model-len", "128",
                          "--num-kv-blocks", "64", "--served-model-name", NAME, "--api-key", KEY,
                          "--max-stop-strings", "2", "--max-stop-string-chars", "8", "--max-prompts-per-request", "2",
                          "--max-logit-bias", "3", "--max-n", "2", "--max-request-body-bytes", "4096",
                          "--trust-request-chat-template", "--log-level", "critical", "--disable-access-log"]).start()
    yield srv
    srv.stop()


def _error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


def _idle(url: str) -> bool:
    return (metric(url, "tokenloom:num_requests_running") == 0 and metric(url, "tokenloom:num_requests_waiting") == 0
            and metric(url, "tokenloom:kv_cache_usage_perc") == 0)


def _raw_json(url: str, text: str, headers: dict | None = None) -> httpx.Response:
    """POST a body written by hand (httpx's own encoder refuses lone surrogates)."""
    return httpx.post(url, content=text.encode(), headers={"content-type": "application/json", **(headers or {})},
                      timeout=60)


# ---- limits ---------------------------------------------------------------------

def test_limits_are_on_by_default(roomy):
    from tokenloom.entrypoints.cli import build_parser
    from tokenloom.entrypoints.openai.limits import ServerLimits

    defaults = ServerLimits.from_cli_args(build_parser().parse_args(["serve"]))
    assert defaults == ServerLimits() and defaults.max_queued_requests is not None
    assert not defaults.trust_request_chat_template
    url = roomy.base_url + "/v1/completions"
    too_many = defaults.max_stop_strings + 1
    e = _error(httpx.post(url, json={"prompt": "hi", "stop": [f"s{i}" for i in range(too_many)]}), 400, "stop")
    assert e["code"] == "limit_exceeded" and "--max-stop-strings" in e["message"]
    _error(httpx.post(url, json={"prompt": "hi", "stop": "x" * (defaults.max_stop_string_chars + 1)}), 400, "stop")
    _error(httpx.post(url, json={"prompt": ["a"] * (defaults.max_prompts_per_request + 1)}), 400, "prompt")
    bias = {str(i): 1.0 for i in range(defaults.max_logit_bias + 1)}
    _error(httpx.post(url, json={"prompt": "hi", "logit_bias": bias}), 400, "logit_bias")
    _error(httpx.post(url, json={"prompt": "hi", "n": defaults.max_n + 1}), 400, "n")
    assert wait_until(lambda: _idle(roomy.base_url), 10)


@pytest.mark.parametrize("route,extra,param", [
    ("completions", {"stop": ["a", "b", "c"]}, "stop"),
    ("completions", {"stop": "123456789"}, "stop"),
    ("completions", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("completions", {"prompt": [[5, 6], [7], [8]]}, "prompt"),
    ("completions", {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias"),
    ("completions", {"n": 3}, "n"),
    ("chat/completions", {"stop": ["a", "b", "c"]}, "stop"),
    ("chat/completions", {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias"),
])
def test_each_limit_is_a_400_naming_its_field(strict, route, extra, param):
    body = {"model": NAME, "max_tokens": 2, **({"prompt": "hi"} if route == "completions" else {"messages": CHAT}),
            **extra}
    e = _error(httpx.post(f"{strict.base_url}/v1/{route}", json=body, headers=AUTH), 400, param)
    assert e["code"] == "limit_exceeded"


def test_requests_at_the_limits_are_served(strict):
    body = {"model": NAME, "prompt": ["a", "b"], "stop": ["12345678", "y"], "n": 2, "max_tokens": 2,
            "logit_bias": {"1": 1, "2": 1, "3": 1}}
    r = httpx.post(strict.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    assert wait_until(lambda: _idle(strict.base_url), 10)


def test_body_over_the_limit_is_413(strict):
    url = strict.base_url + "/v1/completions"
    big = json.dumps({"model": NAME, "prompt": "x" * 5000}).encode()
    e = _error(httpx.post(url, content=big, headers={**AUTH, "content-type": "application/json"}), 413, None)
    assert e["code"] == "request_too_large" and "--max-request-body-bytes" in e["message"]

    def chunks():  # no Content-Length: the body is counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    _error(httpx.post(url, content=chunks(), headers={**AUTH, "content-type": "application/json"}), 413, None)
    small = json.dumps({"model": NAME, "prompt": "x" * 100, "max_tokens": 1}).encode()
    assert httpx.post(url, content=iter([small[:50], small[50:]]), timeout=60,
                      headers={**AUTH, "content-type": "application/json"}).status_code == 200


def test_largest_tokenizing_does_not_stall_streams(roomy):
    """The most text the server will tokenize for one request -- just under the length at
    which /tokenize refuses without tokenizing (`--max-tokenize-tokens` x L bytes) -- is
    tokenized in a worker thread: while it is refused, a running stream's longest pause stays
    far below the time the refusal takes (measured in the same run)."""
    from tokenloom.engine.prompt_bound import prompt_bound
    from tokenloom.entrypoints.openai.limits import ServerLimits

    url = roomy.base_url + "/v1/completions"
    arrivals: list[float] = []
    started = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"model": NAME, "prompt": "a", "max_tokens": 16000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.perf_counter())
                    started.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    time.sleep(0.2)  # a few chunks in: the stream is running steadily
    most = prompt_bound(roomy.engine.tokenizer).max_bytes_per_token * ServerLimits().max_tokenize_tokens
    unit = "the quick brown fox jumps over the lazy dog. "
    huge = (unit * (most // len(unit)))[:most]
    t0 = time.perf_counter()
    r = httpx.post(roomy.base_url + "/tokenize", json={"model": NAME, "prompt": huge}, timeout=120)
    t1 = time.perf_counter()
    time.sleep(0.2)
    stop.set()
    t.join(60)
    e = _error(r, 400, "prompt")
    assert e["code"] == "limit_exceeded" and "at least" not in e["message"]  # counted: it was tokenized
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t0 and a < t1]
    assert len(during) >= 3, "the stream produced nothing while the text was being tokenized"
    print(f"{len(huge)} bytes refused in {t1 - t0:.2f}s, longest stream pause meanwhile {max(during):.3f}s "
          f"over {len(during)} gaps")
    assert max(during) < (t1 - t0) / 4, (max(during), t1 - t0)
    assert wait_until(lambda: _idle(roomy.base_url), 10)


def _ten_megabytes() -> str:
    unit = "the quick brown fox jumps over the lazy dog. "
    return (unit * (10_000_000 // len(unit) + 1))[:10_000_000]


def _cpu_to_tokenize(tokenizer, text: str) -> float:
    """CPU seconds this process spends tokenizing `text` (a tenth of it, times ten)."""
    part = text[:len(text) // 10]
    c0 = time.process_time()
    tokenizer.encode(part, add_special_tokens=False)
    return (time.process_time() - c0) * 10


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", lambda big: {"prompt": big}, "prompt"),
    ("/v1/completions", lambda big: {"prompt": ["a short one", "another", big]}, "prompt"),
    ("/v1/chat/completions", lambda big: {"messages": [{"role": "user", "content": big}]}, "messages"),
])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(roomy, route, body, param):
    """Issue 37: a 10 MB prompt (under the body limit) was tokenized in full -- seconds of
    CPU -- before its 400.  Its length alone shows it cannot fit max_model_len: the 400 now
    costs this process (server and client: CPU time, not wall time) a small fraction of what
    tokenizing the text costs, in the same run."""
    big = _ten_megabytes()
    full = _cpu_to_tokenize(roomy.engine.tokenizer, big)
    c0 = time.process_time()
    r = httpx.post(roomy.base_url + route, json={"model": NAME, "max_tokens": 4, **body(big)}, timeout=300)
    spent = time.process_time() - c0
    e = _error(r, 400, param)
    assert e["code"] == "context_length_exceeded"
    assert "16384" in e["message"] and "at least" in e["message"]
    print(f"{route}: refused in {spent:.3f} CPU-s; tokenizing the text costs {full:.2f} CPU-s")
    assert spent < full / 5, (spent, full)
    assert wait_until(lambda: _idle(roomy.base_url), 10)


def test_tokenize_counts_past_the_context_but_not_without_bound(roomy):
    """/tokenize counts a text longer than max_model_len (as vLLM's does: lm-eval-harness cuts
    documents into context windows), up to --max-tokenize-tokens; a 10 MB text, certainly
    beyond that, is refused before it is tokenized."""
    from tokenloom.entrypoints.openai.limits import ServerLimits

    doc = "the quick brown fox jumps over the lazy dog. " * 3000
    r = httpx.post(roomy.base_url + "/tokenize", json={"model": NAME, "prompt": doc}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 16384 == r.json()["max_model_len"]
    big = _ten_megabytes()
    full = _cpu_to_tokenize(roomy.engine.tokenizer, big)
    for body in ({"prompt": big}, {"messages": [{"role": "user", "content": big}]}):
        c0 = time.process_time()
        r = httpx.post(roomy.base_url + "/tokenize", json={"model": NAME, **body}, timeout=300)
        spent = time.process_time() - c0
        e = _error(r, 400, "prompt" if "prompt" in body else "messages")
        assert e["code"] == "limit_exceeded" and str(ServerLimits().max_tokenize_tokens) in e["message"]
        assert spent < full / 5, (spent, full)
    too_many = {"model": NAME, "tokens": [5] * (ServerLimits().max_tokenize_tokens + 1)}
    _error(httpx.post(roomy.base_url + "/detokenize", json=too_many, timeout=60), 400, "tokens")


# ---- what a request may not do ------------------------------------------------------

def test_request_chat_template_is_refused_by_default(roomy):
    tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for route in ("/v1/chat/completions", "/tokenize"):
        e = _error(httpx.post(roomy.base_url + route, json={"model": NAME, "messages": CHAT, "chat_template": tpl}),
                   400, "chat_template")
        assert "--trust-request-chat-template" in e["message"]
    r = httpx.post(roomy.base_url + "/v1/chat/completions",
                   json={"model": NAME, "messages": CHAT, "chat_template_kwargs": {"tokenize": False}})
    _error(r, 400, "chat_template_kwargs")


def test_trusted_request_chat_template_renders_and_fails_as_400(strict):
    url = strict.base_url
    tpl = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    got = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": CHAT, "chat_template": tpl}).json()
    want = httpx.post(url + "/tokenize", headers=AUTH,
                      json={"prompt": "[Say something.]", "add_special_tokens": False}).json()
    assert got["tokens"] == want["tokens"]
    for broken in ("{{ 1 / 0 }}", "{% for %}", "{{ raise_exception('no') }}"):
        e = _error(httpx.post(url + "/v1/chat/completions", headers=AUTH,
                              json={"model": NAME, "messages": CHAT, "chat_template": broken}), 400, "messages")
        assert e["code"] == "chat_template_error"


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogate_is_400(roomy, route, body, param):
    e = _error(_raw_json(roomy.base_url + route, body), 400, param)
    assert e["code"] == "invalid_unicode"


def test_500_does_not_echo_the_exception(roomy):
    from tokenloom.engine.faults import FaultInjector

    engine = roomy.engine.engine
    engine.faults = FaultInjector.parse("detokenize:VICTIM")
    try:
        r = httpx.post(roomy.base_url + "/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": "the VICTIM said", "max_tokens": 4, "ignore_eos": True})
        e = _error(r, 500, None)
        assert "injected" not in e["message"] and "Fault" not in e["message"] and "server log" in e["message"]
        ok = httpx.post(roomy.base_url + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "fine"})
        assert ok.status_code == 200
    finally:
        engine.faults = None
    assert wait_until(lambda: _idle(roomy.base_url), 10)


def test_api_key_guards_the_tokenizer_routes(strict):
    url = strict.base_url
    for method, route, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
                                ("GET", "/tokenizer_info", None), ("GET", "/v1/models/tiny", None)):
        e = _error(httpx.request(method, url + route, json=body), 401, None)
        assert e["code"] == "invalid_api_key"
        assert httpx.request(method, url + route, json=body, headers=AUTH).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_bearer_scheme_is_case_insensitive(strict):
    """RFC 7235: the auth scheme is case-insensitive (`bearer K` was a 401); the key is not."""
    url = strict.base_url + "/v1/models"
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR  {KEY}", f"Bearer {KEY}"):
        assert httpx.get(url, headers={"Authorization": header}).status_code == 200, header
    for header in (f"Bearer {KEY.upper()}", f"Bearer {KEY}x", f"Basic {KEY}", f"Bearer{KEY}", KEY, "Bearer"):
        e = _error(httpx.get(url, headers={"Authorization": header}), 401, None)
        assert e["code"] == "invalid_api_key"
    dashboard = httpx.get(strict.base_url + "/dashboard", headers={"Authorization": f"bearer {KEY}"})
    assert dashboard.status_code == 200


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("ids", [[1_000_000_000], [5, 2**31]])
def test_out_of_vocabulary_stop_token_id_is_400(roomy, route, ids):
    """Like every other token id a request names, a stop id must exist in the vocabulary."""
    body = {"model": NAME, "max_tokens": 2, "stop_token_ids": ids,
            **({"prompt": "hi"} if route == "completions" else {"messages": CHAT})}
    e = _error(httpx.post(f"{roomy.base_url}/v1/{route}", json=body, timeout=60), 400, "stop_token_ids")
    assert "out of range" in e["message"]
    ok = httpx.post(f"{roomy.base_url}/v1/{route}", json={**body, "stop_token_ids": [5]}, timeout=60)
    assert ok.status_code == 200


# ---- client compatibility ---------------------------------------------------------------

def test_models_retrieve(roomy):
    client = openai.OpenAI(base_url=roomy.base_url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_tokenizer_info(roomy, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    info = httpx.get(roomy.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 16384
    assert info["tokenizer_class"] == type(tok).__name__


def test_echo_with_max_tokens_0_scores_the_prompt(roomy, model_dir):
    """lm-eval-harness's loglikelihood request: the prompt's own logprobs, nothing generated;
    the logprobs are transformers' on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "Once upon a time there was a"
    client = openai.OpenAI(base_url=roomy.base_url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    ids = httpx.post(roomy.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == r.usage.prompt_tokens and lp.token_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < 1e-4
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert chunks[-1].usage.completion_tokens == 0
    _error(httpx.post(roomy.base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400,
           "max_tokens")


def test_stream_options_without_stream_is_400(roomy):
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": CHAT})):
        r = httpx.post(f"{roomy.base_url}/v1/{route}", json={**body, "stream_options": {"include_usage": True}})
        _error(r, 400, "stream_options")


def test_openapi_document_tells_the_truth(roomy):
    doc = httpx.get(roomy.base_url + "/openapi.json").json()
    paths = doc["paths"]
    assert "422" not in json.dumps({p: {m: op["responses"] for m, op in ops.items()} for p, ops in paths.items()})
    gen = paths["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "503"} <= set(gen)
    assert set(gen["200"]["content"]) == {"application/json", "text/event-stream"}
    assert gen["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(paths["/health"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert paths["/health"]["get"]["responses"]["503"]["content"]["application/json"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
