"""Beam search (`LLM.beam_search`, `use_beam_search` on /v1/completions) against transformers.

transformers' `generate(num_beams=B, num_return_sequences=B, do_sample=False, length_penalty,
early_stopping)` on the same weights is the reference: the same B sequences, in the same
order, with the same scores, for every early_stopping mode, positive, zero-ish and negative
length penalties, with and without EOS.  The tiny model's EOS ids are set to the tokens its
beams produce most, so sequences do end early and the stopping rules are exercised.  The
engine runs with chunked prompts, tiny blocks and too little KV cache for everything at
once, so beams are preempted and their searches restart; the beams share their prompt's KV
blocks (copied on write), and every block is back in the pool afterwards.
"""

from __future__ import annotations

import collections
import json
import math
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server_fixtures import ThreadedServer, wait_until
from tokenloom import LLM
from tokenloom.bench.launcher import free_port
from tokenloom.request import Request
from tokenloom.sampling_params import BeamSearchParams, SamplingParams

PROMPT_LENS = (5, 13, 22, 9)
# (beam_width, length_penalty, early_stopping, max_tokens, ignore_eos)
CASES = [(3, 1.0, False, 12, False), (4, 0.5, True, 10, False), (2, 2.0, "never", 8, False),
         (3, -1.0, False, 9, False), (4, 1.0, "never", 10, False), (3, 1.0, False, 8, True)]
# 16-token steps (prompts chunk), 4-token blocks, 34 blocks: not all searches fit at once
STRESS = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=34, max_model_len=64)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_beams(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float, early_stopping,
             eos: list[int] | None) -> tuple[list[list[int]], list[float]]:
    """transformers' B best sequences (generated tokens) and their scores, best first."""
    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                        max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                        eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    lens = (r.beam_indices + 1).bool().sum(1)  # each returned sequence's generated length
    n = len(prompt)
    return [r.sequences[i, n:n + int(lens[i])].tolist() for i in range(width)], r.sequences_scores.tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, object, list[int]]:
    """A tiny Llama whose generation_config names as EOS the two tokens its beams produce most."""
    from tokenloom.model.tools.make_model import make_model

    base = make_model("tiny-llama", tmp_path_factory.mktemp("beam") / "tiny")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    seen: collections.Counter = collections.Counter()
    for p in _prompts():
        seqs, _ = hf_beams(hf, p, 4, 10, 1.0, False, None)
        for s in seqs:
            seen.update(s[2:])
    eos = [t for t, _ in seen.most_common(2)]
    path = tmp_path_factory.mktemp("beam") / "tiny-eos"
    shutil.copytree(base, path)
    gen = path / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return path, hf, eos


def test_beam_search_matches_transformers(model):
    path, hf, eos = model
    llm = LLM(str(path), **STRESS)
    assert set(llm.llm_engine.eos_token_ids) == set(eos)
    prompts = _prompts()
    reasons: collections.Counter = collections.Counter()
    for width, lp, early, max_tokens, ignore_eos in CASES:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=lp, early_stopping=early,
                                  ignore_eos=ignore_eos)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for p, out in zip(prompts, outs):
            ref, ref_scores = hf_beams(hf, p, width, max_tokens, lp, early, None if ignore_eos else eos)
            case = (width, lp, early, max_tokens, ignore_eos, len(p))
            assert [s.output_token_ids for s in out.sequences] == ref, case
            for s, score in zip(out.sequences, ref_scores):
                assert math.isclose(s.score, score, rel_tol=1e-4, abs_tol=1e-4), case
                assert s.tokens == p + s.output_token_ids  # vLLM's shape: the prompt included
                ends_eos = not ignore_eos and s.output_token_ids[-1] in eos
                assert s.finish_reason == ("stop" if ends_eos else "length"), case
                assert ends_eos or len(s.output_token_ids) == max_tokens
                reasons[s.finish_reason] += 1
    assert reasons["stop"] and reasons["length"]  # both ways of ending were exercised
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0  # searches lost beams and restarted
    assert engine.kv.num_forks > 0 and engine.kv.num_copies > 0
    assert engine.kv.pool.num_free == STRESS["num_kv_blocks"]  # every block returned


def test_beams_share_the_prompt_blocks_and_copy_on_write(model):
    """Four beams forked from one prompt hold its blocks together; each beam's first write
    into the shared, partly filled last block copies it (the last holder writes in place)."""
    path, hf, eos = model
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=64)
    engine, kv = llm.llm_engine, llm.llm_engine.kv
    prompt = _prompts()[1][:10]  # 10 tokens: two full blocks and one holding 2 tokens
    engine.add_request("q", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=6,
                                                                            ignore_eos=True))
    engine.step()  # the prompt, then the fork into 4 beams
    beams = [f"q-beam{i}" for i in range(4)]
    tables = [kv.block_ids(b) for b in beams]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert [kv.pool.blocks[b].ref_cnt for b in tables[0]] == [4, 4, 4] and kv.pool.num_used == 3
    engine.step()  # every beam writes position 10 into the shared third block: three copy it first
    assert kv.num_copies == 3
    # then the beams moved onto their parents' sequences: blocks shared again, counted exactly
    tables = [kv.block_ids(b) for b in beams]
    assert all(t[:2] == tables[0][:2] for t in tables)  # the full blocks stayed shared throughout
    held = collections.Counter(b for t in tables for b in t)
    assert {b: kv.pool.blocks[b].ref_cnt for b in held} == dict(held)
    assert kv.pool.num_used == len(held)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    ref, _ = hf_beams(hf, prompt, 4, 6, 1.0, False, None)
    assert [c.token_ids for c in done[0].outputs] == ref
    assert kv.pool.num_free == kv.num_blocks


