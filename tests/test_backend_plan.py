"""One place decides what runs: `model/backends.py resolve_backends` turns every "auto" into a
name once, before the weights load, and everything downstream builds what the plan names.

Checked through the real engine: the plan has no "auto" left, the loader, the runner and the
start-up summary all carry that one plan, and each attention backend builds its own step
metadata (the runner builds no mask)."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.config import BackendPlan
from tokenloom.model.attention import AttentionBackend, CpuAttention, LayerAttention
from tokenloom.model.backends import resolve_backends
from tokenloom.runner.tp_worker import worker_spec

FIELDS = dict(head_dim=16, qk_norm=False, sliding_window=None)


def test_the_engine_runs_one_resolved_plan(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, num_kv_blocks=32)
    eng = llm.llm_engine
    plan = eng.backends
    assert isinstance(plan, BackendPlan)
    assert "auto" not in dataclasses.asdict(plan).values()
    assert eng.loaded.plan is plan and eng.runner.plan is plan and eng.config.backends is plan
    assert eng.loaded.linear_backend == plan.linear and eng.runner.attn.name == plan.attention
    assert eng.runner.ops.name == plan.ops
    assert plan.describe() in eng.summary()  # the start-up summary prints the plan
    # tensor-parallel workers get the plan itself, not strings to resolve again
    spec = worker_spec(eng.args, eng.model_path, eng.device, 64, plan)
    assert pickle.loads(pickle.dumps(spec)).backends == plan
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_static_choices_follow_from_the_settings():
    cpu = torch.device("cpu")
    compiled = resolve_backends(cpu, torch.float32, FIELDS, ops="torch", compile=True)
    assert compiled.compile and not compiled.fused_kv_write and not compiled.flat_calls
    assert not compiled.cuda_graphs and compiled.cuda_graphs_off == "not on a CUDA device"
    sdpa = resolve_backends(cpu, torch.float32, FIELDS, attention="sdpa", ops="torch")
    assert (sdpa.attention, sdpa.ops, sdpa.fused_kv_write, sdpa.flat_calls) == ("sdpa", "torch", False, True)
    tp = resolve_backends(cpu, torch.float32, FIELDS, tensor_parallel_size=2)
    assert tp.cuda_graphs_off == "not on a CUDA device" and tp.flat_calls


def test_a_layer_binds_its_static_choices_once(tiny_llama):
    """What cannot change after load is bound into each layer, not checked per call: the
    linears as plain functions (flat) or modules, the fused rotary + KV write or not."""
    from tokenloom.model.weights.packed_linear import PanelLinear

    llm = LLM(str(tiny_llama), max_model_len=64, num_kv_blocks=32)
    runner = llm.llm_engine.runner
    step = runner.model.steps[0]
    assert not isinstance(step.qkv, torch.nn.Module)  # flat: a plain function
    runner.model.bind(runner.ops, runner.attn, flat=False)
    step = runner.model.steps[0]
    assert step.qkv is runner.model.layers[0].self_attn.qkv_proj
    if runner.plan.linear == "panels":
        assert isinstance(step.qkv, PanelLinear)


def test_each_attention_backend_builds_its_own_metadata():
    """The reference reads masks it builds itself; our CPU kernel reads none."""
    slots = torch.tensor([5, 9, 10, 11])
    step = dict(decode_block_tables=torch.tensor([[1, 2]]), decode_context_lens=torch.tensor([6]),
                prefill_block_tables=torch.tensor([[2, 0]]), prefill_q_starts=torch.tensor([1]),
                prefill_q_lens=torch.tensor([3]), prefill_ctx_lens=torch.tensor([0]))
    ref = AttentionBackend().metadata(slots, torch.device("cpu"), 4, **step)
    assert ref.num_decode == 1 and ref.prefill_max_q == 3
    assert ref.decode_masks[None].shape == (1, 1, 1, 8) and ref.decode_masks[None].sum() == 6
    # a chunk from its request's first token: plain causal attention needs no mask (SDPA's own)
    assert ref.prefill_from_zero and not ref.prefill_masks and ref.prefill_scatter.tolist() == [0, 1, 2]
    assert ref.prefill_dense  # one chunk right after the decode row: its rows are the padded layout
    cached = dict(step, prefill_ctx_lens=torch.tensor([2]))  # after a cached prefix: masked
    ref = AttentionBackend().metadata(slots, torch.device("cpu"), 4, **cached)
    assert not ref.prefill_from_zero and set(ref.prefill_masks) == {None}
    cpu = CpuAttention(lambda *a: None, None).metadata(slots, torch.device("cpu"), 4, **cached)
    assert not cpu.decode_masks and set(cpu.prefill_masks) == {None}  # prefills go through SDPA
    # a model with a windowed kind and a soft-capped one: the kernel decodes neither, so
    # the metadata carries the masks of both windows for decodes too
    kinds = (LayerAttention(window=3), LayerAttention(softcap=5.0))
    both = CpuAttention(lambda *a: None, kinds).metadata(slots, torch.device("cpu"), 4, **step)
    assert set(both.decode_masks) == {3, None} and both.decode_masks[3].sum() == 3
