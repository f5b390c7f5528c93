"""Structured output: whatever a random model would say, a constrained answer is in the language asked for.

The model is tiny and random and samples at temperature 1, so without the grammar its answers
are noise; with it, every answer that finishes parses and validates against its JSON schema,
matches its regex, or is one of its choices.  Seeds make each answer reproducible.  The
requests are the shapes real clients send: OpenAI's `response_format` (and the official
client's `chat.completions.parse` with a pydantic model), vLLM's `structured_outputs` and
`guided_*` fields, and `SamplingParams(structured_outputs=...)` offline.  A SentencePiece
byte-fallback tokenizer with a vocabulary padded past the tokenizer's checks the masks on the
other tokenizer family and that padding ids are never sampled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from server_fixtures import ThreadedServer  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams  # noqa: E402

try:
    import jsonschema
except ImportError:  # pragma: no cover - the test extra installs it with openai
    jsonschema = None

NAME = "tiny"
# Every value bounded, so a random walk through the grammar ends well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "color", "tags"],
    "additionalProperties": False,
}


def check_person(doc: object) -> None:
    if jsonschema is not None:
        jsonschema.validate(doc, PERSON)
        return
    assert isinstance(doc, dict) and set(doc) == set(PERSON["required"])
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert type(doc["age"]) is int and 0 <= doc["age"] <= 120
    assert type(doc["member"]) is bool and doc["color"] in ("red", "green", "blue")
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "512",
                        "--num-kv-blocks", "256", "--max-num-seqs", "16", "--seed", "0",
                        "--served-model-name", NAME, "--log-level", "warning", "--disable-access-log"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def test_chat_json_schema_answers_validate(client):
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, temperature=1.0, seed=1, n=6, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(r.choices) == 6
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        check_person(json.loads(ch.message.content))
    # Properties come in the schema's order.
    assert list(json.loads(r.choices[0].message.content)) == list(PERSON["properties"])


def test_completions_json_schema_streamed_and_cut_by_max_tokens(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in (2, 3):
        stream = client.completions.create(model=NAME, prompt="A person:", temperature=1.0, seed=seed, max_tokens=200,
                                           stream=True, extra_body={"response_format": fmt})
        parts, reasons = [], []
        for chunk in stream:
            for ch in chunk.choices:
                parts.append(ch.text)
                reasons.append(ch.finish_reason)
        assert reasons[-1] == "stop"
        check_person(json.loads("".join(parts)))
    # max_tokens cuts the document: finish_reason says so, and what came is a prefix of one.
    r = client.completions.create(model=NAME, prompt="A person:", temperature=1.0, seed=2, max_tokens=5,
                                  extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "length"
    text = r.choices[0].text
    assert text and '{"name": "'.startswith(text[:10]), text


def test_json_object(client):
    r = client.chat.completions.create(model=NAME, messages=CHAT, temperature=1.0, seed=4, n=4, max_tokens=300,
                                       response_format={"type": "json_object"})
    finished = [ch for ch in r.choices if ch.finish_reason == "stop"]
    assert finished, "no answer finished within max_tokens"
    for ch in r.choices:
        assert ch.message.content.startswith("{")
    for ch in finished:
        assert isinstance(json.loads(ch.message.content), dict)


def test_regex_choice_and_grammar_in_vllm_shapes(client):
    regex = r"[a-z]{2,5}-[0-9]{3}"
    choices = ["yes", "no", "maybe not", "café ☕"]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t)),
        ({"guided_json": PERSON}, lambda t: check_person(json.loads(t)) is None),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, lambda t: check_person(json.loads(t)) is None),
    ]
    for body, ok in cases:
        r = client.completions.create(model=NAME, prompt="Answer:", temperature=1.0, seed=5, n=3, max_tokens=200,
                                      extra_body=body)
        for ch in r.choices:
            assert ch.finish_reason == "stop" and ok(ch.text), (body, ch.text)
    r = client.chat.completions.create(model=NAME, messages=CHAT, temperature=1.0, seed=6, n=4, max_tokens=20,
                                       extra_body={"guided_choice": choices})
    assert all(ch.message.content in choices for ch in r.choices)


def test_chat_completions_parse_with_pydantic(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int = Field(ge=0, le=8)
        indoor: bool

    if not hasattr(client.chat.completions, "parse"):
        pytest.skip("this openai client has no chat.completions.parse")
    r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "A pet?"}],
                                      temperature=1.0, seed=7, n=3, max_tokens=100, response_format=Pet)
    for ch in r.choices:
        assert isinstance(ch.message.parsed, Pet)


def _error(client, **kw):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=5, **kw)
    return e.value.body


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_invalid_constraint_is_a_400_naming_the_field(client, body, param):
    err = _error(client, extra_body=body)
    assert err["param"] == param, err
    assert param in err["message"]
    # The server carries on.
    r = client.completions.create(model=NAME, prompt="x", max_tokens=3, extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].text == "ok"


def test_offline_sampling_params(tiny_llama):
    from tokenloom import LLM

    llm = LLM(str(tiny_llama), max_model_len=512, num_kv_blocks=128, max_num_seqs=8, seed=0)
    so = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=so) for s in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20,
                                 guided_decoding=GuidedDecodingParams(regex=r"\d{4}")))
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(grammar="root ::= missing")))
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20))  # unconstrained, in the same batch
    outs = llm.generate(["Tell me about a person."] * len(params), params, use_tqdm=False)
    for o in outs[:4]:
        assert o.outputs[0].finish_reason == "stop"
        check_person(json.loads(o.outputs[0].text))
    assert re.fullmatch(r"\d{4}", outs[4].outputs[0].text)
    assert outs[5].error is not None and "grammar" in outs[5].error  # refused alone
    assert outs[6].outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", json=PERSON))
    assert llm.llm_engine.kv.usage() == 0.0  # every KV block back in the pool


@pytest.fixture(scope="module")
def padded_sentencepiece_model(tmp_path_factory) -> Path:
    from test_detokenizer import sentencepiece_bpe

    from tokenloom.model.tools.make_model import make_model

    tok = sentencepiece_bpe()
    out = make_model("tiny-llama", tmp_path_factory.mktemp("sp-padded-structured"), tokenizer_vocab=1024,
                     overrides={"vocab_size": len(tok) + 64, "bos_token_id": 1, "eos_token_id": 2})
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / stale).unlink(missing_ok=True)
    tok.save_pretrained(out)
    return out


def test_byte_fallback_tokenizer_with_padded_vocabulary(padded_sentencepiece_model):
    """Hot sampling on a model whose vocabulary is padded 64 ids past its SentencePiece
    byte-fallback tokenizer: the masks never let a padding id through, and byte-fallback
    pieces (<0xE2> ...) spell the non-ASCII choices."""
    from tokenloom import LLM

    llm = LLM(str(padded_sentencepiece_model), max_model_len=256, num_kv_blocks=96, max_num_seqs=8, seed=0)
    tok = llm.get_tokenizer()
    choices = ["你好", "café ☕", "hello world"]
    params = ([SamplingParams(temperature=1.5, seed=s, max_tokens=150, structured_outputs=StructuredOutputsParams(json=PERSON))
               for s in range(4)]
              + [SamplingParams(temperature=1.5, seed=s, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=choices))
                 for s in range(6)])
    outs = llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert all(t < len(tok) for t in c.token_ids)
    for o in outs[:4]:
        check_person(json.loads(o.outputs[0].text))
    assert all(o.outputs[0].text in choices for o in outs[4:])