def test_speculative_decoding_leaves_beams_alone(model):
    """n-gram drafting is on for the engine, but a beam takes no drafts (its next token is
    the search's choice); ordinary requests beside it keep drafting."""
    path, hf, eos = model
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_model_len=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    p = _prompts()[2]
    (out,) = llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(beam_width=3, max_tokens=8))
    assert [s.output_token_ids for s in out.sequences] == hf_beams(hf, p, 3, 8, 1.0, False, eos)[0]
    assert llm.llm_engine.kv.pool.num_free == 64
    # the rule itself: a sequence whose last token repeats gets drafts, unless it is a beam
    engine = llm.llm_engine
    seq = [5, 6, 7, 8, 5, 6, 7]
    for topk, drafted in ((0, True), (6, False)):
        req = Request(request_id=f"r{topk}", prompt_token_ids=seq[:-1], sampling_params=SamplingParams(temperature=0),
                      arrival_time=0.0, max_tokens=16, beam_topk=topk)
        req.output_token_ids, req.num_computed_tokens = [seq[-1]], len(seq) - 1
        engine.proposer.propose([req])
        assert bool(req.spec_token_ids) == drafted


def test_two_tensor_parallel_ranks_copy_the_same_blocks(model):
    """Every rank holds its heads of each KV block: rank 1 makes the copy-on-write copies
    rank 0 makes (they travel with the step), or its beams would read another beam's K/V."""
    path, hf, eos = model
    llm = LLM(str(path), tensor_parallel_size=2, block_size=4, num_kv_blocks=64, max_model_len=64)
    try:
        prompts = _prompts()[:2]
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=8))
        for p, out in zip(prompts, outs):
            assert [s.output_token_ids for s in out.sequences] == hf_beams(hf, p, 3, 8, 1.0, False, eos)[0]
        assert llm.llm_engine.kv.num_copies > 0
    finally:
        llm.shutdown()


def test_bad_beam_settings_name_the_field(model):
    path, _, _ = model
    llm = LLM(str(path), block_size=4, num_kv_blocks=34, max_model_len=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=5, max_tokens=4))  # more beams than seats
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=4, max_tokens=60))  # 4 x 16 blocks > 34
    for kw, field in ((dict(beam_width=0), "beam_width"), (dict(temperature=0.7), "temperature"),
                      (dict(length_penalty=11.0), "length_penalty"), (dict(early_stopping="sometimes"),
                                                                      "early_stopping")):
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    assert llm.llm_engine.kv.pool.num_free == 34


# ---- the server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model):
    path, _, _ = model
    srv = ThreadedServer([str(path), "--port", str(free_port()), "--max-model-len", "64", "--block-size", "4",
                          "--num-kv-blocks", "48", "--max-num-batched-tokens", "24", "--max-num-seqs", "4",
                          "--served-model-name", "tiny", "--log-level", "warning", "--disable-access-log"]).start()
    yield srv
    srv.stop()


def _idle(srv) -> bool:
    snap = srv.engine.snapshot()
    return snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_cache_usage == 0


def test_server_use_beam_search_matches_transformers(server, model):
    _, hf, eos = model
    tok = server.engine.tokenizer
    prompts = _prompts()[:3]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    r = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=8, extra_body=extra)
    chunks = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=8, extra_body=extra,
                                       stream=True)
    streamed: dict[int, str] = collections.defaultdict(str)
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    completion_tokens = 0
    for i, p in enumerate(prompts):
        ref, _ = hf_beams(hf, p, 3, 8, 0.5, False, eos)
        for j, seq in enumerate(ref):
            choice = r.choices[i * 3 + j]
            assert choice.index == i * 3 + j
            assert choice.text == streamed[i * 3 + j] == tok.decode(seq, skip_special_tokens=True)
            assert choice.finish_reason == ("stop" if seq[-1] in eos else "length")
            completion_tokens += len(seq)
    assert r.usage.completion_tokens == completion_tokens
    assert wait_until(lambda: _idle(server), 10)


@pytest.mark.parametrize("extra,param", [
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"stop": ["a"]}, "stop"),
    ({"min_tokens": 2}, "min_tokens"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"guided_choice": ["a"]}, "guided_choice"), ({"n": 5}, "n"), ({"max_tokens": 60, "n": 4}, "n"),
    ({"length_penalty": 11}, "length_penalty"),
])
def test_server_refuses_what_beam_search_cannot_honour(server, extra, param):
    body = {"prompt": "hello", "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_generation_server_has_no_embeddings(server):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_route"
    assert "/v1/embeddings" not in httpx.get(server.base_url + "/openapi.json").json()["paths"]
    assert wait_until(lambda: _idle(server), 10)
