"""The bundled model `tokenloom/py-tiny` and the tokenizer builder behind it.

The bundled directory must be a plain Hugging Face model: transformers loads it, generates with
it, and its held-out bits per byte on a fixed slice of never-trained-on stdlib files stays under
the published bound (docs/bundled-model.md).  Its byte-level tokenizer must round-trip any text,
keep the special-token ids the presets hard-code, and render the chat template.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenloom.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_NAME, bits_per_byte
from tokenloom.model.tools import tokenizer_builder as tb

# Held-out bound for the fixed slice below: measured 1.731 on Python 3.11 (docs/bundled-model.md)
# plus margin for platform numerics.  Other Python versions have other stdlib files in the slice,
# so there only the 2.0 the issue requires is checked.
MEASURED_ON_PYTHON = (3, 11)
HELDOUT_SLICE_BPB_BOUND = 1.85 if sys.version_info[:2] == MEASURED_ON_PYTHON else 2.0
SLICE_FILES = 3
SLICE_CHARS = 8000

CHINESE = "北京是中国的首都，上海是"
PY_SOURCE = (
    "class Stack:\n"
    '    """LIFO."""\n\n'
    "    def __init__(self) -> None:\n"
    "        self._items: list[int] = []\n\n"
    "    def push(self, x):\n"
    "\tif x is None:  # tabs, too\n"
    "\t\traise ValueError(f'bad {x!r}')\n"
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((BUNDLED_MODEL_DIR / "training_report.json").read_text())


def heldout_slice() -> list[str]:
    """First SLICE_CHARS characters of the first SLICE_FILES held-out files that are long enough."""
    texts = []
    for path in tb.stdlib_corpus_files("val"):
        text = path.read_text(encoding="utf-8")
        if len(text) >= SLICE_CHARS:
            texts.append(text[:SLICE_CHARS])
        if len(texts) == SLICE_FILES:
            break
    return texts


# ---------------------------------------------------------------- bundled directory


def test_bundled_directory_layout(report: dict) -> None:
    assert BUNDLED_MODEL_NAME == "tokenloom/py-tiny"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "training_report.json"):
        assert (BUNDLED_MODEL_DIR / name).is_file(), name
    assert (BUNDLED_MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    config = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    gen = json.loads((BUNDLED_MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4]
    assert report["val_bits_per_byte"] <= 2.0
    assert report["params"] > 1_000_000


def test_loads_and_generates(hf_model, hf_tokenizer) -> None:
    ids = hf_tokenizer("def quicksort(arr):\n", return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=24, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    text = hf_tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("def quicksort(arr):\n")
    # Trained on Python: a greedy continuation of a def should contain code-like characters.
    assert any(c in text[len("def quicksort(arr):\n"):] for c in "=()[]:.")


def test_heldout_bits_per_byte(hf_model, report: dict) -> None:
    texts = heldout_slice()
    assert len(texts) == SLICE_FILES
    rel = [p.relative_to(tb.stdlib_root()).as_posix() for p in tb.stdlib_corpus_files("val")]
    assert set(rel).isdisjoint(p.relative_to(tb.stdlib_root()).as_posix() for p in tb.stdlib_corpus_files("train"))
    tok = Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
    bpb = bits_per_byte(hf_model, tok, texts, context=report["hyperparameters"]["context"])
    assert math.isfinite(bpb)
    assert bpb <= HELDOUT_SLICE_BPB_BOUND, f"held-out slice bpb {bpb:.3f}"


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["Hello, world!  Two  spaces.\n\nx = 1", PY_SOURCE, CHINESE, "emoji 🙂 ünïcödé"])
def test_round_trip(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer(text)["input_ids"]
    assert hf_tokenizer.decode(ids) == text
    raw = Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
    assert raw.decode(raw.encode(text).ids) == text


def test_special_token_ids(hf_tokenizer) -> None:
    assert hf_tokenizer.convert_tokens_to_ids(list(tb.SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (0, 1, 2)
    assert hf_tokenizer("x = 1")["input_ids"][0] != tb.BOS_ID  # no BOS added automatically
    # Special tokens written in text are recognised as single tokens.
    assert hf_tokenizer("<|im_start|>user")["input_ids"][0] == tb.IM_START_ID


def test_chat_template(hf_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHINESE}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{CHINESE}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


# ---------------------------------------------------------------- tokenizer_builder


def test_corpus_split_is_deterministic_and_disjoint() -> None:
    train, val = tb.stdlib_corpus_files("train"), tb.stdlib_corpus_files("val")
    assert train == tb.stdlib_corpus_files("train") and train == sorted(train, key=lambda p: p.relative_to(tb.stdlib_root()).as_posix())
    assert set(train).isdisjoint(val)
    assert all("site-packages" not in p.parts for p in train + val)
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.06
    with pytest.raises(ValueError):
        tb.stdlib_corpus_files("test")  # type: ignore[arg-type]


def test_default_tokenizer_cached_and_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    tok = tb.default_tokenizer(1024)
    assert tok.get_vocab_size() == 1024
    cached = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(cached) == 1 and "vocab1024" in cached[0].name
    again = tb.default_tokenizer(1024)  # from the cache this time
    assert again.to_str() == tok.to_str()
    assert [tok.token_to_id(t) for t in tb.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.decode(tok.encode(CHINESE + PY_SOURCE).ids) == CHINESE + PY_SOURCE

    tb.save_hf_tokenizer(tok, tmp_path / "hf", model_max_length=128)
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.model_max_length == 128 and hf.eos_token_id == 2
    ids = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tb.IM_START_ID


def test_bpe_vocab_too_small_rejected() -> None:
    with pytest.raises(ValueError):
        tb.build_bytelevel_bpe(100, [])


# ---------------------------------------------------------------- engine parity


def _strip_eos(ids: list[int]) -> list[int]:
    # Whether a finishing EOS is reported is an API detail; the tokens before it must match.
    return ids[:-1] if ids and ids[-1] in (tb.EOS_ID, tb.IM_END_ID) else ids


def test_engine_greedy_matches_transformers(hf_model, hf_tokenizer) -> None:
    from tokenloom import LLM, SamplingParams

    prompts = ["def quicksort(arr):", "import os\n", "class Stack:", CHINESE]
    llm = LLM(str(BUNDLED_MODEL_DIR))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        assert _strip_eos(list(out.outputs[0].token_ids)) == _strip_eos(ref), prompt
