"""N-gram speculative decoding: the proposer, exact greedy outputs, the sampled distribution,
KV bookkeeping under rollback, stop rules part-way through accepted drafts, and metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from server_fixtures import ThreadedServer, metric
from tokenloom import LLM, SamplingParams
from tokenloom.bench.launcher import free_port
from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager, hash_block, root_key
from tokenloom.core.scheduler import Scheduler
from tokenloom.model.tools.tokenizer_builder import default_tokenizer, save_hf_tokenizer
from tokenloom.request import Request
from tokenloom.runner.sampler import SamplingRow
from tokenloom.spec_decode import SpeculativeConfig, propose_ngram
from tokenloom.spec_decode.verify import verify

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- the proposer -------------------------------------------------------------------------

def _brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, spelled out: longest suffix first, most recent earlier occurrence."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                ext = list(tokens)  # followers past the end repeat with the match's period
                while len(ext) < i + n + k:
                    ext.append(ext[len(ext) - (L - i - n)])
                return ext[i + n:i + n + k]
    return []


def test_proposer_examples():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=2, max_n=3, min_n=1) == [3, 4]
    # the longest suffix wins over a more recent shorter match: [7, 8] follows "5 6", [9] only "6"
    assert propose_ngram([5, 6, 7, 8, 6, 9, 5, 6], k=2, max_n=2, min_n=1) == [7, 8]
    # among equal lengths, the most recent occurrence
    assert propose_ngram([1, 2, 3, 1, 2, 4, 1, 2], k=1, max_n=2, min_n=2) == [4]
    assert propose_ngram([1, 2, 3, 4], k=3, max_n=3, min_n=1) == []  # nothing recurs
    assert propose_ngram([3, 9, 3], k=5, max_n=3, min_n=2) == []  # only a 1-gram recurs
    assert propose_ngram([3, 9, 3], k=5, max_n=3, min_n=1) == [9, 3, 9, 3, 9]  # past the end: periodic
    assert propose_ngram([7, 7, 7], k=4, max_n=3, min_n=1) == [7, 7, 7, 7]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], k=5, max_n=2, min_n=2) == [3, 1, 2, 3, 1]


def test_proposer_matches_the_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        max_n = rng.randrange(1, 6)
        min_n = rng.randrange(1, max_n + 1)
        k = rng.randrange(1, 6)
        assert propose_ngram(toks, k, max_n, min_n) == _brute_force(toks, k, max_n, min_n), (toks, k, max_n, min_n)


def test_config_validation():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (4, 3, 2)
    assert SpeculativeConfig.parse(None) is None
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                       "prompt_lookup_min": 3}, "must not exceed"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
                     ({"method": "ngram"}, "needs"),
                     ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="not supported"):  # before any model is loaded
        LLM("/nonexistent", speculative_config={"method": "medusa", "num_speculative_tokens": 2})


# ---- scheduler: budget, rollback, stop rules part-way ---------------------------------------

def _sched(budget=64, blocks=32, bs=4):
    kv = KVCacheManager(blocks, bs, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64), kv), kv


def _req(rid, prompt, max_tokens=20, eos=frozenset({2})):
    return Request(rid, list(prompt), SamplingParams(temperature=0), 0.0, eos_token_ids=eos, max_tokens=max_tokens)


def _to_decode(sched, req, first_token=9):
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: first_token})


def test_rejected_drafts_roll_back_and_blocks_stay_exact():
    sched, kv = _sched()
    req = _req("a", [5, 6, 7, 8, 5, 6, 7])  # 7 tokens
    sched.add_request(req)
    _to_decode(sched, req)  # 8 tokens, 7 computed, 2 blocks
    req.spec_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.phase, s.num_new_tokens, s.spec_token_ids) == ("decode", 6, [11, 12, 13, 14, 15])
    assert len(kv.block_ids("a")) == 4  # slots for positions 7..12
    sched.update_from_output(out, {"a": 20}, accepted={"a": [11]})
    assert req.output_token_ids == [9, 11, 20] and req.num_computed_tokens == 9 and req.num_tokens == 10
    assert len(kv.block_ids("a")) == 3  # the rejected drafts' block went back
    # prefix-cache keys cover accepted tokens only: both full blocks hash what the request holds
    parent = root_key(None)
    for i, key in enumerate(req.block_hashes[:2]):
        parent = hash_block(parent, req.token_slice(4 * i, 4 * i + 4))
        assert key == parent
        assert kv.tables["a"][i].block_hash == key
    sched.finish_request("a", req.status.FINISHED_ABORTED)
    assert kv.pool.num_free == kv.num_blocks


def test_stop_token_inside_accepted_drafts_drops_the_rest():
    sched, kv = _sched()
    req = _req("a", [5, 6, 7])
    sched.add_request(req)
    _to_decode(sched, req)
    req.spec_token_ids = [3, 2, 4]  # 2 is EOS
    out = sched.schedule()
    finished = sched.update_from_output(out, {"a": 8}, accepted={"a": [3, 2, 4]})
    assert finished == [req] and req.output_token_ids == [9, 3, 2] and req.status.value == "stop"
    assert out.scheduled[0].emitted == [3, 2]
    assert kv.pool.num_free == kv.num_blocks


def test_max_tokens_cuts_accepted_drafts():
    sched, kv = _sched()
    req = _req("a", [5, 6, 7], max_tokens=3)
    sched.add_request(req)
    _to_decode(sched, req)
    req.spec_token_ids = [3, 4, 5]
    out = sched.schedule()
    sched.update_from_output(out, {"a": 8}, accepted={"a": [3, 4, 5]})
    assert req.output_token_ids == [9, 3, 4] and req.status.value == "length"
    assert kv.pool.num_free == kv.num_blocks


def test_drafts_count_in_the_budget_and_never_starve_a_decode():
    sched, kv = _sched(budget=4)
    reqs = [_req(r, [5, 6, 7]) for r in "abc"]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # 3 prompts of 3 tokens, budget 4: chunks
    while any(r.num_output_tokens == 0 for r in reqs):
        sched.update_from_output(out, {s.request_id: 9 for s in out.scheduled if s.sample})
        out = sched.schedule()
    for r in reqs:
        r.spec_token_ids = [1, 1, 1]
    out = sched.schedule()
    assert out.num_batched_tokens <= 4
    assert sorted(s.request_id for s in out.scheduled) == ["a", "b", "c"]  # every decode served
    assert [len(s.spec_token_ids) for s in out.scheduled] == [1, 0, 0]


# ---- verification: greedy exactness and the sampled distribution ----------------------------

def _row(temperature=1.0, **kw):
    return SamplingRow("r", SamplingParams(temperature=temperature, **kw), [1], [], frozenset(), None)


def test_greedy_verification():
    logits = torch.full((4, 8), -5.0)
    for j, t in enumerate([3, 4, 6, 1]):
        logits[j, t] = 5.0
    (v,) = verify(logits, [_row(0.0)], [[3, 4, 5]])
    assert (v.accepted, v.token) == ([3, 4], 6)  # the argmax replaces the first mismatch
    (v,) = verify(logits, [_row(0.0)], [[3, 4, 6]])
    assert (v.accepted, v.token) == ([3, 4, 6], 1)  # all accepted: the bonus token


def test_rejection_sampling_preserves_the_target_distribution():
    """Each emitted position is distributed as the target p (after temperature and top-k),
    whatever the draft: chi-square against the expected counts, with a fixed seed."""
    torch.manual_seed(0)
    V, N = 6, 12000
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 1.0, 1.0, -0.5, 0.3],
                         [1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    params = dict(temperature=0.8, top_k=5)
    p = [torch.softmax(torch.where(b < b.topk(5).values[-1], float("-inf"), b) / 0.8, 0) for b in base]
    draft = [0, 1]  # a likely first token and a likely second one
    logits = base.repeat(N, 1)
    out = verify(logits, [_row(**params)] * N, [draft] * N)
    first = torch.bincount(torch.tensor([v.accepted[0] if v.accepted else v.token for v in out]), minlength=V)
    # given the first draft was accepted, the second emitted token follows row 1's p
    second = torch.bincount(torch.tensor([v.accepted[1] if len(v.accepted) > 1 else v.token
                                          for v in out if v.accepted]), minlength=V)
    for counts, probs in ((first, p[0]), (second, p[1])):
        keep = probs > 0
        assert counts[~keep].sum() == 0  # the top-k-masked token is never emitted
        exp = probs[keep].double() / probs[keep].double().sum() * counts.sum().double()
        assert chisquare(counts[keep].double().numpy(), exp.numpy()).pvalue > 1e-3
    accepted_first = sum(1 for v in out if v.accepted) / N
    assert abs(accepted_first - p[0][0].item()) < 4 * (p[0][0].item() * (1 - p[0][0].item()) / N) ** 0.5


# ---- the engine: outputs identical on and off ------------------------------------------------

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A random-weight Llama saved by transformers (fp32, with a tokenizer).  At this weight
    scale its greedy output falls into short loops now and then: drafts get accepted as
    well as rejected."""
    out = tmp_path_factory.mktemp("spec-llama")
    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if not name.endswith("norm.weight"):
                prm.normal_(0.0, 0.1)
    model.save_pretrained(out)
    save_hf_tokenizer(default_tokenizer(1024), out, model_max_length=256)
    return out


