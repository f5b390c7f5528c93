"""Sampler: filters never leak, penalties follow their definitions, seeds are batch-independent."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.runner.sampler import SamplingRow, sample
from tokenloom.sampling import apply_penalties, top_p_filter
from tokenloom.sampling_params import SamplingParamError


def _row(**kw) -> SamplingRow:
    params = SamplingParams(**{"temperature": 1.0, **kw})
    return SamplingRow("r", params, [], [], frozenset(), None)


def _draws(logits: torch.Tensor, n: int = 400, **kw) -> set[int]:
    rows = [_row(**kw) for _ in range(n)]
    return set(sample(logits.repeat(n, 1), rows).token_ids)


def test_top_k_top_p_min_p_never_emit_filtered_tokens():
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    assert _draws(logits, top_k=3) <= {0, 1, 2}
    probs = logits.softmax(-1)[0]
    # top_p=0.7: keep the smallest prefix of sorted tokens whose mass reaches 0.7
    cum = probs.cumsum(0)
    keep = {i for i in range(8) if (cum[i] - probs[i]) < 0.7}
    got = _draws(logits, top_p=0.7)
    assert got <= keep and len(got) > 1
    allowed = {i for i in range(8) if probs[i] >= 0.3 * probs.max()}
    assert _draws(logits, min_p=0.3) <= allowed
    assert _draws(logits, top_k=5, top_p=0.9, min_p=0.1) <= {0, 1, 2, 3, 4}


@given(rows=st.integers(1, 6), vocab=st.integers(1, 300), candidates=st.sampled_from([1, 4, 64, 1024]),
       spread=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_top_p_keeps_what_a_full_sort_keeps(rows, vocab, candidates, spread, seed):
    """The partial-sort nucleus (with the full-sort fallback for rows whose nucleus lies past
    the candidates) keeps exactly the tokens the definition's full sort keeps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * spread  # flat to peaked
    top_p = torch.rand(rows, 1, generator=g) * 0.98 + 0.01
    vals, order = logits.softmax(dim=1).sort(dim=1, descending=True)
    expect = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, (vals.cumsum(dim=1) - vals) < top_p)
    assert torch.equal(top_p_filter(logits, top_p, candidates, kernel=False) > float("-inf"), expect)


