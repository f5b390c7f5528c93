"""Reasoning output (`--reasoning-parser qwen3|deepseek_r1`): the thinking apart from the answer.

- The parsers on strings: the split of a whole text, and while streaming, that every prefix
  splits into prefixes of the final parts (so deltas only ever append), a tag cut anywhere.
- The grammar gate (structured/reasoning_gate.py) on a real xgrammar grammar: no mask while the
  model thinks, the grammar's own mask after `</think>`.
- End to end, a real server with the copy model (tests/copy_chat_model.py), whose answers the
  test chooses: `reasoning_content` and `content` in messages and in stream deltas (reasoning
  first); a JSON schema and a forced tool call constrain the answer and not the thinking (the
  model copies thinking the schema would forbid, and an answer it must not give); a tool call
  written while thinking is no tool call; the Responses API's reasoning item and token count.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")

from copy_chat_model import ask, make_copy_chat_model  # noqa: E402
from server_fixtures import ThreadedServer, sse_events  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser  # noqa: E402
from tokenloom.sampling_params import ReasoningTags, StructuredOutputsParams  # noqa: E402

NAME = "thinker"
THINK, UNTHINK = 4096, 4097  # the copy model's added tags (after the bundled 4096-token vocabulary)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
THOUGHT = "<think>The user wants a city. I will say Oslo.</think>\n\n"
OSLO = '{"city": "Oslo"}'


def _parser(name: str) -> ReasoningParser:
    return ReasoningParser(name, ReasoningTags(THINK, UNTHINK, implicit_start=name == "deepseek_r1"))


@pytest.mark.parametrize("text, inside, want", [
    ("<think>plan</think>\n\nanswer", None, ("plan", "answer")),
    ("answer only", None, (None, "answer only")),
    ("<think>cut off", None, ("cut off", None)),
    ("plan</think>answer", True, ("plan", "answer")),  # the template opened it
    ("<think>plan</think>answer", True, ("plan", "answer")),  # ... and the model wrote it again
    ("answer</think>", False, (None, "answer</think>")),  # the template closed it: all answer
    ("<think></think>\n\n", None, ("", "")),
])
def test_split_whole_texts(text, inside, want):
    assert _parser("qwen3").split(text, inside) == want


def test_deepseek_starts_inside_without_the_tag():
    p = _parser("deepseek_r1")
    inside = p.starts_inside([5, 6, 7])
    assert inside is True
    assert p.split("plan</think>\n\nanswer", inside) == ("plan", "answer")
    assert p.split("still thinking", inside) == ("still thinking", None)
    assert p.reasoning_tokens([9, 9, UNTHINK, 8], inside) == 3 and p.reasoning_tokens([9, 9], inside) == 2


def test_prompt_tail_decides_where_the_output_starts():
    tags = ReasoningTags(THINK, UNTHINK)
    assert tags.starts_inside([1, 2, 3]) is None
    assert tags.starts_inside([1, 2, THINK, 10]) is True  # "<think>\n" ends the prompt
    assert tags.starts_inside([1, THINK, 10, UNTHINK, 10, 10]) is False  # thinking switched off
    # tags earlier in the conversation are not this turn's
    assert tags.starts_inside([THINK, 5, UNTHINK, 6, 7, 8, 9, 10]) is None
    assert ReasoningTags(THINK, UNTHINK, implicit_start=True).starts_inside([THINK, 5, UNTHINK, 1, 2, 3, 4]) is True


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>a < b, so </thin k</think>\n\nok <think>", "x</think>y", "<thi", "<think>",
                                  "plain <b>", "</think>", "<think>\n</think>\n\n\nz"])
def test_stream_prefixes_only_ever_grow(name, text):
    p = _parser(name)
    for inside in (None, True, False) if name == "qwen3" else (True,):
        final_r, final_c = p.split(text, inside)
        sent_r = sent_c = ""
        for k in range(len(text) + 1):
            r, c = p.split(text[:k], inside, final=False)
            r, c = r or "", c or ""
            assert r.startswith(sent_r) and c.startswith(sent_c), (text[:k], inside)
            assert (final_r or "").startswith(r) and (final_c or "").startswith(c), (text[:k], inside)
            sent_r, sent_c = r, c


def test_tokenizer_without_the_tags_is_refused_at_start(tmp_path):
    from transformers import AutoTokenizer

    from tokenloom.bundled import BUNDLED_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    with pytest.raises(ValueError, match="--reasoning-parser.*'<think>'"):
        get_reasoning_parser("qwen3", tok)
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser"):
        get_reasoning_parser("gpt_oss", tok)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    with pytest.raises(ValueError, match="special token"):
        get_reasoning_parser("qwen3", tok)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_copy_chat_model(tmp_path_factory.mktemp("thinker"))


def test_gate_masks_nothing_while_thinking(model):
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tokenloom.structured import GrammarCompiler, ReasoningGate

    tok = AutoTokenizer.from_pretrained(model)
    compiler = GrammarCompiler(tok, len(tok), [2, 4])
    spec = StructuredOutputsParams(json=CITY)

    def mask(state) -> torch.Tensor:
        bits = xgr.allocate_token_bitmask(1, len(tok))
        state.fill_mask(bits, 0)
        return bits[0].clone()

    plain = mask(compiler.new_state(spec))
    all_ones = xgr.allocate_token_bitmask(1, len(tok))[0]
    gate = ReasoningGate(compiler.new_state(spec), ReasoningTags(THINK, UNTHINK), prompt_token_ids=[1, 2])
    assert gate.phase == "undecided"
    opening = mask(gate)  # the grammar's first tokens, and "<think>"
    assert not (plain[THINK // 32] >> (THINK % 32)) & 1 and (opening[THINK // 32] >> (THINK % 32)) & 1
    opening[THINK // 32] &= ~(1 << (THINK % 32))
    assert torch.equal(opening, plain)
    assert gate.accept(THINK) and gate.phase == "reasoning"
    for t in tok.encode("Anything goes here, even } and ] ", add_special_tokens=False):
        assert torch.equal(mask(gate), all_ones) and gate.accept(t)
    assert gate.accept(UNTHINK) and gate.phase == "answer" and not gate.terminated
    assert torch.equal(mask(gate), plain)  # from here on, the grammar
    for t in tok.encode('{"city": "Rome"}', add_special_tokens=False):
        assert gate.accept(t)
    assert gate.accept(4) and gate.terminated
    # No "<think>" first: the answer starts at once, and the grammar takes its first token.
    direct = ReasoningGate(compiler.new_state(spec), ReasoningTags(THINK, UNTHINK), prompt_token_ids=[1])
    assert not direct.accept(tok.encode("x", add_special_tokens=False)[0]) and direct.phase == "answer"


@pytest.fixture(scope="module")
def server(model):
    s = ThreadedServer([str(model), "--port", str(free_port()), "--max-model-len", "512", "--num-kv-blocks", "128",
                        "--max-num-seqs", "8", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                        "--trust-request-chat-template", "--served-model-name", NAME, "--log-level", "warning",
                        "--disable-access-log"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, answer: str, **kw):
    return client.chat.completions.create(model=NAME, messages=ask(answer), temperature=0, **kw)


def _stream(client, answer: str, **kw) -> tuple[list[dict], str | None]:
    deltas, reason = [], None
    for chunk in client.chat.completions.create(model=NAME, messages=ask(answer), temperature=0, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta.model_dump(exclude_none=True)
            d.pop("role", None)
            if d:
                deltas.append(d)
            reason = ch.finish_reason or reason
    return deltas, reason


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_chat_message_and_deltas_carry_reasoning_content(client):
    m = _chat(client, "<think>Plan: greet back.</think>\n\nHello, friend!").choices[0].message
    assert (m.reasoning_content, m.content) == ("Plan: greet back.", "Hello, friend!")
    deltas, reason = _stream(client, "<think>Plan: greet back.</think>\n\nHello, friend!")
    assert reason == "stop"
    assert _joined(deltas, "reasoning_content") == "Plan: greet back."
    assert _joined(deltas, "content") == "Hello, friend!"
    kinds = ["r" if d.get("reasoning_content") else "c" for d in deltas
             if d.get("reasoning_content") or d.get("content")]
    assert kinds == sorted(kinds, reverse=True) and len(kinds) > 2  # every reasoning delta before any content
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    # No thinking (qwen3: only a leading <think> opens it): all content.
    m = _chat(client, "Straight to the answer.").choices[0].message
    assert (m.reasoning_content, m.content) == (None, "Straight to the answer.")


def test_schema_constrains_the_answer_not_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    m = _chat(client, THOUGHT + OSLO, response_format=fmt).choices[0].message
    # The thinking is copied as it was ("Oslo" and all: no schema there); the answer is held
    # to the schema, which has no Oslo.
    assert m.reasoning_content == "The user wants a city. I will say Oslo."
    assert json.loads(m.content)["city"] in ("Paris", "Rome")
    deltas, _ = _stream(client, THOUGHT + OSLO, response_format=fmt)
    assert _joined(deltas, "reasoning_content") == m.reasoning_content and _joined(deltas, "content") == m.content
    # Where the answer is allowed, it is the model's own.
    m = _chat(client, THOUGHT + '{"city": "Rome"}', response_format=fmt).choices[0].message
    assert json.loads(m.content) == {"city": "Rome"}


def test_tool_calls_are_read_from_the_answer_only(client):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    # A call written while thinking is thought, not called.
    m = _chat(client, f"<think>Maybe {call}? No.</think>\n\nJust text.", tools=TOOLS).choices[0]
    assert m.message.tool_calls is None and m.finish_reason == "stop"
    assert call in m.message.reasoning_content and m.message.content == "Just text."
    # A call in the answer is a call, and the thinking stays apart.
    m = _chat(client, f"<think>I should add.</think>\n\n{call}", tools=TOOLS).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.reasoning_content == "I should add."
    assert json.loads(m.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    deltas, reason = _stream(client, f"<think>I should add.</think>\n\n{call}", tools=TOOLS)
    assert reason == "tool_calls" and _joined(deltas, "reasoning_content") == "I should add."
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])] == ["add"]
    # A forced call is constrained after the thinking only: the thinking (which the
    # arguments' grammar would never allow) is copied whole, then the arguments.
    m = _chat(client, '<think>Numbers, so add.</think>\n\n{"a": 2, "b": 3}', tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert m.message.reasoning_content == "Numbers, so add." and m.finish_reason == "tool_calls"
    args = json.loads(m.message.tool_calls[0].function.arguments)
    assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())


def test_template_that_opens_the_thinking(client):
    # Qwen3-Thinking-style: the prompt ends with "<think>\n", so the output starts inside.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    answer = "\nThinking already.</think>\n\nDone."
    m = client.chat.completions.create(model=NAME, temperature=0, extra_body={"chat_template": template},
                                       messages=[{"role": "user", "content": "Go."}, {"role": "assistant",
                                                                                       "content": answer},
                                                 {"role": "user", "content": "Again."}]).choices[0].message
    assert m.reasoning_content.strip() == "Thinking already." and m.content == "Done."


def test_cut_off_while_thinking_has_no_content(client):
    c = _chat(client, "<think>A long, long line of thought.</think>\n\nLate.", max_tokens=4).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and c.message.reasoning_content


def test_responses_reasoning_item(client, server):
    r = client.responses.create(model=NAME, input=ask("<think>Plan: greet back.</think>\n\nHello, friend!"),
                                temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Plan: greet back." and r.output_text == "Hello, friend!"
    chat = _chat(client, "<think>Plan: greet back.</think>\n\nHello, friend!")
    details = r.usage.output_tokens_details
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert 0 < details.reasoning_tokens < r.usage.output_tokens
    body = {"model": NAME, "input": ask("<think>Plan: greet back.</think>\n\nHello, friend!"), "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as resp:
        events = sse_events(resp.iter_lines())
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Plan: greet back."
    done = events[-1]["response"]
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["id"] == next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added")


def test_deepseek_r1_thinks_from_the_first_token(model):
    import openai

    s = ThreadedServer([str(model), "--port", str(free_port()), "--max-model-len", "512", "--num-kv-blocks", "64",
                        "--reasoning-parser", "deepseek_r1", "--served-model-name", NAME, "--log-level", "warning",
                        "--disable-access-log"]).start()
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        m = _chat(c, "No tag, yet thinking.</think>\n\nThe answer.").choices[0].message
        assert (m.reasoning_content, m.content) == ("No tag, yet thinking.", "The answer.")
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
        m = _chat(c, "I will say Oslo.</think>\n\n" + OSLO, response_format=fmt).choices[0].message
        assert m.reasoning_content == "I will say Oslo." and json.loads(m.content)["city"] in ("Paris", "Rome")
    finally:
        s.stop()
