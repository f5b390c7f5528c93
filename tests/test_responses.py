"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) through the official
`openai` client -- `responses.create`, `.stream`, `.parse`, `.retrieve`, `.delete` unchanged --
against a real uvicorn server on 127.0.0.1.

The model is the hand-wired copy model (tests/copy_chat_model.py): it answers a conversation
with its last assistant turn again, so each test chooses the answer (plain text, a Hermes
tool call, JSON) and checks what the API makes of it.  Since /v1/responses is the chat path
underneath, every answer is also checked against /v1/chat/completions on the same messages:
the same prompt tokens, the same text.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from copy_chat_model import ask, make_copy_chat_model  # noqa: E402
from server_fixtures import ThreadedServer, sse_events, wait_until  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.entrypoints.openai.responses_store import ResponseStore  # noqa: E402

NAME = "copy"
ANSWER = "Hello there, friend."
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD},
         {"type": "function", "name": "shout", "parameters": {"type": "object", "properties": {}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
MAX_STORED = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_copy_chat_model(tmp_path_factory.mktemp("copy_chat"))
    s = ThreadedServer([str(model), "--port", str(free_port()), "--max-model-len", "512", "--num-kv-blocks", "128",
                        "--max-num-seqs", "8", "--tool-call-parser", "hermes", "--served-model-name", NAME,
                        "--max-stored-responses", str(MAX_STORED), "--log-level", "warning",
                        "--disable-access-log"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def test_text_and_messages_answer_as_chat_does(client):
    r = client.responses.create(model=NAME, input=ask(ANSWER), temperature=0)
    chat = _chat(client, ask(ANSWER))
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content == ANSWER
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    # A plain string is one user message; `instructions` a system message before the input.
    r = client.responses.create(model=NAME, input="What is up?", instructions="Be brief.", max_output_tokens=5)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is up?"}],
                 max_tokens=5)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Be brief."
    assert r.max_output_tokens == 5 and r.usage.output_tokens <= 5


def test_items_with_parts_and_developer_role(client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Say "},
                                          {"type": "input_text", "text": "it."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER,
                                                                    "annotations": []}]},
             {"role": "user", "content": "Again, please."}]
    r = client.responses.create(model=NAME, input=items, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Rules."}, *ask(ANSWER)])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content == ANSWER


def test_stream_sends_the_typed_events_the_client_reads(client, server):
    with client.responses.stream(model=NAME, input=ask(ANSWER), temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == ANSWER == final.output_text
    assert events[0].response.id == final.id and final.status == "completed"
    assert final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == _chat(client, ask(ANSWER)).usage.completion_tokens
    # On the wire: each event named in its `event:` line, and no chat-style [DONE].
    body = {"model": NAME, "input": ask(ANSWER), "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
        lines = list(r.iter_lines())
    named = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = sse_events(lines)
    assert "[DONE]" not in data and named == [d["type"] for d in data]


def test_function_tools_round_trip(client):
    # The model writes a Hermes call (--tool-call-parser hermes): a function_call item.
    r = client.responses.create(model=NAME, input=ask(CALL), tools=TOOLS, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    assert json.loads(call.arguments) == {"a": 17, "b": 25} and call.call_id.startswith("call_")
    assert r.tools[0].name == "add" and r.tool_choice == "auto"
    # The result goes back as a function_call_output item after the call: the prompt is the
    # chat conversation with the assistant's tool call and the tool's message.
    turn2 = [*ask(CALL), {"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    r2 = client.responses.create(model=NAME, input=turn2, tools=TOOLS, temperature=0, max_output_tokens=8)
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                  for t in TOOLS]
    chat = _chat(client, [*ask(CALL), {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "42"}], tools=chat_tools, max_tokens=8)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    # ... and the same turn by previous_response_id: the stored conversation plus the output.
    r3 = client.responses.create(model=NAME, previous_response_id=r.id, tools=TOOLS, temperature=0,
                                 max_output_tokens=8,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.previous_response_id == r.id


def test_forced_calls_required_and_named(client):
    for choice, names in (("required", {"add", "shout"}), ({"type": "function", "name": "add"}, {"add"})):
        for _ in range(2):  # sampled: whatever the model picks, the grammar makes it a call
            r = client.responses.create(model=NAME, input=ask(ANSWER), tools=TOOLS, tool_choice=choice,
                                        temperature=1.0, parallel_tool_calls=False)
            assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
            assert r.output[0].name in names
            if r.output[0].name == "add":
                jsonschema.validate(json.loads(r.output[0].arguments), ADD)
    # Streamed: the call arrives whole as an item with its arguments' delta and done events.
    with client.responses.stream(model=NAME, input=ask(ANSWER), tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "add"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and args[0].arguments == final.output[0].arguments
    jsonschema.validate(json.loads(args[0].arguments), ADD)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.call_id == final.output[0].call_id and final.output[0].name == "add"


def test_text_format_json_schema_and_parse(client):
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    # The model would copy Oslo; the schema allows only Paris or Rome, so the grammar decides.
    r = client.responses.create(model=NAME, input=ask('{"city": "Oslo"}'), temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    doc = json.loads(r.output_text)
    jsonschema.validate(doc, schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    # The client's own parse(text_format=...) sends the schema and reads the answer back.
    parsed = client.responses.parse(model=NAME, input=ask('{"city": "Oslo"}'), text_format=City, temperature=0)
    assert parsed.output_parsed == City(city="Oslo")
    r = client.responses.create(model=NAME, input=ask('{"ok": true}'), text={"format": {"type": "json_object"}},
                                temperature=0)
    assert json.loads(r.output_text) == {"ok": True} and r.text.format.type == "json_object"


def test_previous_response_id_store_retrieve_delete(client):
    import openai

    r1 = client.responses.create(model=NAME, input=ask(ANSWER), temperature=0, metadata={"case": "prev"})
    r2 = client.responses.create(model=NAME, input="Again, please.", previous_response_id=r1.id, temperature=0)
    chat = _chat(client, [*ask(ANSWER), {"role": "assistant", "content": ANSWER},
                          {"role": "user", "content": "Again, please."}])
    assert r2.usage.input_tokens == chat.usage.prompt_tokens and r2.output_text == ANSWER
    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == ANSWER and got.metadata == {"case": "prev"}
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="hi", previous_response_id=r1.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    # store=false: answered, not kept.
    r3 = client.responses.create(model=NAME, input=ask(ANSWER), store=False, max_output_tokens=4)
    assert r3.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_memory_is_bounded_by_count(client, server):
    first = client.responses.create(model=NAME, input="one", max_output_tokens=1)
    later = [client.responses.create(model=NAME, input=str(i), max_output_tokens=1) for i in range(MAX_STORED)]
    store = server.server.config.app.state.responses.store
    assert len(store) == MAX_STORED
    import openai

    with pytest.raises(openai.BadRequestError):  # the least recently used was dropped
        client.responses.create(model=NAME, input="hi", previous_response_id=first.id, max_output_tokens=1)
    assert client.responses.retrieve(later[-1].id).id == later[-1].id


def test_store_bounds_count_and_bytes():
    from tokenloom.entrypoints.openai.responses_protocol import ResponseObject

    def resp(i: int) -> ResponseObject:
        return ResponseObject(id=f"resp_{i}", status="completed", model="m")

    store = ResponseStore(max_count=3)
    for i in range(5):
        store.put(resp(i), [{"role": "user", "content": "x"}])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.get("resp_2")  # now the most recently used: resp_3 goes next
    store.put(resp(5), [])
    assert store.get("resp_3") is None and store.get("resp_2") is not None
    small = ResponseStore(max_count=100, max_bytes=2000)
    for i in range(10):
        small.put(resp(i), [{"role": "user", "content": "y" * 300}])
    assert 0 < len(small) < 10 and small.bytes <= 2000
    assert not small.put(resp(99), [{"role": "user", "content": "z" * 5000}])  # alone over the bound
    assert not ResponseStore(max_count=0).put(resp(1), [])
    with pytest.raises(ValueError, match="--max-stored-responses"):
        ResponseStore(max_count=-1)


def test_cut_off_answer_is_incomplete(client):
    r = client.responses.create(model=NAME, input=ask(ANSWER), temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and ANSWER.startswith(r.output_text) and r.output_text != ANSWER
    body = {"model": NAME, "input": ask(ANSWER), "stream": True, "temperature": 0, "max_output_tokens": 3}
    events = _stream_raw(client, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def _stream_raw(client, body: dict) -> list[dict]:
    with httpx.stream("POST", str(client.base_url).rstrip("/") + "/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def test_forced_call_cut_off_is_an_error_naming_max_output_tokens(client):
    import openai

    kw = dict(model=NAME, input=ask(ANSWER), tools=TOOLS, tool_choice={"type": "function", "name": "add"},
              max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert e.value.body["param"] == "max_output_tokens" and e.value.body["code"] == "length_limit_reached"
    assert "max_output_tokens" in e.value.body["message"] and "max_completion_tokens" not in e.value.body["message"]
    events = _stream_raw(client, {**kw, "stream": True})
    assert [ev["type"] for ev in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["param"] == "max_output_tokens" and events[-1]["response"]["status"] == "failed"


BAD = [
    ({"background": True}, "background"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x" * 20000}, "input"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_every_bad_field_is_a_400_naming_it(server, extra, param):
    body = {"model": NAME, "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400, err
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert err["type"] == "invalid_request_error" and err["message"]
    if "not supported" in err["message"] or "does not support" in err["message"]:
        assert err["code"] == "unsupported_value", err


def test_unknown_model_and_ids_are_404s(server, client):
    r = httpx.post(server.base_url + "/v1/responses", json={"model": "nope", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.base_url + "/v1/responses/resp_missing", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert wait_until(lambda: server.engine.snapshot().num_running == 0, 30)


def test_openapi_document_describes_the_routes(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    post = doc["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    ok = post["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ResponseObject") and "text/event-stream" in ok
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "tools", "tool_choice", "text", "previous_response_id", "store",
            "stream", "max_output_tokens"} <= set(props)
    assert props["background"]["anyOf"] == [{"const": False, "type": "boolean"}, {"type": "null"}]
