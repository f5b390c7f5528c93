"""The live server against its own OpenAPI document, fuzzed by schemathesis.

Every operation in /openapi.json gets schema-valid and schema-breaking requests (wrong types,
missing fields, out-of-range values, odd strings), and every answer goes through
schemathesis's default checks -- all of them: no 5xx, a status and content type the document
lists, a body matching the declared schema, *schema-breaking data refused* and *schema-valid
data accepted*.  The last two hold the document to exactly what the server accepts: each
limit the server enforces is in the document (openapi_doc / openapi_limits, per server:
vocabulary, max_model_len, --max-n, ...).  What no JSON Schema can state is the short list of
runtime rules the document itself carries (`openapi_limits.RUNTIME_RULES`): valid requests
are generated to respect them, each rule checked here by its own oracle (the tokenizer, the
grammar compiler, the chat template, the LoRA adapter reader), never by asking the route under
test.  The server runs with a short context and small `n`, so a fuzzed generation request stays
cheap, and with LoRA on (one adapter served), so the adapter routes are fuzzed too.

Then a disconnect storm: 50 streams cut at random points (before the headers, mid-stream,
after the first chunk) must leave nothing running, the KV cache empty, and the next greedy
request unchanged.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # a test extra; CI installs it

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server_fixtures import ThreadedServer, make_tiny_adapter, make_tiny_model, metric, wait_until  # noqa: E402
from tokenloom.bench.launcher import free_port  # noqa: E402

EXAMPLES_PER_OPERATION = int(os.environ.get("TOKENLOOM_FUZZ_EXAMPLES", 25))
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("fuzz") / "tiny")
    adapter = make_tiny_adapter(model, tmp_path_factory.mktemp("fuzz-lora") / "tiny-lora")
    srv = ThreadedServer([str(model), "--port", str(free_port()), "--max-model-len", str(MAX_MODEL_LEN),
                          "--num-kv-blocks", "96", "--max-num-seqs", "16", "--max-n", "2", "--seed", "0",
                          "--served-model-name", "tiny", "--log-level", "critical", "--disable-access-log",
                          "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"tiny-lora={adapter}"]).start()
    yield srv
    srv.stop()


def _idle(url: str) -> bool:
    return (metric(url, "tokenloom:num_requests_running") == 0 and metric(url, "tokenloom:num_requests_waiting") == 0
            and metric(url, "tokenloom:kv_cache_usage_perc") == 0)


_CONSTRAINTS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _compiles(srv: ThreadedServer, body: dict) -> bool:
    """Runtime rules: at most one output constraint, and a JSON schema, regex or grammar the
    grammar compiler accepts (a shape the document rules out is left to the server: the checks
    must see it refused)."""
    from tokenloom.sampling_params import StructuredOutputsParams

    specs = [StructuredOutputsParams(**{key: body[f]}) for f, key in _CONSTRAINTS.items() if body.get(f) is not None]
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        keys = ("json", "regex", "choice", "grammar", "json_object")  # the server ignores other keys
        specs.append(StructuredOutputsParams(**{k: v for k, v in so.items() if k in keys and v is not None}))
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type", "text") != "text":
        js = (rf.get("json_schema") or {}).get("schema")
        specs.append(StructuredOutputsParams(json_object=True) if rf["type"] == "json_object"
                     else StructuredOutputsParams(json=js))
    if len(specs) > 1:
        return False
    for spec in specs:
        if all(getattr(spec, k) is None for k in ("json", "regex", "grammar")):
            continue  # choice, json_object: their shape is the document's to state
        try:  # a JSON schema (also its text), a regex or a grammar: only compiling tells
            spec.spec()
            srv.engine.engine.grammars.compile(spec, "structured_outputs")
        except Exception:
            return False
    return True


def _prompt_lengths(srv: ThreadedServer, body: dict) -> list[int] | None:
    """Runtime rule: the prompt's tokens, by the tokenizer (chat: the template renders them)."""
    tok = srv.engine.tokenizer
    if "messages" in body:
        msgs = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(part["text"] for part in content)
            msgs.append({**m, "content": content or ""})
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=body.get("add_generation_prompt", True),
                                           tokenize=False, **(body.get("chat_template_kwargs") or {}))
        except Exception:
            return None  # the template cannot render these messages
        return [len(tok.encode(text, add_special_tokens=False))]
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], (int, float))) else prompt
    special = body.get("add_special_tokens", True)
    return [len(tok.encode(p, add_special_tokens=special)) if isinstance(p, str) else len(p) for p in prompts]


