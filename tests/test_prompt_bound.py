"""The length bound on tokens (engine/prompt_bound.py) holds for every tokenizer it is given to.

A text of B bytes must have at least ceil(B / L) tokens for the L the module computes, or a
prompt that fits max_model_len could be refused.  Checked, by hypothesis and by adversarial
texts (runs of the longest vocabulary entry, spaces, byte-fallback characters, special-token
text, characters that normalization shrinks), on tokenizers of each family the engine is
tested with: byte-level BPE (test_detokenizer's, and the stdlib-trained one tiny models
use), SentencePiece-style BPE with byte fallback, and byte-level BPE behind an NFC normalizer
(Qwen2's pipeline).  WordPiece gets no bound, and a counterexample shows why it must not.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

from test_detokenizer import CORPUS, FAMILIES
from tokenloom.engine.prompt_bound import bound_for
from tokenloom.model.tools.tokenizer_builder import default_tokenizer


def _with_nfc(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["normalizer"] = {"type": "NFC"}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tok.eos_token)


BOUNDED = {
    "bytelevel": FAMILIES["bytelevel"],
    "sentencepiece": FAMILIES["sentencepiece"],
    "stdlib-bytelevel": PreTrainedTokenizerFast(tokenizer_object=default_tokenizer(512)),
    "bytelevel-nfc": _with_nfc(FAMILIES["bytelevel"]),
}

# Characters that stress the bound: spaces (▁ in SentencePiece), multi-byte text, emoji (byte
# fallback), combining marks and compatibility characters (NFC/NFKC shrink them: U+212A
# KELVIN SIGN, 3 bytes, becomes "K", 1 byte; e + U+0301 becomes é).
_ALPHABET = st.sampled_from(list("ab the\n\t ") + ["你", "好", "😀", "é", "e\u0301", "\u212a", "\u1100\u1161\u11a8",
                                                   "<s>", "</s>", "<|endoftext|>", "▁", "<0xE4>"])
_TEXTS = st.lists(_ALPHABET, max_size=200).map("".join) | st.text(max_size=300)


def _holds(tok, text: str) -> tuple[bool, int, int]:
    bound = bound_for(tok)
    n = len(tok.encode(text, add_special_tokens=False))
    return n >= bound.min_tokens(text), n, bound.min_tokens(text)


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_bounded_families_get_a_bound(name):
    bound = bound_for(BOUNDED[name])
    assert bound.max_bytes_per_token is not None, bound.why_none
    assert 1 <= bound.max_bytes_per_token <= 4096


@pytest.mark.parametrize("name", sorted(BOUNDED))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=_TEXTS)
def test_no_text_has_fewer_tokens_than_the_bound(name, text):
    ok, n, least = _holds(BOUNDED[name], text)
    assert ok, f"{text!r}: {n} tokens, bound says at least {least}"


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_adversarial_texts_respect_the_bound(name):
    tok = BOUNDED[name]
    vocab = tok.get_vocab()
    # The entries that cover the most text, decoded back to the text they stand for.
    longest = sorted(vocab, key=lambda e: len(tok.convert_tokens_to_string([e]).encode()), reverse=True)[:20]
    texts = [tok.convert_tokens_to_string([e]) * 50 for e in longest]
    texts += [" " * 5000, "\n" * 3000, "\u212a" * 2000, "e\u0301" * 2000, "😀" * 500, "".join(CORPUS) * 20,
              "<s></s><|endoftext|>" * 300, "\u1100\u1161\u11a8" * 500]
    for text in texts:
        ok, n, least = _holds(tok, text)
        assert ok, f"{text[:40]!r}...: {n} tokens, bound says at least {least}"


def test_the_bound_is_tight_enough_to_matter():
    """A megabyte of ordinary text is known to be far beyond a 4k context from its length."""
    text = " ".join(CORPUS) * (2**20 // len(" ".join(CORPUS)))
    for tok in BOUNDED.values():
        assert bound_for(tok).min_tokens(text) > 4096


def test_wordpiece_gets_no_bound_because_text_can_vanish():
    tok = FAMILIES["wordpiece"]
    bound = bound_for(tok)
    assert bound.max_bytes_per_token is None and "drop" in bound.why_none
    assert bound.min_tokens("x" * 10_000) == 0  # no bound: never refuses by length
    # Why: whitespace is dropped, so 10,000 bytes can be one token -- any L would be wrong.
    assert len(tok.encode(" " * 9_999 + "a", add_special_tokens=False)) == 1


@pytest.mark.parametrize("change,why", [
    ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, "Strip"),
    ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}}, "deletes"),
    ({"pre_tokenizer": {"type": "Whitespace"}}, "Whitespace"),
    ({"added_tokens": [{"id": 0, "content": "<mask>", "single_word": False, "lstrip": True, "rstrip": False,
                        "normalized": False, "special": True}]}, "swallows"),
])
def test_pipelines_that_drop_text_get_no_bound(change, why):
    spec = json.loads(FAMILIES["bytelevel"].backend_tokenizer.to_str())
    if "added_tokens" in change:
        spec["added_tokens"] = spec["added_tokens"] + change["added_tokens"]
    else:
        spec.update(change)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    bound = bound_for(tok)
    assert bound.max_bytes_per_token is None and why in bound.why_none


def test_shrinking_normalizers_scale_the_bound():
    base = bound_for(FAMILIES["bytelevel"]).max_bytes_per_token
    assert bound_for(BOUNDED["bytelevel-nfc"]).max_bytes_per_token == 4 * base
    assert normalizers.NFC().normalize_str("\u212a" * 3) == "KKK"  # 9 bytes in, 3 out: why the factor exists
