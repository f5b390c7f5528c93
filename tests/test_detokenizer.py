"""Detokenization never raises, streams exactly the final text, and adds no U+FFFD of its own.

Tokenizers of the three families the engine claims are trained here, with the `tokenizers`
library, on a few sentences that include Chinese and emoji, and wrapped in transformers'
`PreTrainedTokenizerFast`:

* byte-level BPE (GPT-2, Llama-3, Qwen): bytes mapped to printable characters;
* SentencePiece-style BPE with byte fallback (Llama-2, Mistral, TinyLlama): `<0xE4>` tokens
  and the decoder Sequence[Replace ▁→' ', ByteFallback, Fuse, Strip];
* WordPiece (BERT): "##" continuations.

The reference for a generated sequence `gen` after a prompt is what the tokenizer itself
decodes: the text `gen` adds to the decoded prompt -- unless the prompt's own tail and the
answer's bytes would merge (a prompt ending mid-character, or in a byte-fallback run), where
the partial character stays the prompt's and the answer's own decode is the reference
(SentencePiece's Strip takes one leading space off that, so " " + it is accepted too).
Ids beyond the vocabulary decode to "", as the tokenizer's own decode drops them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenloom.engine.detokenizer import (_MAX_HELD_TOKENS, IncrementalDetokenizer, TokenTexts,
                                          tokenizer_facts)

FFFD = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
CORPUS = [
    "Once upon a time, there was a little girl named Lily.",
    "She liked to play outside in the sun with her dog, and they laughed together.",
    "Lily said 你好 to her friend 😀 and the friend said hello back.",
    "我很感谢你的热情。今天天气很好！",
    "The quick brown fox jumps over the lazy dog's back, doesn't it?",
    "日本語のテキストも少し。 Emoji: 🚀🎉 café naïve",
]
PROMPTS = ["Lily said 你好", "Once upon a time, there was", "我很感谢", "emoji 😀", "café", "x"]


# ---- tokenizers of each family -------------------------------------------------

def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama-2-style: ▁ for spaces, byte fallback, decoder Replace/ByteFallback/Fuse/Strip."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")  # training only
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    # 你, 好 and 😀 never seen in training: those are left to byte fallback.
    corpus = [s.replace("你", "").replace("好", "").replace("😀", "") for s in CORPUS]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=260, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = None  # as in Llama-2's tokenizer.json
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = base + b
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def bytelevel_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300,
                                                              special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                                   pad_token="[PAD]")


FAMILIES = {"sentencepiece": sentencepiece_bpe(), "bytelevel": bytelevel_bpe(), "wordpiece": wordpiece()}


# ---- the reference and the thing under test --------------------------------------

def decode(tok, ids, skip: bool = True) -> str:
    known = tokenizer_facts(tok).known
    return tok.decode([i for i in ids if i in known], skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _ends_in_byte_run(tok, prompt: list[int], skip: bool) -> bool:
    specials = set(tok.all_special_ids) if skip else set()
    visible = [i for i in prompt if i < len(tok) and i not in specials]
    return bool(visible) and _BYTE_PIECE.fullmatch(tok.convert_ids_to_tokens(visible[-1])) is not None


def accepted(tok, prompt: list[int], gen: list[int], skip: bool = True) -> set[str]:
    alone = decode(tok, gen, skip)
    whole, before = decode(tok, prompt + gen, skip), decode(tok, prompt, skip)
    if before.endswith(FFFD) or _ends_in_byte_run(tok, prompt, skip):
        return {alone, " " + alone}  # the prompt's tail and the answer's bytes would merge
    assert whole.startswith(before)
    return {whole[len(before):]}


def stream(tok, prompt: list[int], gen: list[int], skip: bool = True) -> tuple[list[str], str]:
    """(the deltas a client would see, the engine's final text) for `gen` after `prompt`."""
    d = IncrementalDetokenizer(tok, prompt, skip, [], False)
    deltas = [d.push(t) for t in gen] + [d.finish()]
    e = IncrementalDetokenizer(tok, prompt, skip, [], False)
    for t in gen:
        e.add(t)
    e.flush()
    return deltas, e.text


def check(tok, prompt: list[int], gen: list[int], skip: bool = True) -> None:
    deltas, final = stream(tok, prompt, gen, skip)
    assert "".join(deltas) == final
    assert final in accepted(tok, prompt, gen, skip), (prompt, gen)
    assert final.count(FFFD) <= decode(tok, gen, skip).count(FFFD)


def ids_strategy(tok) -> st.SearchStrategy[list[int]]:
    """Any ids, beyond the vocabulary too, with byte tokens and special tokens made common."""
    f = tokenizer_facts(tok)
    n = len(tok)
    pools = [st.integers(0, n + 40)]
    if f.byte_values:
        pools.append(st.sampled_from(sorted(f.byte_values)))
        lead_and_tail = [i for i, b in f.byte_values.items() if b >= 0x80]
        pools.append(st.sampled_from(sorted(lead_and_tail)))
    pools.append(st.sampled_from(sorted(f.special_ids)))
    return st.lists(st.one_of(*pools), max_size=48)


def text_prompt_strategy() -> st.SearchStrategy[str]:
    return st.text(alphabet=st.sampled_from(list("Lily said 你好谢热😀🎉é,. ")), max_size=12)


# TOKENLOOM_HYPOTHESIS_EXAMPLES raises the example count for a deeper search than CI's.
FAST = settings(max_examples=int(os.environ.get("TOKENLOOM_HYPOTHESIS_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# ---- properties -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_random_ids_without_prompt_stream_exactly_the_decode(family):
    tok = FAMILIES[family]

    @FAST
    @given(gen=ids_strategy(tok), skip=st.booleans())
    def prop(gen, skip):
        deltas, final = stream(tok, [], gen, skip)
        assert "".join(deltas) == final == decode(tok, gen, skip)

    prop()


@pytest.mark.parametrize("family", FAMILIES)
def test_random_ids_after_any_prompt(family):
    """Prompts typed as text, and prompts given as ids (which may end mid-character)."""
    tok = FAMILIES[family]

    @FAST
    @given(text=text_prompt_strategy(), id_prompt=ids_strategy(tok), use_ids=st.booleans(), gen=ids_strategy(tok))
    def prop(text, id_prompt, use_ids, gen):
        prompt = id_prompt if use_ids else tok.encode(text)
        check(tok, prompt, gen)

    prop()


@pytest.mark.parametrize("family", FAMILIES)
def test_continuations_keep_their_spacing(family):
    """Real continuations of real prompts: the answer is what it adds to the prompt's text,
    leading space included, with no U+FFFD (the prompt ending in Chinese or an emoji)."""
    tok = FAMILIES[family]
    for p in PROMPTS:
        full = tok.encode(p + " and they laughed 😀 together")
        prompt = tok.encode(p)
        assert full[:len(prompt)] == prompt
        deltas, final = stream(tok, prompt, full[len(prompt):])
        assert FFFD not in final
        assert final == decode(tok, full)[len(decode(tok, prompt)):]
        if family != "wordpiece":  # WordPiece puts a space between every two words anyway
            assert final == " and they laughed 😀 together"


def test_prompt_ending_mid_character_gets_no_garbage():
    """Issue #2's case: the prompt's last ids start (or end) inside a character."""
    tok = FAMILIES["sentencepiece"]
    f = tokenizer_facts(tok)
    prompt = tok.encode("Lily said 你好")
    assert any(i in f.byte_values for i in prompt[-5:]), "the test needs 你好 as byte-fallback tokens"
    answer = tok.encode("Lily said 你好 and more")[len(prompt):]
    for cut in range(1, 6):  # token-id prompts that stop inside 你 or 好
        _, final = stream(tok, prompt[:-cut], answer)
        alone = decode(tok, answer)
        assert final in (alone, " " + alone) and FFFD not in final


@pytest.mark.parametrize("family", ["sentencepiece", "bytelevel"])
def test_long_byte_runs_are_held_boundedly(family):
    """A model that emits nothing but single bytes: text is held at most `_MAX_HELD_TOKENS`
    tokens, valid characters come out right, invalid bytes as U+FFFD, nothing raises."""
    tok = FAMILIES[family]
    f = tokenizer_facts(tok)
    if f.byte_values:
        by_byte = {b: i for i, b in f.byte_values.items()}
    else:  # byte-level BPE: the single-byte tokens of its alphabet
        by_byte = {b: tok.convert_tokens_to_ids(c) for b, c in enumerate(_bytes_to_unicode())}
    text = "你好谢谢😀" * 12
    valid = [by_byte[b] for b in text.encode()]
    invalid = [by_byte[0xE4]] * (3 * _MAX_HELD_TOKENS)
    for gen, want in ((valid, text), (invalid, None)):
        d = IncrementalDetokenizer(tok, tok.encode("Lily said"), True, [], False)
        out = []
        for t in gen:
            out.append(d.push(t))
            assert len(d.ids) - d.read_offset <= _MAX_HELD_TOKENS
        out.append(d.finish())
        assert any(out[:-1]), "text is released before the end"
        if want is not None:
            assert "".join(out).strip() == want
        else:
            assert set("".join(out).strip()) == {FFFD}


def test_out_of_vocabulary_ids_decode_to_nothing():
    """A model vocabulary padded beyond the tokenizer's: padding ids contribute ""."""
    for tok in FAMILIES.values():
        n = len(tok)
        gen = tok.encode("Once upon a time", add_special_tokens=False)
        padded = [x for t in gen for x in (t, n, n + 7)] + [2**40]
        _, final = stream(tok, [], padded)
        assert final == decode(tok, gen)


def test_special_tokens_mid_stream_keep_spacing():
    """A skipped special token must not make the next word decode as if it began the text."""
    for name in ("sentencepiece", "wordpiece"):
        tok = FAMILIES[name]
        words = tok.encode("Once upon a time there was a girl", add_special_tokens=False)
        special = sorted(tokenizer_facts(tok).special_ids)[-1]
        gen = [x for t in words for x in (t, special)]
        _, final = stream(tok, tok.encode("Lily said"), gen)
        assert final == decode(tok, tok.encode("Lily said") + gen)[len(decode(tok, tok.encode("Lily said"))):]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_ending_in_a_long_special_run_keeps_its_text_before_the_answer(family):
    """A prompt whose text is followed by more skipped special tokens (a padding run) than the
    detokenizer's left context holds: the answer's first word still decodes after that text
    (WordPiece's space before ':' was lost once, when the window held only padding)."""
    tok = FAMILIES[family]
    special = sorted(tokenizer_facts(tok).special_ids)[0]
    prompt = tok.encode("Lily said", add_special_tokens=False)
    gen = tok.encode(": once upon a time", add_special_tokens=False)
    for run in (3, 12, 40):
        check(tok, prompt + [special] * run, gen)


def test_stop_strings_still_cut_and_hold_back():
    tok = FAMILIES["sentencepiece"]
    full = tok.encode("Once upon a time, there was a little girl")
    prompt, gen = full[:3], full[3:]
    assert decode(tok, prompt) == "Once upon a"
    d = IncrementalDetokenizer(tok, prompt, True, ["little"], False)
    for t in gen:
        hit = d.add(t)
        assert "littl" not in d.visible_text(False)
        if hit is not None:
            break
    assert hit == "little" and d.text == " time, there was a "


# ---- logprob token strings ------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_token_texts_concatenate_to_the_text(family):
    tok = FAMILIES[family]

    @FAST
    @given(text=text_prompt_strategy(), gen=ids_strategy(tok))
    def prop(text, gen):
        prompt = tok.encode(text)
        walker = TokenTexts(tok, prompt)
        strings = [walker.next(t, [t + 1, 3])[0] for t in gen]
        if strings:
            strings[-1] += walker.finish()
        assert "".join(strings) == stream(tok, prompt, gen)[1]

    prop()


def test_sentencepiece_token_texts_keep_leading_spaces():
    tok = FAMILIES["sentencepiece"]
    full = tok.encode("Once upon a time, there was")
    strings = _spacing_checked(tok, full)
    assert "".join(strings) == "Once upon a time, there was"
    walker = TokenTexts(tok, full[:1])  # alternatives: each word in place of the second token
    words = [i for i, piece in zip(full, tok.convert_ids_to_tokens(full)) if piece.startswith("▁") and piece != "▁"]
    _, alternatives = walker.next(full[1], words)
    for w in words:
        if w != full[1]:
            assert alternatives[w] == " " + tok.convert_ids_to_tokens(w)[1:]


def _spacing_checked(tok, ids: list[int]) -> list[str]:
    """The token strings of `ids` (no context); asserts each "▁word" past the first prints " word"."""
    walker = TokenTexts(tok, [])
    strings = [walker.next(t)[0] for t in ids]
    strings[-1] += walker.finish()
    pieces = tok.convert_ids_to_tokens(ids)
    for k, (piece, s) in enumerate(zip(pieces, strings)):
        if k > 0 and piece.startswith("▁") and not _BYTE_PIECE.fullmatch(pieces[k - 1]):
            assert s == piece.replace("▁", " "), (pieces, strings)
    return strings


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet), by byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# ---- end to end: a model whose vocabulary is padded beyond its byte-fallback tokenizer ----

_PADDING = 64  # model rows no token owns, as Qwen2.5 pads 151,665 tokens to 151,936
E2E_PROMPTS = ["Lily said 你好", "Once upon a time, there was", "我很感谢", "emoji 😀 and", "café"]


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> Path:
    from tokenloom.model.tools.make_model import make_model

    tok = FAMILIES["sentencepiece"]
    out = make_model("tiny-llama", tmp_path_factory.mktemp("sp-padded"), tokenizer_vocab=1024,
                     overrides={"vocab_size": len(tok) + _PADDING, "bos_token_id": 1, "eos_token_id": 2})
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / stale).unlink(missing_ok=True)
    tok.save_pretrained(out)
    return out


def test_sampling_hot_on_padded_byte_fallback_model(padded_model):
    """Issue #1: temperature 1.5 on a byte-fallback tokenizer with padding ids in reach.
    Nothing raises, and every answer is what the tokenizer decodes its ids to."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(padded_model), max_model_len=256, num_kv_blocks=96, max_num_seqs=8, seed=0)
    tok = llm.get_tokenizer()  # loaded from the model directory, as a user's would be
    assert len(tok) == len(FAMILIES["sentencepiece"])
    params = SamplingParams(temperature=1.5, max_tokens=64, seed=7, ignore_eos=True)
    outs = llm.generate(E2E_PROMPTS * 2, params, use_tqdm=False)
    picked = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(picked) == 64 * len(E2E_PROMPTS) * 2
    assert any(t >= len(tok) for t in picked), "the test needs padding ids sampled"
    assert any(t in tokenizer_facts(tok).byte_values for t in picked)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length"  # not "error": detokenizing failed no request
        assert c.text in accepted(tok, list(o.prompt_token_ids), list(c.token_ids))


@pytest.fixture(scope="module")
def padded_server(padded_model):
    from server_fixtures import ThreadedServer

    from tokenloom.bench.launcher import free_port

    server = ThreadedServer([str(padded_model), "--port", str(free_port()), "--max-model-len", "256",
                             "--num-kv-blocks", "96", "--seed", "0", "--served-model-name", "sp",
                             "--log-level", "warning", "--disable-access-log"]).start()
    yield server
    server.stop()


def test_completion_logprobs_with_echo_index_the_text(padded_server):
    """Issue #3: logprob tokens keep SentencePiece's spaces, concatenate to the text, and
    `text_offset` indexes it -- echoed prompt and sampled answer, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=padded_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt in ["Once upon a time, there was a little girl", "Lily said 你好 to her friend"]:
        r = client.completions.create(model="sp", prompt=prompt, max_tokens=24, temperature=1.5, seed=3,
                                      logprobs=3, echo=True, extra_body={"ignore_eos": True})
        ch = r.choices[0]
        lp = ch.logprobs
        assert ch.text.startswith(prompt)
        assert "".join(lp.tokens) == ch.text
        assert all(ch.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
        n_prompt = r.usage.prompt_tokens
        assert lp.text_offset[n_prompt] == len(prompt)
        sp = FAMILIES["sentencepiece"]
        assert lp.tokens[:n_prompt] == _spacing_checked(sp, sp.encode(prompt))
        for top, tok, x in zip(lp.top_logprobs[n_prompt:], lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:]):
            assert top[tok] == pytest.approx(x)  # the chosen token's key is its own string

        chunks = list(client.completions.create(model="sp", prompt=prompt, max_tokens=24, temperature=1.5, seed=3,
                                                logprobs=3, stream=True, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks)
        toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        offs = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        assert text == ch.text[len(prompt):] and "".join(toks) == text
        assert all(text[o:o + len(t)] == t for o, t in zip(offs, toks))