def _adapter_runs(srv: ThreadedServer, body: object) -> bool:
    """Runtime rule of POST /v1/load_lora_adapter (its schema's description): an adapter found
    at lora_path must be one this server runs -- asked of the adapter reader, not the route.
    (No adapter there is a 404 and a taken name a 409, both statuses a valid request may get.)"""
    from tokenloom.model.weights.peft_lora import CONFIG_FILE
    from tokenloom.request import LoRARequest

    path = body.get("lora_path") if isinstance(body, dict) else None
    try:
        if not isinstance(path, str) or not (Path(path).expanduser() / CONFIG_FILE).is_file():
            return True
        srv.engine.engine.load_lora(LoRARequest("oracle", 1, path))
    except (RuntimeError, ValueError, OSError):
        return False
    return True


def _runtime_rules_hold(srv: ThreadedServer, label: str, body: object) -> bool:
    """Whether a schema-valid body also keeps `openapi_limits.RUNTIME_RULES` (which the
    document states but JSON Schema cannot): only such bodies must be accepted."""
    if label == "POST /v1/load_lora_adapter":
        return _adapter_runs(srv, body)
    if label not in ("POST /v1/completions", "POST /v1/chat/completions") or not isinstance(body, dict):
        return True
    chat = label.endswith("chat/completions")
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    if not chat and max_tokens == 0 and not body.get("echo"):
        return False
    if not chat and body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        return False
    if max_tokens is not None and body.get("min_tokens", 0) > max(max_tokens, 1):
        return False
    lengths = _prompt_lengths(srv, body)
    if lengths is None or max(lengths) + max(max_tokens or 1, 1) > MAX_MODEL_LEN:
        return False
    return _compiles(srv, body)


def test_openapi_document_is_what_the_server_accepts(server):
    url = server.base_url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /health",
                                               "GET /v1/models/{model_id}", "GET /tokenizer_info",
                                               "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"}
    for op in operations:
        label = op.label
        valid = op.as_strategy(GenerationMode.POSITIVE).filter(
            lambda case, label=label: _runtime_rules_hold(server, label, case.body))
        strategy = valid | op.as_strategy(GenerationMode.NEGATIVE)

        @given(case=strategy)
        # derandomize: the same examples every run, so CI cannot pass one day and fail the next
        # on the same code (TOKENLOOM_FUZZ_EXAMPLES raises the count for a deeper local search)
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            case.call_and_validate(base_url=url, timeout=60)  # schemathesis's default checks, all of them

        run()
    assert wait_until(lambda: _idle(url), 30)


