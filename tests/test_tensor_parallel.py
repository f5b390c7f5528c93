"""Tensor parallel on CPUs: two processes (gloo) give transformers' greedy tokens.

Each rank holds half of every layer (model/weights/parallel.py) and its own half of the KV cache;
rank 0 schedules and samples, rank 1 is a worker process running the same steps (forked
here: no CUDA context; runner/worker_procs.py).  Checked under chunked prefill, 4-token
blocks and preemption, for the families' differences (q/k/v biases, q/k norms, a KV head
replicated on both ranks), with async scheduling, and launched the two ways a user would:
started by `LLM(tensor_parallel_size=2)`, and as two processes of one `tokenloom serve` command with
torchrun's environment (how a group spans machines).  Plain user scripts, and how every
process tree ends: tests/test_plain_scripts.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.bench.launcher import free_port

from test_parity import STRESS, _hf, _hf_greedy, _prompts

NEW_TOKENS = 12


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-qwen2", None),  # q/k/v biases (split with their heads)
    ("tiny-qwen3", None),  # q/k norms
    ("tiny-llama", {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
])
def test_two_ranks_give_transformers_tokens(model_factory, preset, overrides):
    path = model_factory(preset, **({"overrides": overrides} if overrides else {}))
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    llm = LLM(str(path), tensor_parallel_size=2, **STRESS)
    try:
        eng = llm.llm_engine
        assert "tensor parallel over 2 ranks" in eng.summary()
        assert eng.loaded.args.num_heads * 2 == _hf(path).config.num_attention_heads  # rank 0 holds half the heads
        assert _greedy(llm, prompts) == ref
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.pool.num_free == STRESS["num_kv_blocks"]
        workers = eng.tp_launcher.procs
        assert len(workers) == 1 and workers[0].is_alive() and workers[0].method == "fork"
    finally:
        llm.shutdown()
    assert not workers[0].is_alive() and workers[0].exitcode == 0  # left when told


def test_two_ranks_with_async_scheduling_give_the_same_tokens(model_factory):
    """Async scheduling over two ranks: rank 0 sends each step ahead to the worker as it
    launches it, its input ids the previous step's sampled tokens.  Transformers' greedy tokens,
    and with overlap off and on the same tokens and finish reasons under preemption, a stop
    token part-way (the step ahead's token for that request dropped) and max_tokens; every
    KV block back."""
    path = model_factory("tiny-qwen2")
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [plain] * len(prompts) + [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[ref[0][4]]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    requests = [{"prompt_token_ids": p} for p in prompts + prompts[:2]]
    got = {}
    for on in (False, True):
        llm = LLM(str(path), tensor_parallel_size=2, async_scheduling=on, **STRESS)
        try:
            outs = llm.generate(requests, params, use_tqdm=False)
            eng = llm.llm_engine
            got[on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
            assert eng.scheduler.num_preemptions > 0
            assert eng.kv.pool.num_free == STRESS["num_kv_blocks"]
            assert (eng.num_steps_ahead > 0) == on
        finally:
            llm.shutdown()
    assert [t for t, _ in got[True][:len(prompts)]] == ref
    assert got[True] == got[False]
    assert got[True][-2][1] == "stop" and len(got[True][-2][0]) < NEW_TOKENS


def test_a_split_that_cannot_be_made_is_refused_before_spawning(model_factory):
    path = model_factory("tiny-llama")
    with pytest.raises(ValueError, match="tensor-parallel-size 3"):
        LLM(str(path), tensor_parallel_size=3, max_model_len=64)


def test_torchrun_style_launch_serves_from_rank_0(model_factory):
    """`torchrun --nproc-per-node 2 -m tokenloom.entrypoints.cli serve MODEL -tp 2`, spelled
    out: two processes of the same command with torchrun's variables (env:// rendezvous);
    rank 0 serves, rank 1 works, and rank 1 leaves when rank 0 stops."""
    path = model_factory("tiny-qwen2")
    prompts = _prompts()[:3]
    llm = LLM(str(path), max_model_len=128)
    try:
        expected = _greedy(llm, prompts)
    finally:
        llm.shutdown()
    port, master = free_port(), free_port()
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", str(path), "--tensor-parallel-size", "2",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128"]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", procs[0], timeout=180)
        for p, want in zip(prompts, expected):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": str(path), "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == llm.get_tokenizer().decode(want)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0
        assert procs[1].wait(timeout=60) == 0  # the worker left with rank 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
