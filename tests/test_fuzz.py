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
cheap, and with LoRA on (one adapter served), so the adapter routes are fuzzed too.  A second
server runs `--runner pooling` on a sentence-transformers model (matryoshka, so `dimensions`
has values to take): its document lists /v1/embeddings instead of the generation routes, and
is held to what it accepts the same way.

Then a disconnect storm: 50 streams cut at random points (before the headers, mid-stream,
after the first chunk) must leave nothing running, the KV cache empty, and the next greedy
request unchanged.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")  # a test extra; CI installs it

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server_fixtures import ThreadedServer, make_tiny_adapter, make_tiny_model, metric, wait_until  # noqa: E402
from st_models import make_st_model  # noqa: E402
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


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-emb")
    tiny = make_tiny_model(root / "tiny")
    model = make_st_model(tiny, root / "st", "mean", config_extra={"matryoshka_dimensions": [16, 32]})
    shutil.copy(tiny / "tokenizer_config.json", model)  # the chat template back, for /tokenize's messages
    srv = ThreadedServer([str(model), "--runner", "pooling", "--port", str(free_port()), "--max-model-len",
                          str(MAX_MODEL_LEN), "--num-kv-blocks", "96", "--max-num-seqs", "16", "--seed", "0",
                          "--served-model-name", "tiny", "--log-level", "critical", "--disable-access-log"]).start()
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


def _responses_messages(body: dict) -> list[dict] | None:
    """The chat messages a Responses body stands for, as docs/responses.md maps them (the
    oracle for the prompt-length rule): None where the input holds no message."""
    msgs = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") is not None else []
    items = body["input"]
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    text = lambda c: c if isinstance(c, str) else "".join(part["text"] for part in c)  # noqa: E731
    assistant = None  # the assistant message a function_call joins
    for item in items:
        kind = item.get("type") or "message"
        if kind == "message":
            msgs.append({"role": "system" if item["role"] == "developer" else item["role"],
                         "content": text(item["content"])})
            assistant = msgs[-1] if item["role"] == "assistant" else None
        elif kind == "function_call" and assistant is None:
            assistant = {"role": "assistant", "content": ""}
            msgs.append(assistant)
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "content": text(item["output"])})
            assistant = None
    return msgs or None


def _responses_rules_hold(srv: ThreadedServer, body: dict) -> bool:
    """`openapi_limits.RESPONSES_RUNTIME_RULES`, each by its own oracle."""
    if body.get("previous_response_id") is not None:  # a stored response: none is, under the fuzzer
        return False
    tools = body.get("tools") or []
    names = [t["name"] for t in tools]
    choice = body.get("tool_choice")
    if len(set(names)) < len(names) or (not tools and choice not in (None, "none")):
        return False
    if choice == "required" or isinstance(choice, dict):  # forced calls: may not finish in max_output_tokens
        return False
    fmt = ((body.get("text") or {}).get("format")) or {}
    if fmt.get("type") == "json_schema" and not _compiles(srv, {"guided_json": fmt["schema"]}):
        return False
    msgs = _responses_messages(body)
    if msgs is None:
        return False
    tok = srv.engine.tokenizer
    length = len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False))
    return length + max(body.get("max_output_tokens") or 1, 1) <= MAX_MODEL_LEN


def _runtime_rules_hold(srv: ThreadedServer, label: str, body: object) -> bool:
    """Whether a schema-valid body also keeps `openapi_limits.RUNTIME_RULES` (which the
    document states but JSON Schema cannot): only such bodies must be accepted."""
    if label == "POST /v1/load_lora_adapter":
        return _adapter_runs(srv, body)
    if label == "POST /v1/embeddings" and isinstance(body, dict):  # EMBEDDING_RULES: every input fits
        inputs = body["input"]
        inputs = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], (int, float))) else inputs
        tok, special = srv.engine.tokenizer, body.get("add_special_tokens", True)
        return all(0 < (len(tok.encode(x, add_special_tokens=special)) if isinstance(x, str) else len(x))
                   <= MAX_MODEL_LEN for x in inputs)
    if label == "POST /v1/responses" and isinstance(body, dict):
        return _responses_rules_hold(srv, body)
    if label not in ("POST /v1/completions", "POST /v1/chat/completions") or not isinstance(body, dict):
        return True
    chat = label.endswith("chat/completions")
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    if chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        return False  # the tools' rules (a function's shape, unique names, forced calls): tests/test_tool_calls.py
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
    _fuzz(server, {"POST /v1/completions", "POST /v1/chat/completions", "GET /health", "GET /v1/models/{model_id}",
                   "GET /tokenizer_info", "POST /v1/responses", "GET /v1/responses/{response_id}",
                   "DELETE /v1/responses/{response_id}", "POST /v1/load_lora_adapter",
                   "POST /v1/unload_lora_adapter"}, absent={"POST /v1/embeddings"})