def _prompts() -> list[list[int]]:
    g = random.Random(1)
    out = []
    for n in (5, 17, 30, 9, 40, 12):
        seg = [g.randrange(5, 1000) for _ in range(n)]
        out.append(seg + seg[: n // 2] + [g.randrange(5, 1000)] + seg)  # text that repeats: drafts to try
    return out


STRESS = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=60, max_model_len=200)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_greedy_outputs_identical_with_and_without_speculation(hf_checkpoint, backend):
    """Batched, with chunked prefill beside the drafts, and with preemption."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(str(hf_checkpoint), attention_backend=backend, **STRESS).generate(prompts, sp, use_tqdm=False)
    events = []
    llm = LLM(str(hf_checkpoint), observers=[events.append], speculative_config={**SPEC, "disable_by_batch_size": 8},
              attention_backend=backend, **STRESS)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    drafted = sum(e.num_draft_tokens for e in events)
    accepted = sum(e.num_accepted_tokens for e in events)
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    assert any(len(en.draft_token_ids) and en.phase == "decode" for ev in events for en in ev.entries
               if any(x.phase == "prefill_chunk" for x in ev.entries))  # drafts beside prefill chunks
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(ev.num_batched_tokens <= 24 for ev in events)
    assert sum(ev.num_generated_tokens for ev in events) == sum(len(o.outputs[0].token_ids) for o in outs)
    assert llm.llm_engine.kv.pool.num_free == 60  # every block returned


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verifying_steps_replay_the_decode_graphs(hf_checkpoint, dtype):
    """A decode-only step with drafts is 1 + k decode rows a request: on a CPU it replays the
    op list recorded for that many rows (runner/cpu_graphs.py), and gives exactly what the
    eager forward gives -- greedy tokens, and sampled requests' draws (the global generator
    seeded alike; the verifier widens their rows from the head's dtype) -- under preemption,
    with every block returned."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.runner.cpu_graphs import CpuDecodeGraphs

    if not cpu_kernels.graph_enabled():
        pytest.skip("the op-list replayer did not build here")
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = {**SPEC, "disable_by_batch_size": 8}
    got = {}
    for eager in (True, False):
        llm = LLM(str(hf_checkpoint), dtype=dtype, speculative_config=spec, enforce_eager=eager, max_model_len=200,
                  block_size=4, num_kv_blocks=52, max_num_batched_tokens=24)
        graphs = llm.llm_engine.runner.graphs
        rows: list[int] = []
        if not eager:
            assert isinstance(graphs, CpuDecodeGraphs)
            run = graphs.run
            graphs.run = lambda ids, *a: rows.append(len(ids)) or run(ids, *a)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        torch.manual_seed(5)  # the sampled requests' draws (a request with its own seed is not drafted)
        sampled = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)
        got[eager] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in sampled])
        assert llm.llm_engine.kv.pool.num_free == 52 and llm.llm_engine.scheduler.num_preemptions > 0
        if not eager:
            # steps of more rows than requests ran: verifying steps, replayed from recorded lists
            assert max(rows) > len(prompts) and not graphs.eager
            assert any(n > len(prompts) for n in graphs.lists)
    assert got[False] == got[True]