def _edge_cases(vocab: int) -> list[tuple[str, str, dict]]:
    """(route, request schema, body): each limit the server enforces, just inside and just outside."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    g = {"prompt": "hi", "max_tokens": 2}
    return [
        (c, "CompletionRequest", {**g, "guided_choice": []}), (c, "CompletionRequest", {**g, "guided_choice": ["a"]}),
        (c, "CompletionRequest", {**g, "stop_token_ids": [10**9]}),
        (c, "CompletionRequest", {**g, "stop_token_ids": [vocab - 1]}),
        (c, "CompletionRequest", {**g, "prompt": [vocab]}), (c, "CompletionRequest", {**g, "prompt": [vocab - 1]}),
        (c, "CompletionRequest", {**g, "prompt": [5.0, 6]}), (c, "CompletionRequest", {**g, "prompt": [True]}),
        (c, "CompletionRequest", {**g, "prompt": []}), (c, "CompletionRequest", {**g, "prompt": ""}),
        (c, "CompletionRequest", {**g, "logit_bias": {"+5": 1}}), (c, "CompletionRequest", {**g, "logit_bias": {"05": 1}}),
        (c, "CompletionRequest", {**g, "logit_bias": {str(vocab): 1}}),
        (c, "CompletionRequest", {**g, "logit_bias": {str(vocab - 1): 100}}),
        (c, "CompletionRequest", {**g, "n": 3}), (c, "CompletionRequest", {**g, "n": 2}),
        (c, "CompletionRequest", {**g, "max_tokens": MAX_MODEL_LEN}), (c, "CompletionRequest", {**g, "max_tokens": 8}),
        (c, "CompletionRequest", {**g, "seed": 2**63 - 1, "n": 2}), (c, "CompletionRequest", {**g, "seed": 2**63}),
        (c, "CompletionRequest", {**g, "temperature": -0.5}), (c, "CompletionRequest", {**g, "top_p": 0}),
        (c, "CompletionRequest", {**g, "stream_options": {"include_usage": True}}),
        (c, "CompletionRequest", {**g, "suffix": "x"}), (c, "CompletionRequest", {**g, "stop": [""]}),
        (c, "CompletionRequest", {**g, "structured_outputs": {"choice": ["a"], "regex": "b"}}),
        (c, "CompletionRequest", {**g, "structured_outputs": {"json_object": False}}),
        (c, "CompletionRequest", {**g, "structured_outputs": {"choice": ["a"], "json_object": False}}),
        (c, "CompletionRequest", {**g, "response_format": {"type": "json_schema"}}),
        (c, "CompletionRequest", {**g, "response_format": {"type": "json_object"}}),
        (chat, "ChatCompletionRequest", {"messages": msgs, "max_tokens": 2, "chat_template": "{{ 1 }}"}),
        (chat, "ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}],
                                         "max_tokens": 2}),
        (chat, "ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                         "max_tokens": 2}),
        ("/tokenize", "TokenizeRequest", {"prompt": "a", "messages": msgs}), ("/tokenize", "TokenizeRequest", {}),
        ("/tokenize", "TokenizeRequest", {"messages": []}), ("/tokenize", "TokenizeRequest", {"messages": msgs}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab]}), ("/detokenize", "DetokenizeRequest", {"tokens": [-1]}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab - 1, 5]}),
    ]


def test_document_and_server_agree_at_each_limit(server):
    """Deterministic companion of the fuzz test (which samples): at every limit the server
    enforces, a body just outside is refused by the server (400) *and* by the document's
    schema, one just inside is served (200) and valid -- the mismatches schemathesis found
    (guided_choice [], out-of-vocabulary ids) among them."""
    import jsonschema

    url = server.base_url
    doc = httpx.get(url + "/openapi.json").json()
    vocab = server.engine.engine.vocab_size
    for route, name, body in _edge_cases(vocab):
        validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **doc})
        valid = validator.is_valid(body)
        status = httpx.post(url + route, json=body, timeout=60).status_code
        assert status in (200, 400), (route, body, status)
        assert valid == (status == 200), f"{route} {body}: server {status}, document says {'valid' if valid else 'invalid'}"
    assert wait_until(lambda: _idle(url), 30)


async def _cut_stream(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> None:
    body = {"model": "tiny", "prompt": f"storm {i}: the", "max_tokens": rng.randint(1, 24), "ignore_eos": True,
            "stream": True, "n": rng.choice([1, 2]), "temperature": rng.choice([0.0, 1.0])}
    endpoint = "/v1/completions"
    if i % 3 == 0:
        endpoint = "/v1/chat/completions"
        body = {**body, "messages": [{"role": "user", "content": body.pop("prompt")}]}
    how = rng.choice(["timeout", "chunks", "chunks"])
    if how == "timeout":  # cancelled at a random moment: before the headers, or mid-stream
        try:
            await asyncio.wait_for(_read_all(client, url + endpoint, body), timeout=rng.uniform(0.0, 0.3))
        except (asyncio.TimeoutError, TimeoutError):
            pass
        return
    keep = rng.randint(0, 12)
    async with client.stream("POST", url + endpoint, json=body) as r:
        assert r.status_code == 200
        n = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                n += 1
                if n > keep:
                    break  # leaving the block closes the connection mid-stream


async def _read_all(client: httpx.AsyncClient, url: str, body: dict) -> None:
    async with client.stream("POST", url, json=body) as r:
        async for _ in r.aiter_lines():
            pass


def test_disconnect_storm_leaves_nothing_running(server):
    url = server.base_url
    greedy = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0}
    before = httpx.post(url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]

    async def storm() -> None:
        rng = random.Random(18)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(_cut_stream(client, url, rng, i) for i in range(50)))

    asyncio.run(storm())
    assert wait_until(lambda: _idle(url), 30), "requests or KV blocks left behind by cut streams"
    snap = server.engine.snapshot()
    assert snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_cache_usage == 0
    after = httpx.post(url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
    assert after == before


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "stream": True}),
])
def test_streamed_events_match_the_documented_event_schema(server, route, body):
    """Every server-sent event of a real stream validates against the event schema the
    OpenAPI document declares for text/event-stream (read per event, as before OpenAPI 3.2)."""
    import jsonschema

    url = server.base_url
    doc = httpx.get(url + "/openapi.json").json()
    event_schema = doc["paths"][route]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    with httpx.stream("POST", url + route, json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [{"data": line[len("data: "):]} for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == {"data": "[DONE]"}
    for ev in events:
        jsonschema.validate(ev, event_schema)