def test_pooling_server_document_is_what_it_accepts(pooling_server):
    _fuzz(pooling_server, {"POST /v1/embeddings", "GET /health", "GET /v1/models/{model_id}", "POST /tokenize"},
          absent={"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"})


def _fuzz(server: ThreadedServer, expected: set[str], absent: set[str] = frozenset()) -> None:
    url = server.base_url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert labels >= expected and not labels & absent
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
    c, chat, resp = "/v1/completions", "/v1/chat/completions", "/v1/responses"
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
        (c, "CompletionRequest", {**g, "use_beam_search": True, "n": 2}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "n": 2, "length_penalty": -2.5}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "logprobs": 1}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "echo": True}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "stop": ["a"]}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "presence_penalty": 0.5}),
        (c, "CompletionRequest", {**g, "use_beam_search": True, "response_format": {"type": "text"}}),
        (c, "CompletionRequest", {**g, "length_penalty": 10.5}), (c, "CompletionRequest", {**g, "length_penalty": 3}),
        (chat, "ChatCompletionRequest", {"messages": msgs, "max_tokens": 2, "chat_template": "{{ 1 }}"}),
        (chat, "ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}],
                                         "max_tokens": 2}),
        (chat, "ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                         "max_tokens": 2}),
        ("/tokenize", "TokenizeRequest", {"prompt": "a", "messages": msgs}), ("/tokenize", "TokenizeRequest", {}),
        ("/tokenize", "TokenizeRequest", {"messages": []}), ("/tokenize", "TokenizeRequest", {"messages": msgs}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab]}), ("/detokenize", "DetokenizeRequest", {"tokens": [-1]}),
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab - 1, 5]}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": MAX_MODEL_LEN}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 0}),
        (resp, "ResponsesRequest", {"input": [], "max_output_tokens": 2}),
        (resp, "ResponsesRequest", {"input": [{"role": "tool", "content": "x"}], "max_output_tokens": 2}),
        (resp, "ResponsesRequest", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
                                    "max_output_tokens": 2}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2, "background": True}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2, "background": False}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2, "tools": [{"type": "web_search"}]}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2,
                                    "text": {"format": {"type": "json_object"}}}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2, "metadata": {"k" * 65: "v"}}),
        (resp, "ResponsesRequest", {"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v"}}),
    ]


def _embedding_edge_cases(vocab: int) -> list[tuple[str, str, dict]]:
    e, name = "/v1/embeddings", "EmbeddingRequest"
    return [(e, name, body) for body in (
        {"input": "hi"}, {"input": ""}, {"input": []}, {"input": [[]]}, {"input": [vocab]}, {"input": [vocab - 1]},
        {"input": list(range(1, MAX_MODEL_LEN + 1))}, {"input": list(range(1, MAX_MODEL_LEN + 2))},
        {"input": [[5, 6], [7]]}, {"input": ["a", "b"]}, {"input": ["a", ""]}, {"input": [5.0, 6]},
        {"input": [True]}, {"input": "hi", "dimensions": 16}, {"input": "hi", "dimensions": 20},
        {"input": "hi", "dimensions": 0}, {"input": "hi", "encoding_format": "base64"},
        {"input": "hi", "encoding_format": "hex"})]


def test_document_and_server_agree_at_each_limit(server):
    """Deterministic companion of the fuzz test (which samples): at every limit the server
    enforces, a body just outside is refused by the server (400) *and* by the document's
    schema, one just inside is served (200) and valid -- the mismatches schemathesis found
    (guided_choice [], out-of-vocabulary ids) among them."""
    _agree_at_limits(server, _edge_cases(server.engine.engine.vocab_size))


def test_pooling_document_and_server_agree_at_each_limit(pooling_server):
    _agree_at_limits(pooling_server, _embedding_edge_cases(pooling_server.engine.engine.vocab_size))


def _agree_at_limits(server: ThreadedServer, cases: list[tuple[str, str, dict]]) -> None:
    import jsonschema

    url = server.base_url
    doc = httpx.get(url + "/openapi.json").json()
    for route, name, body in cases:
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
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}),
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
    if route == "/v1/responses":  # typed events, the last one the response's end; no [DONE]
        assert events and any(f'"response.{end}"' in events[-1]["data"] for end in ("completed", "incomplete"))
    else:
        assert events and events[-1] == {"data": "[DONE]"}
    for ev in events:
        jsonschema.validate(ev, event_schema)