def test_verifying_steps_replay_with_one_sequence_at_a_time(hf_checkpoint):
    """--max-num-seqs 1: the CPU graphs are sized for the drafts' rows too (1 + k), so a
    verifying step still replays; the same greedy tokens as without speculation."""
    from tokenloom.kernels import cpu as cpu_kernels

    if not cpu_kernels.graph_enabled():
        pytest.skip("the op-list replayer did not build here")
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(max_num_seqs=1, max_model_len=200, num_kv_blocks=100)
    ref = LLM(str(hf_checkpoint), **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(hf_checkpoint), speculative_config=SPEC, **kw)
    graphs = llm.llm_engine.runner.graphs
    assert graphs.max_size == 1 + SPEC["num_speculative_tokens"]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert any(n > 1 for n in graphs.lists) and not graphs.eager


def test_speculation_turns_off_above_the_batch_size(hf_checkpoint):
    events = []
    llm = LLM(str(hf_checkpoint), observers=[events.append], speculative_config={**SPEC, "disable_by_batch_size": 2},
              max_model_len=200, num_kv_blocks=100)
    llm.generate([{"prompt_token_ids": p} for p in _prompts()[:3]],
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 40, 40)], use_tqdm=False)
    assert len(events[0].entries) == 3  # all three admitted at once
    assert all(ev.num_draft_tokens == 0 for ev in events if len(ev.entries) > 2)
    assert any(ev.num_draft_tokens for ev in events)  # once fewer run, drafting resumes


