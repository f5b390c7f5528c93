"""CPU graphs (runner/cpu_graphs.py, kernels/cpu_graph.cpp): a decode step replayed from the op
list its batch size recorded gives what the eager forward gives, bit for bit.

Checked through the real engine against transformers and against --enforce-eager (every
batch size the run passes through, preemption included), on the replayed logits
themselves, on the op list's mechanics with PyTorch's own ops (tensors an op made, lists of
them, Python numbers where a tensor goes, list outputs, buffers refilled in place), on
what cannot be replayed, and on the plan that turns it on and off."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.backends import resolve_backends
from tokenloom.runner.cpu_graphs import CpuDecodeGraphs, NotReplayable, Recorder

pytestmark = pytest.mark.skipif(not cpu_kernels.graph_enabled(), reason="the op-list replayer did not build here")

# Prompts of different lengths and budgets, so the decode batch shrinks step by step; too
# few blocks for all of them at once, so requests are preempted and come back.
PROMPT_LENS = (3, 17, 40, 9, 25)
MAX_TOKENS = (20, 9, 14, 30, 5)
STRESS = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=24, max_model_len=80)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _hf_greedy(path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, n in zip(_prompts(), MAX_TOKENS):
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def _count_graph_steps(graphs: CpuDecodeGraphs) -> list[int]:
    sizes: list[int] = []
    run = graphs.run
    graphs.run = lambda ids, *a: sizes.append(len(ids)) or run(ids, *a)
    return sizes


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_replayed_decode_steps_give_transformers_greedy_tokens(model_factory, preset):
    path = model_factory(preset)
    llm = LLM(str(path), **STRESS)
    graphs = llm.llm_engine.runner.graphs
    assert isinstance(graphs, CpuDecodeGraphs) and "CPU graphs" in llm.llm_engine.summary()
    sizes = _count_graph_steps(graphs)
    assert _generate(llm) == _hf_greedy(path)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]
    # every batch size that ran twice was recorded by its second step and replayed after; none fell back
    counts = Counter(sizes)
    assert len(graphs.lists) >= 3 and not graphs.eager
    assert set(graphs.lists) == {n for n, c in counts.items() if c >= 2}
    assert sum(counts[n] - 2 for n in graphs.lists) > 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_and_eager_forward_agree_bit_for_bit(model_factory, dtype):
    path = model_factory("tiny-qwen2")
    eager = LLM(str(path), dtype=dtype, enforce_eager=True, **STRESS)
    assert eager.llm_engine.runner.graphs is None and eager.llm_engine.runner.graphs_off_reason == "--enforce-eager"
    llm = LLM(str(path), dtype=dtype, **STRESS)
    assert _generate(llm) == _generate(eager)
    graphs = llm.llm_engine.runner.graphs
    n = max(graphs.lists)
    # the buffers still hold a step of n rows: the eager forward and the replay of the same
    # inputs (each writes the same K/V to the same slots)
    graphs.load(n, list(range(7, 7 + n)), [5] * n, list(range(n)), [[0, 1]] * n)
    with torch.inference_mode():
        ref = graphs.forward(n)
        assert torch.equal(graphs.lists[n].run(), ref)


def test_an_op_list_replays_pytorch_ops_on_refilled_buffers():
    """Tensors an earlier op made (also inside a list argument), Python numbers where the
    schema takes a tensor, list outputs, keyword defaults, and inputs read in place."""
    buf = torch.randn(4, 6)
    idx = torch.tensor([2, 0])

    def forward():
        a = buf * 0.5 - 8  # wrapped numbers
        parts = a.split(2, dim=1)  # a list output
        c = torch.cat([parts[2], parts[0]], dim=1)  # a list argument of made tensors
        d = c[idx, 1:]  # an index list with a hole (Tensor?[])
        return torch.where(d > -8, d, -d).softmax(-1).sum(0)

    rec = Recorder()
    with rec:
        first = forward()
    ops = rec.op_list(first)
    assert torch.equal(ops.run(), first)
    buf.copy_(torch.randn(4, 6))  # the next step's inputs, in the same buffers
    idx.copy_(torch.tensor([1, 3]))
    assert torch.equal(ops.run(), forward())
    assert not torch.equal(ops.run(), first)


@pytest.mark.parametrize("host_read", [lambda x: x * x.sum().item(), lambda x: x[x.nonzero()[:, 0]],
                                       lambda x: x[x > 0]])
def test_a_forward_that_reads_data_on_the_host_is_not_replayed(host_read):
    x = torch.randn(8)
    rec = Recorder()
    with rec:
        y = host_read(x) + 1
    with pytest.raises(NotReplayable):
        rec.op_list(y)


def test_a_replay_lets_other_python_threads_run():
    """The engine runs in a thread beside the server's event loop: a replay releases the GIL,
    so another thread never waits for a whole replay."""
    w = torch.randn(256, 256) / 16

    def forward(n):
        x = w
        for _ in range(n):
            x = torch.tanh(x @ w)
        return x

    t0 = time.perf_counter()
    forward(20)
    n = max(20, int(20 * 0.5 / (time.perf_counter() - t0)))  # about half a second of ops
    rec = Recorder()
    with rec:
        y = forward(n)
    ops = rec.op_list(y)
    took: list[float] = []

    def replay():
        t = time.perf_counter()
        ops.run()
        took.append(time.perf_counter() - t)

    thread = threading.Thread(target=replay)
    gaps: list[float] = []
    last = time.perf_counter()
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    assert len(gaps) > 100 and max(gaps) < took[0] / 2


def test_the_plan_replays_only_what_repeats():
    cpu = torch.device("cpu")
    fields = dict(head_dim=16, qk_norm=False, sliding_window=None)
    plan = resolve_backends(cpu, torch.float32, fields)
    assert plan.attention == "cpu" and plan.cpu_graphs and plan.cpu_graphs_off is None
    assert "CPU graphs" in plan.describe() and not plan.cuda_graphs
    off = {
        "--enforce-eager": resolve_backends(cpu, torch.float32, fields, enforce_eager=True),
        "sdpa": resolve_backends(cpu, torch.float32, fields, attention="sdpa"),
        "lora": resolve_backends(cpu, torch.float32, fields, lora=True),
        "moe": resolve_backends(cpu, torch.float32, dict(fields, num_experts=4)),
        "window": resolve_backends(cpu, torch.float32, dict(fields, sliding_window=8,
                                                            layer_types=["sliding_attention", "full_attention"])),
        "tp": resolve_backends(cpu, torch.float32, fields, tensor_parallel_size=2),
    }
    for name, p in off.items():
        assert not p.cpu_graphs and p.cpu_graphs_off, name
        assert f"no CPU graphs ({p.cpu_graphs_off})" in p.describe()
    assert off["--enforce-eager"].cpu_graphs_off == "--enforce-eager"
