"""Correctness proven against Hugging Face transformers on identical weights.

Greedy tokens must be identical and log-probabilities within 1e-4, for every supported
family, under continuous batching with forced chunked prefill, tiny KV blocks and
preemption (too few blocks for all requests at once)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenloom import LLM, SamplingParams

FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]
PROMPT_LENS = (3, 17, 40, 9, 64, 25)
NEW_TOKENS = 32


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


# Settings that force every hard path at once: 24-token budget (prompts chunk and mix
# with decodes), 4-token blocks, and 30 blocks for six requests needing up to 24 each.
STRESS = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=30, max_model_len=100)


@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_tokens_match_transformers_under_chunking_and_preemption(model_factory, preset):
    path = model_factory(preset)
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    events = []
    llm = LLM(str(path), observers=[events.append], **STRESS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # the settings really exercised chunking, mixed batches and preemption
    assert any(e.phase == "prefill_chunk" for ev in events for e in ev.entries)
    assert any({e.phase for e in ev.entries} >= {"decode", "prefill_chunk"} for ev in events)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(ev.num_batched_tokens <= 24 for ev in events)
    assert llm.llm_engine.kv.pool.num_free == 30  # every block returned


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_logprobs_match_transformers(model_factory, preset):
    path = model_factory(preset)
    prompts = _prompts(1)
    hf = _hf(path)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=20, prompt_logprobs=3),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        # prompt logprobs: position j holds log p(prompt[j] | prompt[:j])
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            got = o.prompt_logprobs[j][p[j]].logprob
            assert abs(got - ref[j - 1, p[j]].item()) < 1e-4
        # first generated step: top-20 logprobs equal the reference's
        first = o.outputs[0].logprobs[0]
        top = ref[-1].topk(20)
        for tok, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(first[tok].logprob - val) < 1e-4
        assert o.outputs[0].token_ids[0] == top.indices[0].item()


def test_sharded_checkpoint_and_bfloat16(model_factory):
    """A sharded safetensors checkpoint loads; bfloat16 stays close to transformers' bfloat16,
    prefill and decode."""
    path = model_factory("tiny-qwen2", max_shard_bytes=200_000)
    assert (path / "model.safetensors.index.json").exists()
    prompts = _prompts(2)[:3]
    ref32 = _hf_greedy(_hf(path), prompts, 8)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref32

    hf16 = _hf(path, torch.bfloat16)
    llm16 = LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    p = prompts[0]
    # the prefill's token and three decode steps (the decode path: fused ops, paged attention)
    o = llm16.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    for i, step in enumerate(o.logprobs):
        with torch.no_grad():
            ref = hf16(torch.tensor([p + o.token_ids[:i]])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in step.items():
            assert abs(lp.logprob - ref[tok].item()) < 0.1  # bf16: ~3 significant digits


def test_prefix_cache_hits_under_pressure_match_transformers(model_factory):
    """Prompts sharing long prefixes, submitted in two waves: the second wave hits the prefix
    cache (fewer tokens scheduled, seen in step events), memory pressure evicts cached blocks,
    and every output still equals transformers'."""
    path = model_factory("tiny-qwen2")
    g = torch.Generator().manual_seed(3)
    head = torch.randint(5, 1000, (37,), generator=g).tolist()
    prompts = [head + torch.randint(5, 1000, (n,), generator=g).tolist() for n in (1, 6, 11, 3)]
    ref = _hf_greedy(_hf(path), prompts, 16)
    events = []
    llm = LLM(str(path), observers=[events.append], **STRESS)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)
    events.clear()
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert rest[0].num_cached_tokens == 36  # 9 full blocks of 4 shared with the first prompt
    # the step events show the hit: the request's first scheduled chunk starts at the cached length
    rid = rest[0].request_id
    first_entry = next(e for ev in events for e in ev.entries if e.request_id == rid)
    assert first_entry.kv_len_before == 36
    eng = llm.llm_engine
    assert eng.kv.pool.num_evictions > 0 and eng.kv.pool.num_free == 30


def test_tied_lm_head_shares_the_embedding_matrix(model_factory):
    """With tied embeddings the packed model holds the vocab matrix once: the lm_head reads
    the embedding in place, and `weight_bytes` (what `bench throughput` sets peak RSS
    against) counts every weight exactly once."""
    from tokenloom.model.weights.loader import load_model
    from tokenloom.model.weights.packed_linear import packing_supported

    path = model_factory("tiny-qwen2")
    loaded = load_model(path, "float32", torch.device("cpu"), max_positions=128)
    m = loaded.model
    a = loaded.args
    assert a.tie_word_embeddings
    if packing_supported(torch.device("cpu"), torch.float32):
        assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    hf = _hf(path)
    n_params = sum(p.numel() for p in hf.parameters())  # HF counts the tied matrix once too
    rope = m.rope.cos.numel() + m.rope.sin.numel()
    assert loaded.weight_bytes == 4 * (n_params + rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_generic_path_matches_transformers_bit_for_bit(dtype):
    """The generic path's rotation (tables made once per step, rotate-half's sign folded into
    the sin table) gives transformers' `apply_rotary_pos_emb` bit for bit."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from tokenloom.model.layers import RotaryEmbedding, rotate

    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 256, 1_000_000.0, None)
    pos = torch.randint(0, 256, (9,), generator=g)
    q = torch.randn(9, 14, 64, generator=g).to(dtype)
    k = torch.randn(9, 2, 64, generator=g).to(dtype)
    cos, sin = rope.cos[pos].to(dtype)[None], rope.sin[pos].to(dtype)[None]  # [1, T, D], as HF casts them
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    out_q, out_k = rope(pos, q, k)
    assert torch.equal(out_q, ref_q[0].transpose(0, 1)) and torch.equal(out_k, ref_k[0].transpose(0, 1))
    qk = torch.cat([q, k], dim=1)  # one pass over q and k together, as the attention layer does
    assert torch.equal(rotate(qk, *rope.at(pos, dtype)), torch.cat([out_q, out_k], dim=1))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_generic_sdpa_decode_path_matches_transformers_on_cpu(model_factory, monkeypatch, preset):
    """TOKENLOOM_CPU_ATTENTION=0 turns our CPU attention kernel off, so the CPU runs the generic
    path (paged KV gathered for torch's SDPA, grouped-query heads included) that devices
    without a faster backend run: greedy tokens still equal transformers' under chunking and
    preemption."""
    from tokenloom.kernels import cpu as cpu_kernels

    path = model_factory(preset)
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    with monkeypatch.context() as m:
        m.setenv("TOKENLOOM_CPU_ATTENTION", "0")
        cpu_kernels.attention_enabled.cache_clear()  # read once per process; read it again
        try:
            llm = LLM(str(path), **STRESS)
        finally:
            cpu_kernels.attention_enabled.cache_clear()
    cpu_kernels.attention_enabled.cache_clear()  # the environment is restored: let the next reader see it
    assert llm.llm_engine.runner.attn.name == "sdpa"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]