def test_async_scheduling_gives_the_same_tokens(hf_checkpoint):
    """Speculation with --async-scheduling: a step that drafts is scheduled once the previous
    step's tokens are in (its drafts are made from them), the others run ahead of them; the
    same tokens, finish reasons and stop strings as without overlap, drafts accepted and
    rejected, every block returned."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:5]]
    # the batch shrinks from 5 (no drafts: steps ahead) to 2 and 1 (drafts: steps after the tokens)
    params = [SamplingParams(temperature=0, max_tokens=8 + 8 * i, ignore_eos=True) for i in range(5)]
    ref = LLM(str(hf_checkpoint), max_model_len=200, num_kv_blocks=100).generate(prompts, params, use_tqdm=False)
    text = ref[4].outputs[0].text
    cut = next(i for i in range(len(text) * 2 // 3, len(text) - 2) if text.find(text[i:i + 2]) == i)
    params[4] = SamplingParams(temperature=0, max_tokens=40, stop=[text[cut:cut + 2]])
    got, events = {}, {False: [], True: []}
    for on in (False, True):
        llm = LLM(str(hf_checkpoint), observers=[events[on].append], async_scheduling=on, max_model_len=200,
                  num_kv_blocks=100, speculative_config={**SPEC, "disable_by_batch_size": 2})
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[on] = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        assert llm.llm_engine.kv.pool.num_free == 100
        if on:
            assert llm.llm_engine.num_steps_ahead > 0
        accepted = sum(e.num_accepted_tokens for e in events[on])
        assert 0 < accepted < sum(e.num_draft_tokens for e in events[on])
    assert got[True] == got[False]
    # requests ending by length are foreseen: overlap drafts exactly where the plain loop does
    assert [e.num_draft_tokens for e in events[True]] == [e.num_draft_tokens for e in events[False]]
    assert got[False][4][2] == "stop" and got[False][3][2] == "length"
    assert [t for t, _, _ in got[False][:4]] == [list(o.outputs[0].token_ids) for o in ref[:4]]


def test_sampled_requests_with_speculation_finish_and_return_blocks(hf_checkpoint):
    llm = LLM(str(hf_checkpoint), speculative_config={**SPEC, "disable_by_batch_size": 8}, max_model_len=200,
              num_kv_blocks=100)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=25, ignore_eos=True),
                         SamplingParams(temperature=1.0, max_tokens=25, seed=3, ignore_eos=True),  # not drafted
                         SamplingParams(temperature=0, max_tokens=25, logprobs=2, ignore_eos=True)] * 2,
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 25 for o in outs)
    assert len(outs[2].outputs[0].logprobs) == 25
    assert llm.llm_engine.kv.pool.num_free == 100


# ---- /metrics on a real server ----------------------------------------------------------------

def test_spec_decode_metrics_on_the_server(hf_checkpoint):
    server = ThreadedServer([str(hf_checkpoint), "--port", str(free_port()), "--max-model-len", "200",
                             "--num-kv-blocks", "100", "--speculative-config", json.dumps(SPEC),
                             "--log-level", "warning", "--disable-access-log"]).start()
    try:
        base = server.base_url
        assert metric(base, "tokenloom:spec_decode_num_drafts_total") == 0  # exported from the start
        r = httpx.post(base + "/v1/completions", json={"model": str(hf_checkpoint), "prompt": _prompts()[2],
                                                       "max_tokens": 30, "temperature": 0, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        drafts = metric(base, "tokenloom:spec_decode_num_drafts_total")
        draft_tokens = metric(base, "tokenloom:spec_decode_num_draft_tokens_total")
        accepted = metric(base, "tokenloom:spec_decode_num_accepted_tokens_total")
        per_pos = metric(base, "tokenloom:spec_decode_num_accepted_tokens_per_pos_total")
        assert drafts > 0 and draft_tokens >= drafts and accepted == per_pos
        assert metric(base, "tokenloom:generation_tokens_total") == 30
    finally:
        server.stop()


# ---- the simulator ------------------------------------------------------------------------------

def test_simulator_knows_accepted_tokens_per_step():
    from tokenloom.measure.workloads import BenchRequest
    from tokenloom.sim.estimate import CostModel
    from tokenloom.sim.simulator import SimConfig, Simulator
    from tokenloom.specs.hardware import Hardware
    from tokenloom.specs.model_spec import ModelSpec

    spec = ModelSpec.from_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                                  "intermediate_size": 16, "vocab_size": 32}, "toy")
    hw = Hardware("toy", 10**6, 1000.0, {"float16": 1e4, "bfloat16": 1e4, "float32": 5e3}, "test")
    cm = CostModel(spec, hw, "float16", mem_efficiency=1.0, compute_efficiency=1.0, overhead_s=0.01)
    base = dict(max_model_len=128, block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    reqs = [BenchRequest(list(range(5, 15)), 41, 0.0)]
    runs = {}
    for name, extra in (("off", {}), ("on", dict(num_speculative_tokens=4, spec_mean_accepted=3.0))):
        events = []
        res = Simulator(cm, SimConfig(**base, **extra), observers=[events.append]).run(reqs)
        runs[name] = (res, events)
    (off, ev_off), (on, ev_on) = runs["off"], runs["on"]
    assert sum(e.num_generated_tokens for e in ev_on) == sum(e.num_generated_tokens for e in ev_off) == 41
    # one step for the prompt and its first token, then 4 tokens a step: 40 more in 10 steps
    assert (len(ev_off), len(ev_on)) == (41, 11)
    assert sum(e.num_accepted_tokens for e in ev_on) == 30
    assert on.duration_s < off.duration_s


def test_stop_string_inside_accepted_drafts(hf_checkpoint):
    """A stop string completed by an accepted draft ends the request there, exactly as without
    speculation: same text, same tokens (the drafts after it dropped)."""
    kw = dict(max_model_len=200, num_kv_blocks=100)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    plain = LLM(str(hf_checkpoint), **kw)
    spec = LLM(str(hf_checkpoint), speculative_config={**SPEC, "disable_by_batch_size": 8}, **kw)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in free]  # text from mid-output
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s]) for s in stops]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in b] == \
           [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in a]
    assert sum(o.outputs[0].finish_reason == "stop" for o in a) >= 3
    assert spec.llm_engine.kv.pool.num_free == 100
