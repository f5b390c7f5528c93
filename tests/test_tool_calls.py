"""Tool calling: `tools` with tool_choice none / auto / required / a named function.

`required` and a named function are constrained by the functions' parameter schemas, so even a
tiny random model sampling at temperature 1 answers with calls whose arguments validate.
`auto` reads the model's own format (`--tool-call-parser hermes`): the parsers are checked on
canned strings, and end to end on an answer forced to be a Hermes call by a one-choice
constraint.  The server's chat template prints the tools, so the prompt's length shows
whether the template received them.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from server_fixtures import ThreadedServer  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.entrypoints.openai.tool_calls import MAX_PARALLEL_CALLS  # noqa: E402
from tokenloom.entrypoints.openai.tool_parsers import (HermesParser, Llama3JsonParser,  # noqa: E402
                                                       parser_for_template)

jsonschema = pytest.importorskip("jsonschema")

NAME = "tiny"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
# A template that prints the tools it is given (as a tool-trained model's template does).
TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% for tc in m.get('tool_calls') or [] %}call {{ tc.function.name }} {{ tc.function.arguments | tojson }}"
            "{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "template.jinja"
    template.write_text(TEMPLATE)
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "1024",
                        "--num-kv-blocks", "256", "--max-num-seqs", "16", "--seed", "0",
                        "--chat-template", str(template), "--tool-call-parser", "hermes",
                        "--served-model-name", NAME, "--log-level", "warning", "--disable-access-log"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_arguments_validate(client):
    r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=1, n=4,
                                       max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls"
        assert ch.message.content is None
        assert len(ch.message.tool_calls) == 1 and ch.message.tool_calls[0].function.name == "get_weather"
        _check_call(ch.message.tool_calls[0])


def test_required_chooses_functions_with_valid_arguments(client):
    names = set()
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=200, tool_choice="required", parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        _check_call(ch.message.tool_calls[0])
        names.add(ch.message.tool_calls[0].function.name)
    assert names <= set(SCHEMAS)


def test_required_streamed_as_tool_call_deltas(client):
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        stream = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=5,
                                                max_tokens=200, tool_choice=choice, parallel_tool_calls=False,
                                                stream=True)
        content, calls, reasons = "", [], []
        for chunk in stream:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                calls += ch.delta.tool_calls or []
                reasons.append(ch.finish_reason)
        assert reasons[-1] == "tool_calls" and content == ""
        assert len(calls) == 1 and calls[0].index == 0
        _check_call(calls[0])
        if isinstance(choice, dict):
            assert calls[0].function.name == "add"


def test_template_receives_tools_and_none_leaves_them_out(client):
    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, **kw).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS, tool_choice="auto") > plain
    r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=5,
                                       temperature=1.0, seed=3)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_history_with_tool_calls_and_results(client):
    # OpenAI sends an earlier call's arguments as JSON text; the template gets the object, so
    # `tojson` prints it once, not as an escaped string.
    def prompt_tokens(arguments) -> int:
        history = CHAT + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
        r = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=1)
        return r.usage.prompt_tokens

    args = {"city": "Paris", "unit": "c"}
    assert prompt_tokens(json.dumps(args)) == prompt_tokens(args)


FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def test_auto_parses_hermes_calls_end_to_end(client):
    # The answer is forced (a one-choice constraint) to be what a Hermes-style model writes.
    r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=100,
                                       extra_body={"structured_outputs": {"choice": ["Sure. " + FORCED]}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure. "
    assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    stream = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, max_tokens=100, stream=True,
                                            extra_body={"structured_outputs": {"choice": ["Sure. " + FORCED]}})
    content, calls, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert content == "Sure. " and reasons[-1] == "tool_calls"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    # Plain text with tools offered stays text.
    r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_auto_parses_llama3_json_calls_end_to_end(tiny_llama, tmp_path):
    import openai

    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "512",
                        "--num-kv-blocks", "64", "--max-num-seqs", "4", "--seed", "0",
                        "--chat-template", str(template), "--tool-call-parser", "llama3_json",
                        "--served-model-name", NAME, "--log-level", "warning", "--disable-access-log"]).start()
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        forced = '{"name": "add", "parameters": {"a": 2, "b": 40}}'
        r = c.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, max_tokens=100,
                                      extra_body={"structured_outputs": {"choice": [forced]}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert ch.message.tool_calls[0].function.name == "add"
        assert json.loads(ch.message.tool_calls[0].function.arguments) == {"a": 2, "b": 40}
    finally:
        s.stop()


def test_hermes_parser_on_strings():
    p = HermesParser()
    content, calls = p.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                             ["add", "get_weather"])
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert p.parse("no call here", ["add"]) == ("no call here", [])
    assert p.parse("<tool_call>{not json}</tool_call>", ["add"])[1] == []
    assert p.parse('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', ["add"])[1] == []
    assert p.safe_prefix("Hello <tool_") == len("Hello ")
    assert p.safe_prefix("Hello <b>") == len("Hello <b>")
    assert p.safe_prefix("Hi <tool_call>{") == len("Hi ")


def test_llama3_json_parser_on_strings():
    p = Llama3JsonParser()
    content, calls = p.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', ["add"])
    assert content is None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    _, calls = p.parse('<|python_tag|>{"name": "add", "parameters": {}}; {"name": "add", "parameters": {"a": 3}}',
                       ["add"])
    assert [json.loads(c.arguments) for c in calls] == [{}, {"a": 3}]
    assert p.parse("The answer is 3.", ["add"]) == ("The answer is 3.", [])
    assert p.parse('{"x": 1}', ["add"])[1] == []
    assert p.safe_prefix('{"na') == 0 and p.safe_prefix("Hello") == 5


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_invalid_tools_are_a_400_naming_the_field(client, kw, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=5, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    # The server carries on.
    r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, seed=0)
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_without_a_parser_answers_in_text():
    from tokenloom.entrypoints.openai.tool_calls import plan_tools

    # No parser for this model: "auto" (explicit or LangChain's default, no tool_choice) is
    # text, with the tools left out of the prompt as for "none" -- not a 400.
    for choice in ("auto", None):
        plan = plan_tools(TOOLS, choice, None)
        assert plan.mode == "none" and plan.template_tools is None and plan.constraint is None
    assert plan_tools(TOOLS, "none", None).template_tools is None
    assert plan_tools(TOOLS, None, "hermes").mode == "auto"


def test_parser_for_template_families():
    qwen = ("{%- if tools %}# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>{% endif %}")
    llama31 = ("{%- if tools %}<|start_header_id|>user<|end_header_id|>Respond in the format "
               "{\"name\": function name, \"parameters\": dictionary of argument name and its value}."
               "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}<|python_tag|>")
    assert parser_for_template(qwen) == "hermes"
    assert parser_for_template(llama31) == "llama3_json"
    assert parser_for_template(TEMPLATE) is None  # prints tools, but asks for no known format
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


def test_required_with_parallel_calls_allowed_ends_with_calls(client, tiny_llama):
    from transformers import AutoTokenizer

    # A random-weight model at temperature 1 closes the array when it happens to: 1..N calls.
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=400, tool_choice="required")
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (seed, ch.message.content)
        assert ch.message.content is None and 1 <= len(ch.message.tool_calls) <= MAX_PARALLEL_CALLS
        for call in ch.message.tool_calls:
            _check_call(call)
    # A model that never closes it of its own accord (every token holding "]" pushed down by
    # logit_bias): the bound closes it, so the answer is MAX_PARALLEL_CALLS calls, not a run of
    # calls to max_tokens and no answer.
    vocab = AutoTokenizer.from_pretrained(str(tiny_llama)).get_vocab()
    never_close = {str(i): -100 for tok, i in vocab.items() if "]" in tok}
    for parallel, want in ((None, MAX_PARALLEL_CALLS), (False, 1)):
        r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=7,
                                           max_tokens=700, tool_choice="required", logit_bias=never_close,
                                           **({} if parallel is None else {"parallel_tool_calls": parallel}))
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == want, ch
        for call in ch.message.tool_calls:
            _check_call(call)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_off_by_max_tokens_is_an_error_not_an_empty_answer(client, choice):
    import openai

    # Too few tokens for any call to finish: OpenAI's "could not finish the message" 400, naming
    # the limit the client sent -- never a 200 whose tool_calls are missing.
    for limit in ({"max_tokens": 4}, {"max_completion_tokens": 4}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=2,
                                           tool_choice=choice, **limit)
        err = e.value.body
        assert err["param"] == next(iter(limit)) and err["code"] == "length_limit_reached", err
        assert "Could not finish the message because max_tokens" in err["message"]
    # Streamed, the same error arrives as an error event (the status is 200 by then).
    stream = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=2,
                                            tool_choice=choice, max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="Could not finish the message"):
        for _ in stream:
            pass


def test_required_cut_after_a_finished_call_returns_the_finished_calls(client):
    # Room for one call but not for the next: the finished calls are the answer, with
    # finish_reason "length" (the array itself was cut), each call well formed.
    seen_length = False
    for seed in range(8):
        probe = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed,
                                               max_tokens=400, tool_choice="required")
        if len(probe.choices[0].message.tool_calls) < 2:
            continue
        full = probe.usage.completion_tokens
        r = client.chat.completions.create(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=full - 8, tool_choice="required")
        ch = r.choices[0]
        assert ch.finish_reason == "length" and ch.message.content is None
        assert 1 <= len(ch.message.tool_calls) <= len(probe.choices[0].message.tool_calls)
        for got, want in zip(ch.message.tool_calls, probe.choices[0].message.tool_calls):
            _check_call(got)
            assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
        seen_length = True
        break
    assert seen_length, "no seed wrote two calls"


def test_streamed_tool_calls_carry_no_empty_content(server):
    import httpx
    from server_fixtures import sse_events

    # OpenAI's deltas for a tool call: the role first (content null), then the call; never a
    # run of `"content": ""` chunks while the call is being written.
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        body = {"model": NAME, "messages": CHAT, "tools": TOOLS, "tool_choice": choice, "temperature": 1.0,
                "seed": 5, "max_tokens": 200, "parallel_tool_calls": False, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            events = sse_events(r.iter_lines())
        choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
        deltas = [ch["delta"] for ch in choices]
        assert deltas[0] == {"role": "assistant", "content": None}, deltas[0]
        assert all(d.get("content") is None for d in deltas), deltas
        # the role, the call (whole), and the finish -- which may come with the call
        assert sum("tool_calls" in d for d in deltas) == 1 and len(deltas) <= 3, deltas
        assert choices[-1]["finish_reason"] == "tool_calls"


def test_streamed_parallel_calls_go_out_one_by_one_as_each_completes(client, tiny_llama):
    from transformers import AutoTokenizer

    # Eight calls (the array is made to run to its bound): each is sent whole, with its index,
    # as soon as it is complete -- not all at the end -- and they are the non-streamed answer's.
    vocab = AutoTokenizer.from_pretrained(str(tiny_llama)).get_vocab()
    kw = dict(model=NAME, messages=CHAT, tools=TOOLS, temperature=1.0, seed=11, max_tokens=700,
              tool_choice="required", logit_bias={str(i): -100 for tok, i in vocab.items() if "]" in tok})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = [ch for chunk in client.chat.completions.create(**kw, stream=True) for ch in chunk.choices]
    carrying = [ch.delta.tool_calls for ch in chunks if ch.delta.tool_calls]
    calls = [tc for group in carrying for tc in group]
    assert len(carrying) > 1 and chunks[-1].finish_reason == "tool_calls"
    assert [tc.index for tc in calls] == list(range(MAX_PARALLEL_CALLS)) == list(range(len(whole)))
    for got, want in zip(calls, whole):
        _check_call(got)
        assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
