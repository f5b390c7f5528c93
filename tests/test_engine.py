"""Engine behaviour end to end on a tiny model: stops, n > 1, errors, chat, priority, prefix caching."""

from __future__ import annotations

import shutil

import pytest

from tokenloom import LLM, EngineArgs, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=128, block_size=8)


def test_max_tokens_and_finish_reason_length(llm):
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=7, **GREEDY), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length"
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0


def test_stop_string_cuts_text_and_reports_reason(llm):
    full = llm.generate(["import os"], SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0].outputs[0].text
    # a 3-character stop string whose first occurrence is past the first 10 characters
    firsts = [i for i in range(10, len(full) - 2) if full.find(full[i : i + 3]) == i]
    assert firsts, f"the greedy text is too repetitive to pick a stop string from: {full!r}"
    cut = firsts[0]
    stop = full[cut : cut + 3]
    out = llm.generate(["import os"], SamplingParams(max_tokens=40, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate(["import os"], SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=True, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert inc.text == full[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    toks = llm.generate(["class A:"], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    target = toks[5]
    first = toks.index(target)
    out = llm.generate(["class A:"], SamplingParams(max_tokens=20, stop_token_ids=[target], **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == toks[: first + 1] and out.outputs[0].stop_reason == target
    # min_tokens bans the stop token until enough tokens exist
    out = llm.generate(["class A:"], SamplingParams(max_tokens=20, min_tokens=first + 2, stop_token_ids=[target], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert target not in out.token_ids[: first + 2]


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = "x" * 200
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    eng = llm.llm_engine
    assert eng.kv.prefix_hits > 0 and eng.kv.pool.num_used == 0


def test_bad_prompt_fails_alone(llm):
    tok = llm.get_tokenizer()
    too_long = {"prompt_token_ids": [5] * 300}
    outs = llm.generate(["ok prompt", too_long, "another"], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "300" in outs[1].error and "256" in outs[1].error
    assert len(outs[0].outputs[0].token_ids) == 4 and len(outs[2].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="out of range"):
        llm.llm_engine.add_request("bad", {"prompt_token_ids": [10**6]}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.llm_engine.add_request("bad2", "hi", SamplingParams(max_tokens=1000))
    assert not llm.llm_engine.has_unfinished_requests() and tok is not None


def test_abort_returns_blocks(llm):
    eng = llm.llm_engine
    eng.add_request("a", "hello there", SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("b", "general kenobi", SamplingParams(max_tokens=3, **GREEDY))
    eng.step()
    eng.step()
    assert eng.kv.pool.num_used > 0
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.pool.num_used == 0


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>user")


def test_priority_policy_serves_urgent_first(tiny_llama):
    events = []
    llm = LLM(str(tiny_llama), max_model_len=128, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority",
              observers=[events.append])
    llm.generate(["first", "second", "third"], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False,
                 priority=[5, 0, 1])
    order = []
    for ev in events:
        for e in ev.entries:
            if e.request_id not in order:
                order.append(e.request_id)
    # lower value = more urgent (vLLM's convention); ids are assigned in submission order
    ids = sorted(order, key=int)
    assert order == [ids[1], ids[2], ids[0]]


def test_prefix_caching_on_off_same_output(tiny_llama):
    shared = "def function_with_a_long_shared_prefix(argument_one, argument_two):\n    return " * 3
    prompts = [shared + s for s in ("a", "b + 1", "c * 2")]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    on = LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=64, block_size=4)
    off = LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    o1 = [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)]
    o1b = on.generate(prompts, sp, use_tqdm=False)
    o2 = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    assert o1 == o2 == [o.outputs[0].token_ids for o in o1b]
    assert all(o.num_cached_tokens > 0 for o in o1b)


def test_invalid_engine_flags_say_which_to_change(tiny_llama):
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        LLMEngine(EngineArgs(model=str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=64,
                             max_model_len=512, num_kv_blocks=64))
    with pytest.raises(ValueError, match="num-kv-blocks"):
        LLMEngine(EngineArgs(model=str(tiny_llama), max_model_len=512, num_kv_blocks=2))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tiny_llama), max_num_seq=4)


def test_unknown_architecture_names_supported_ones(tmp_path, tiny_llama):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(d))


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="torch.compile on CPU needs a C compiler")
def test_compile_gives_the_eager_tokens(tiny_llama, llm):
    """`--compile` runs the same model through torch.compile (packed oneDNN linears stay
    opaque custom ops) and produces the eager engine's greedy tokens, with prefill,
    decode and mixed steps all taking the compiled path."""
    prompts = ["def f(x):", "import os", "class A:"]
    params = SamplingParams(max_tokens=6, **GREEDY)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compiled = LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=128, block_size=8, compile=True)
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)] == eager