def _nucleus_float64(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition, summed in float64, equal probabilities in index order (a stable sort)."""
    vals, order = logits.softmax(dim=1).double().sort(dim=1, descending=True, stable=True)
    before = vals.cumsum(dim=1) - vals
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, before < top_p.double())


def _logits(g: torch.Generator, rows: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "ties":  # few distinct values: lines fall inside runs of equal tokens
        return torch.randint(-3, 3, (rows, vocab), generator=g).float()
    if kind == "masked":  # a grammar or top-k before it: some tokens already -inf
        x = torch.randn(rows, vocab, generator=g) * 3
        return x.masked_fill(torch.rand(rows, vocab, generator=g) < 0.5, float("-inf"))
    return torch.randn(rows, vocab, generator=g) * {"flat": 0.3, "normal": 1.0, "peaked": 8.0}[kind]


KINDS = ["flat", "normal", "peaked", "ties", "masked"]


@pytest.mark.skipif(not cpu_kernels.fused_enabled(), reason="our CPU kernels do not build here")
@given(rows=st.integers(1, 5), vocab=st.integers(1, 3000), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=80, deadline=None)
def test_top_p_kernel_keeps_what_the_definition_keeps(rows, vocab, kind, seed):
    """Our sort-free nucleus (kernels/cpu_sampling.cpp) keeps exactly the tokens the
    definition keeps, ties included (equal probabilities in index order)."""
    g = torch.Generator().manual_seed(seed)
    logits = _logits(g, rows, vocab, kind)
    top_p = torch.rand(rows, 1, generator=g) * 0.999 + 0.0005
    expect = _nucleus_float64(logits, top_p)
    assert torch.equal(top_p_filter(logits.clone(), top_p) > float("-inf"), expect)


@pytest.mark.skipif(not cpu_kernels.fused_enabled(), reason="our CPU kernels do not build here")
@pytest.mark.parametrize("kind", ["flat", "normal", "peaked"])
def test_top_p_kernel_on_a_full_vocabulary(kind):
    """Qwen2.5's 151,936 tokens, where the line lies deep in a bucket of thousands (flat
    rows' nucleus is most of the vocabulary), at the p's people use."""
    g = torch.Generator().manual_seed(3)
    logits = _logits(g, 4, 151936, kind)
    top_p = torch.tensor([[0.5], [0.9], [0.95], [0.99]])
    kept = top_p_filter(logits.clone(), top_p) > float("-inf")
    assert torch.equal(kept, _nucleus_float64(logits, top_p))
    assert kept.sum() < logits.numel()


@pytest.mark.skipif(not cpu_kernels.fused_enabled(), reason="our CPU kernels do not build here")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_filters_survive_rows_that_are_not_finite(bad):
    """A model that blew up (NaN or +inf logits, so NaN probabilities) still gets a token per
    row from every filter, and the other rows of the step keep theirs."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g)
    logits[1, ::7] = bad
    def rows(ids):
        return [SamplingRow(f"r{i}", SamplingParams(temperature=1.0, top_p=0.9, top_k=40), [], [], frozenset(),
                            torch.Generator().manual_seed(i)) for i in ids]

    tokens = sample(logits, rows([0, 1, 2])).token_ids
    assert len(tokens) == 3 and all(0 <= t < 5000 for t in tokens)
    assert [tokens[0], tokens[2]] == sample(logits[[0, 2]], rows([0, 2])).token_ids


@pytest.mark.skipif(not cpu_kernels.fused_enabled(), reason="our CPU kernels do not build here")
@given(rows=st.integers(1, 5), vocab=st.integers(1, 3000), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=80, deadline=None)
def test_top_k_kernel_keeps_the_k_largest_and_their_ties(rows, vocab, kind, seed, data):
    """Our sort-free top-k keeps every logit >= the row's k-th largest, as the torch path does."""
    g = torch.Generator().manual_seed(seed)
    logits = _logits(g, rows, vocab, kind)
    ks = data.draw(st.lists(st.integers(0, vocab + 2), min_size=rows, max_size=rows))
    got = cpu_kernels.top_k_mask(logits.clone(), torch.tensor(ks))
    for r, k in enumerate(ks):
        expect = logits[r]
        if 0 < k < vocab:  # below the k-th largest: -inf; equal to it: kept
            expect = expect.masked_fill(expect < expect.topk(k).values[-1], float("-inf"))
        assert torch.equal(got[r], expect)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_tokens_follow_the_distribution(temperature):
    """Frequencies of 20,000 draws match softmax(logits / T), zero-probability tokens (here
    masked to -inf) included, within 4 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, 3.0, -2.0]])
    n = 20_000
    gen = torch.Generator().manual_seed(7)
    rows = [SamplingRow("r", SamplingParams(temperature=temperature), [], [], frozenset(), gen) for _ in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits.repeat(n, 1), rows).token_ids), minlength=8).double()
    p = (logits[0].double() / temperature).softmax(-1)
    assert counts[4] == 0
    assert ((counts / n - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12).all(), (counts / n, p)


def test_greedy_is_argmax_and_mixed_batches_work():
    logits = torch.randn(4, 50)
    rows = [_row(temperature=0.0), _row(temperature=0.8, top_k=1), _row(temperature=0.0), _row(temperature=0.0)]
    out = sample(logits, rows).token_ids
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()
    assert out[1] == logits[1].argmax().item()  # top_k=1 leaves only the argmax


def test_bfloat16_logits_sample_as_their_float32_copy():
    """A decode step hands the sampler the head's bfloat16 logits: a batch that only takes
    argmaxes reads them as they are, any other row (sampling, logprobs, penalties, bias) gets
    them widened first, so every row's token and logprobs are the float32 copy's."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=g) * 3).bfloat16()
    logits[0, 7] = logits[0, 250] = logits[0].max() + 1  # a tie: the first index wins either way

    def rows():
        return [_row(temperature=0.0), _row(temperature=0.0, logprobs=3), _row(temperature=0.7, seed=5),
                _row(temperature=0.0, repetition_penalty=1.5), _row(temperature=0.0, logit_bias={11: 4.0}),
                _row(temperature=0.0)]

    def gen(rs):  # seeded rows draw from their own generator, as the runner gives them
        for r in rs:
            if r.params.seed is not None:
                r.generator = torch.Generator().manual_seed(r.params.seed)
        return rs

    greedy_only = [_row(temperature=0.0), _row(temperature=0.0)]
    assert sample(logits[[0, 5]], greedy_only).token_ids == logits[[0, 5]].float().argmax(-1).tolist()
    assert sample(logits[[0]], greedy_only[:1]).token_ids == [7]
    a, b = sample(logits, gen(rows())), sample(logits.float(), gen(rows()))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = SamplingRow("r", SamplingParams(repetition_penalty=2.0), [0], [1], frozenset(), None)
    x = logits.clone()
    apply_penalties(x, [r])
    assert x.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive logits divided, negative multiplied
    r = SamplingRow("r", SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3], [2, 2, 0], frozenset(), None)
    x = logits.clone()
    apply_penalties(x, [r])
    # token 2 seen twice: 1 - 0.25*2 - 0.5 ; token 0 once: 2 - 0.25 - 0.5 ; prompt-only token 3 untouched
    assert x.tolist() == [[1.25, -2.0, 0.0, 0.5]]


def test_logprobs_report_rank_and_top_n():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sample(logits, [_row(temperature=0.0, logprobs=2)])
    lp, rank, top = out.logprobs[0]
    assert out.token_ids == [1] and rank == 1
    assert [t for t, _ in top] == [1, 3]
    assert abs(lp - logits.log_softmax(-1)[0, 1].item()) < 1e-6


