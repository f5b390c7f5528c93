"""What real clients see: the official `openai` client, `langchain-openai` and `litellm`
against a running server, over HTTP, each doing what its users do on a first day.

- LangChain's `bind_tools(tool_choice="any")` sends tool_choice "required" and reads
  `AIMessage.tool_calls`: it must hold a call, even from a model that would write calls until
  max_tokens; its default `bind_tools` sends tools without tool_choice ("auto"), which must
  answer rather than 400 on a server started without `--tool-call-parser`.
- LiteLLM turns a too-long prompt into `ContextWindowExceededError` (what drives its
  `context_window_fallbacks`) only when the message has OpenAI's wording.
- LiteLLM's model string is `openai/<id>`: the id must not be a filesystem path.
- A structured-output failure names the field the client sent it in.
- `/tokenizer_info` says whether BOS is added as `/tokenize` adds it.

The server runs a tiny random-weight model (a weak model at temperature 1 is exactly the kind
that never closes an array of calls) whose tokenizer adds BOS, started without
`--served-model-name` and without `--tool-call-parser`, as a newcomer starts it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import httpx
import pytest

pytest.importorskip("xgrammar")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches its cost map at import otherwise

from server_fixtures import ThreadedServer  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.entrypoints.openai.tool_calls import MAX_PARALLEL_CALLS  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

MAX_LEN = 512
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": WEATHER}}
QUESTION = "What is the weather in Paris?"
# A Hermes-family template (as Qwen2.5's): it shows the tools and asks for <tool_call> tags.
HERMES_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
                   "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
                   "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def model_dir(tiny_llama, tmp_path_factory):
    """tiny-llama whose tokenizer adds BOS the way Llama checkpoints' tokenizer.json does (a
    post-processor), which transformers does not report in `add_bos_token`."""
    out = tmp_path_factory.mktemp("clients") / "tiny-chat"
    shutil.copytree(tiny_llama, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}},
                                      {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [1], "tokens": ["<|bos|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    s = ThreadedServer([str(model_dir), "--port", str(free_port()), "--max-model-len", str(MAX_LEN),
                        "--num-kv-blocks", "128", "--max-num-seqs", "8", "--seed", "0",
                        "--trust-request-chat-template", "--log-level", "warning", "--disable-access-log"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def never_close(model_dir) -> dict[str, int]:
    """A logit_bias that pushes down every token holding "]": the model then never ends an
    array of calls of its own accord (the weak model of the issue, made certain)."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model_dir)).get_vocab()
    return {str(i): -100 for tok, i in vocab.items() if "]" in tok}


def test_served_model_id_is_the_directory_name(client, model_dir):
    # Not the path (LiteLLM users would write "openai//tmp/..."); the path stays accepted.
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    for name in ("tiny-chat", str(model_dir)):
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"


def test_tokenizer_info_says_what_tokenize_does(server):
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert ids[0] == 1  # <|bos|>, added by the tokenizer's post-processor
    assert info["bos_token"] == "<|bos|>" and info["add_bos_token"] is True, info
    assert info["add_eos_token"] is False


def test_litellm_maps_a_too_long_prompt_to_its_context_window_error(server):
    import litellm

    kw = dict(model="openai/tiny-chat", api_base=server.base_url + "/v1", api_key="unused", num_retries=0)
    r = litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(litellm.ContextWindowExceededError):  # the messages alone
        litellm.completion(messages=[{"role": "user", "content": "hello " * (2 * MAX_LEN)}], max_tokens=5, **kw)
    with pytest.raises(litellm.ContextWindowExceededError):  # messages + max_tokens
        litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_LEN, **kw)


def test_context_length_error_in_openai_words(server):
    url = server.base_url + "/v1"
    r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 600})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                                     f"requested ") and "in the messages, 600 in the completion" in err["message"]
    r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_completion_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"  # as the client spelled it
    r = httpx.post(url + "/completions", json={"prompt": "hello " * 600, "max_tokens": 5})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens.")
    assert "prompt" in err["message"]


def _langchain(server, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny-chat", base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120, **kw)


def test_langchain_tool_choice_any_always_gets_a_call(server, never_close):
    # tool_choice="any" is "required": the answer holds calls, even from a model that would
    # write calls until max_tokens (it is bounded), and each call's arguments validate.
    llm = _langchain(server, temperature=1.0, max_tokens=400, seed=3, logit_bias=never_close)
    msg = llm.bind_tools([TOOL], tool_choice="any").invoke(QUESTION)
    assert 1 <= len(msg.tool_calls) <= MAX_PARALLEL_CALLS, msg
    for call in msg.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER)
    one = llm.bind_tools([TOOL], tool_choice="any", parallel_tool_calls=False).invoke(QUESTION)
    assert len(one.tool_calls) == 1 and one.tool_calls[0]["name"] == "get_weather"
    # Streamed: the chunks add up to the same kind of answer.
    chunks = list(llm.bind_tools([TOOL], tool_choice="any", parallel_tool_calls=False).stream(QUESTION))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert len(total.tool_calls) == 1 and total.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(total.tool_calls[0]["args"], WEATHER)


def test_langchain_default_bind_tools_answers(server):
    # No tool_choice (so "auto"), no --tool-call-parser, a template of no tool-call family:
    # the model answers in text -- not a 400.
    msg = _langchain(server, temperature=1.0, max_tokens=8, seed=1).bind_tools([TOOL]).invoke(QUESTION)
    assert isinstance(msg.content, str) and msg.tool_calls == []


def test_auto_uses_the_parser_of_the_template_family(client):
    # A Hermes-family template without --tool-call-parser: "auto" reads <tool_call> blocks.
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    r = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": QUESTION}],
                                       tools=[TOOL], max_tokens=100,
                                       extra_body={"chat_template": HERMES_TEMPLATE,
                                                   "structured_outputs": {"choice": [forced]}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}


def test_openai_streamed_tool_call_deltas_have_no_content(client):
    stream = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": QUESTION}],
                                            tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                                            temperature=1.0, seed=4, max_tokens=200, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert all(d.content is None for d in deltas), [d.content for d in deltas]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"rf": {"type": "integer"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"gj": {"type": "integer"}}}}, "guided_json"),
    ({"guided_choice": ["only-here-a", "only-here-b"]}, "guided_choice"),
    ({"guided_regex": "[0-9]{3}-only-here"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[a-z]{2}-only-here"}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "only_here", "parameters": WEATHER}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_structured_output_failure_names_the_field_sent(server, monkeypatch, body, param):
    # Without xgrammar (an environment that lacks it), each way of asking for structure is
    # refused naming the field it was asked in -- not "structured_outputs" for all of them.
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert err["message"].startswith(param) and "xgrammar" in err["message"], err
