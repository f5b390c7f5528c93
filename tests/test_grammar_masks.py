"""Grammar masks filled on a worker thread while the forward runs (`structured.StepMasks`).

The runner starts a step's masks before its forward and the sampler picks them up after:
the bitmask must be exactly the one a synchronous fill gives, unconstrained rows must stay
all-ones, a step without grammars must start nothing, and a fill that raises must fail only
the request whose grammar raised it."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tokenloom.runner.model_runner import RequestError, _sample_or_blame  # noqa: E402
from tokenloom.runner.sampler import SamplingRow  # noqa: E402
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from tokenloom.structured import GrammarCompiler, StepMasks  # noqa: E402

VOCAB_PAD = 64  # the model's vocabulary is wider than the tokenizer's, as Qwen2.5's is


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return GrammarCompiler(tok, len(tok) + VOCAB_PAD, [tok.eos_token_id])


def _states(compiler):
    json_state = compiler.new_state(StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}))
    digits = compiler.new_state(StructuredOutputsParams(regex=r"[0-9]{3}"))
    return [json_state, None, digits]


def test_bitmask_is_the_synchronous_one_and_free_rows_stay_open(compiler):
    import xgrammar as xgr

    states = _states(compiler)
    masks = StepMasks.start(states)
    assert masks is not None and masks.rows == [0, 2]
    got = masks.bitmask()
    want = xgr.allocate_token_bitmask(3, compiler.vocab_size)
    for i in (0, 2):
        states[i].fill_mask(want, i)
    assert torch.equal(got, want)
    assert bool((got[1] == -1).all())  # all ones: the unconstrained row is untouched
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[2], got[1])
    assert StepMasks.start([None, None]) is None  # nothing to fill: no work queued


def test_sampling_with_started_masks_obeys_the_grammar(compiler):
    states = _states(compiler)
    logits = torch.randn(3, compiler.vocab_size)
    rows = [SamplingRow(request_id=f"r{i}", params=SamplingParams(temperature=0.0), prompt_token_ids=[1],
                        output_token_ids=[], eos_token_ids=frozenset(), generator=None, grammar=s) for i, s in enumerate(states)]
    out = _sample_or_blame(logits, rows, StepMasks.start(states)).finish()  # the tokens as the host reads them
    assert out.token_ids[1] == int(logits[1].argmax())  # unconstrained: plain argmax
    for i in (0, 2):
        assert states[i].accept(out.token_ids[i])  # the grammar allows what was chosen


class _BrokenState:
    """A grammar state whose fill raises, as a corrupted matcher would."""

    vocab_size = 100

    def fill_mask(self, bitmask, row):
        raise RuntimeError("matcher broke")


def test_a_fill_that_raises_fails_only_its_request(compiler):
    states = [None, _BrokenState()]
    rows = [SamplingRow(request_id=f"r{i}", params=SamplingParams(temperature=0.0), prompt_token_ids=[1],
                        output_token_ids=[], eos_token_ids=frozenset(), generator=None, grammar=s) for i, s in enumerate(states)]
    with pytest.raises(RequestError) as err:
        _sample_or_blame(torch.randn(2, 100), rows, StepMasks.start(states))
    assert err.value.request_id == "r1"


@pytest.mark.parametrize("vocab", [151936, 1000, 37])
def test_mask_kernel_and_fallback_match_xgrammar(vocab, monkeypatch):
    """Our CPU masking kernel (and the PyTorch fallback) set exactly xgrammar's -inf entries,
    all-ones, all-zeros and mixed words alike, vocabularies not a multiple of 32 included."""
    import xgrammar as xgr

    from tokenloom.kernels import cpu as cpu_kernels

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    bitmask = xgr.allocate_token_bitmask(6, vocab)  # row 0 stays all ones
    bitmask[1] = 0
    bitmask[2] = torch.randint(-2**31, 2**31 - 1, bitmask[2].shape, generator=g, dtype=torch.int32)
    bitmask[3, ::3] = 0
    bitmask[4, : bitmask.shape[1] // 2] = 0
    bitmask[5, -1] = 5
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    got = cpu_kernels.mask_logits_(logits.clone(), bitmask)
    assert torch.equal(got, want)
    fallback = logits.clone()
    monkeypatch.setattr(cpu_kernels, "fused_enabled", lambda: False)
    assert torch.equal(cpu_kernels.mask_logits_(fallback, bitmask), want) and torch.equal(fallback, want)