def test_logit_bias_and_allowed_token_ids_steer_greedy_and_sampled_rows():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    rows = [_row(temperature=0.0, logit_bias={3: 5.0}),  # 0 + 5 beats 3
            _row(temperature=0.0, logit_bias={0: -100.0}, logprobs=1),  # the argmax is banned
            _row(temperature=0.0)]  # an unconstrained row in the same batch is untouched
    out = sample(logits, rows)
    assert out.token_ids == [3, 1, 0]
    # logprobs are the model's raw distribution, not the biased one (as vLLM reports them)
    assert abs(out.logprobs[1][0] - logits.log_softmax(-1)[1, 1].item()) < 1e-6
    assert _draws(logits[:1], allowed_token_ids=[2, 3]) == {2, 3}
    assert _draws(logits[:1], temperature=0.0, allowed_token_ids=[1, 2]) == {1}


def test_token_ids_in_sampling_params_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[0, 3]).check_vocab(4)
    for kw in ({"logit_bias": {4: 1.0}}, {"allowed_token_ids": [1, 9]}):
        with pytest.raises(SamplingParamError) as e:
            SamplingParams(**kw).check_vocab(4)
        assert e.value.param == next(iter(kw)) and "vocabulary" in str(e.value)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("min_p", 1.5),
                                         ("max_tokens", 0), ("n", 0), ("repetition_penalty", 0.0),
                                         ("presence_penalty", 3.0), ("logprobs", 50),
                                         ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}),
                                         ("allowed_token_ids", []), ("allowed_token_ids", [-2])])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_seed_reproducible_whatever_else_is_in_the_batch(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=128)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["hello world"], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate(["a different prompt", "hello world", "x = 1"], [others, sp, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["hello world"] * 2, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # real randomness otherwise


def test_a_row_that_breaks_the_sampler_is_named():
    """The runner samples each row alone when the batch fails, so the engine can fail that
    request and nobody else (ids past the vocabulary get past no validation of ours, but a
    logits processor or a checkpoint with a smaller head could produce the same)."""
    from tokenloom.runner.model_runner import RequestError, _sample_or_blame

    good = SamplingRow("good", SamplingParams(temperature=0), [], [], frozenset(), None)
    bad = SamplingRow("bad", SamplingParams(temperature=0), [], [], frozenset(), None)
    bad.params.allowed_token_ids = [500]  # past this 100-token vocabulary
    logits = torch.randn(2, 100)
    assert _sample_or_blame(logits.clone(), [good, good]).finish().token_ids == logits.argmax(-1).tolist()
    with pytest.raises(RequestError) as err:
        _sample_or_blame(logits.clone(), [good, bad])
    assert err.value.request_id == "bad"


@pytest.mark.skipif(not cpu_kernels.fused_enabled(), reason="our CPU kernels do not build here")
@given(rows=st.integers(1, 4), vocab=st.integers(1, 3000), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=80, deadline=None)
def test_logprob_rows_kernel_ranks_and_tops_as_the_definition(rows, vocab, kind, seed, data):
    """Our one-pass kernel (rank of a target and the top n of each row) against a stable
    descending sort: the same top tokens in the same order (equal logits by index), the same
    ranks; and logprobs = logits - logsumexp, as PyTorch's log_softmax gives them."""
    from tokenloom.runner.logprobs import logprob_rows

    g = torch.Generator().manual_seed(seed)
    logits = _logits(g, rows, vocab, kind)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    n = data.draw(st.integers(0, min(vocab, 20)))
    ranks, ids, vals = cpu_kernels.logprob_rows(logits, targets, n)
    order_vals, order_ids = logits.sort(dim=1, descending=True, stable=True)
    assert torch.equal(ids, order_ids[:, :n]) and torch.equal(vals, order_vals[:, :n])
    target_logits = logits.gather(1, targets.unsqueeze(1))
    assert torch.equal(ranks, (logits > target_logits).sum(dim=1) + 1)
    found = logprob_rows(logits, targets, n)
    lps = logits.log_softmax(dim=-1)
    finite = target_logits.squeeze(1) > float("-inf")
    torch.testing.assert_close(found.token[finite], lps.gather(1, targets.unsqueeze(1)).squeeze(1)[finite],
                               atol=1e-5, rtol=0)
    top_ok = vals > float("-inf")
    torch.testing.assert_close(found.top[top_ok], lps.gather(1, ids)[top_ok], atol=1e-5, rtol=0)


def test_logprob_rows_without_our_kernel_agree(monkeypatch):
    """The PyTorch path (GPUs, CPUs without our kernels) reports what the kernel does."""
    from tokenloom.runner.logprobs import logprob_rows

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 5000, generator=g) * 4
    targets = torch.randint(0, 5000, (6,), generator=g)
    ours = logprob_rows(logits, targets, 7)
    monkeypatch.setattr(cpu_kernels, "logprob_rows", lambda *a: None)
    theirs = logprob_rows(logits, targets, 7)
    assert torch.equal(ours.rank, theirs.rank) and torch.equal(ours.top_ids, theirs.top_ids)
    torch.testing.assert_close(ours.token, theirs.token, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.top, theirs.top, atol=1e-5, rtol=0)
