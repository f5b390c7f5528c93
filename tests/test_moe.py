"""Mixture of experts (model/moe.py): Mixtral, Qwen3-MoE and Qwen2-MoE against transformers.

The config reading against what transformers builds from the same dict (which layers are
sparse, experts, top-k, the families' normalisation and defaults); the MoE block against
transformers' own block on the same weights, row counts 1 and many, fp32 and bf16, each
used expert run once per step; checkpoints written by transformers' `save_pretrained` (the
hub's per-expert names) and in the stacked 3D layout generating transformers' greedy tokens
with log-probabilities within 1e-4, under chunked prefill, preemption and prefix caching;
int8/int4 against transformers with the same dequantized expert weights; two tensor-parallel
ranks over the experts; and the estimator's expert arithmetic.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_hf_checkpoints import _save_checkpoint
from test_parity import STRESS, _hf, _hf_greedy, _prompts
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tokenloom import LLM, SamplingParams
from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.moe import SparseMoE
from tokenloom.model.ops import TORCH
from tokenloom.model.weights.quantization import TorchQuantized, parse_scheme
from tokenloom.specs.model_spec import ModelSpec, load_model_spec

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)

ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6),
    # Qwen3-MoE without renormalising the top-k, its second layer dense
    "qwen3-moe-dense-layer": lambda: Qwen3MoeConfig(**{**TINY, "head_dim": 32}, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=False,
                                                    mlp_only_layers=[1], rope_theta=1e6),
    "qwen3-moe-norm-topk": lambda: Qwen3MoeConfig(**{**TINY, "head_dim": 32}, num_experts=8, num_experts_per_tok=3,
                                                  moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e6),
    # Qwen2-MoE: a shared expert and its sigmoid gate, q/k/v biases
    "qwen2-moe-shared": lambda: Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, norm_topk_prob=False,
                                               rope_theta=1e6),
}


# ---- config.json -> ModelArgs, against what transformers builds -------------------------------

def _moe_of(cfg: dict) -> dict:
    """The MoE fields read off the model transformers builds from `cfg` (meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    layers = model.model.layers
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    block = layers[sparse[0]].mlp
    shared = getattr(block, "shared_expert", None)
    return dict(num_experts=block.experts.num_experts, num_experts_per_tok=block.gate.top_k,
                moe_intermediate_size=block.experts.intermediate_dim, moe_layers=tuple(sparse),
                shared_expert_intermediate_size=shared.gate_proj.out_features if shared is not None else 0,
                norm_topk_prob=getattr(block.gate, "norm_topk_prob", True),
                intermediate_size=next((layer.mlp.gate_proj.out_features for layer in layers
                                        if not hasattr(layer.mlp, "experts")), None),
                head_dim=layers[0].self_attn.head_dim, qk_norm=hasattr(layers[0].self_attn, "q_norm"),
                qkv_bias=layers[0].self_attn.q_proj.bias is not None,
                o_bias=layers[0].self_attn.o_proj.bias is not None,
                rope_theta=model.config.rope_parameters["rope_theta"])


CONFIG_CASES = {
    "mixtral-minimal": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=64,
                            num_attention_heads=4, num_hidden_layers=2, intermediate_size=32, vocab_size=64),
    "mixtral-num-experts-key": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], **TINY,
                                    num_experts=4, num_experts_per_tok=1),
    "qwen3-moe-hub-keys": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **TINY, num_experts=16,
                               num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True),
    "qwen3-moe-sparse-step-and-dense-layers": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **{**TINY, "num_hidden_layers": 6},
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3],
        attention_bias=True, head_dim=32),
    "qwen2-moe-defaults": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
                               num_attention_heads=4, num_hidden_layers=2, intermediate_size=32, vocab_size=64,
                               moe_intermediate_size=8, shared_expert_intermediate_size=16),
    "qwen2-moe-no-qkv-bias": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], **TINY, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, qkv_bias=False,
                                  mlp_only_layers=[0]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_moe_config_fields_match_what_transformers_builds(case):
    cfg = CONFIG_CASES[case]
    ours = model_args_fields(json.loads(json.dumps(cfg)), cfg["architectures"][0])
    ref = _moe_of(json.loads(json.dumps(cfg)))
    if ref["intermediate_size"] is None:  # no dense layer to read it from
        del ref["intermediate_size"]
    assert {k: ours[k] for k in ref} == ref


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_that_transformers_saves_reads_as_the_config(tmp_path, name):
    """What transformers 5 writes (Qwen3-MoE's `num_local_experts`, Qwen2-MoE's sliding_window 0)."""
    config = CONFIGS[name]()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    ours = model_args_fields(saved, ARCH[saved["model_type"]])
    assert ours["num_experts"] == 8 and ours["sliding_window"] is None
    assert ours["moe_layers"] == tuple(i for i in range(2) if i not in getattr(config, "mlp_only_layers", []))


def test_settings_the_model_cannot_honour_are_refused(tmp_path):
    cfg = dict(CONFIG_CASES["qwen3-moe-hub-keys"], num_experts_per_tok=17)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model_args_fields(cfg, "Qwen3MoeForCausalLM")
    # refused before any worker starts or weight loads (the directory holds only config.json)
    cfg = dict(CONFIG_CASES["qwen3-moe-hub-keys"], moe_intermediate_size=15)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="moe_intermediate_size 15"):
        LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=64)


# ---- the block against transformers' block --------------------------------------------------

def _blocks(name: str, dtype: torch.dtype):
    """transformers' MoE block of a random model of config `name`, and ours with its weights."""
    config = CONFIGS[name]()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0, 0.25)
    hf = hf_model.model.layers[0].mlp
    a = model_args_fields(config.to_dict(), ARCH[config.model_type])
    ours = SparseMoE(a["hidden_size"], a["num_experts"], a["num_experts_per_tok"], a["moe_intermediate_size"],
                     a["shared_expert_intermediate_size"], a["norm_topk_prob"], a["moe_weights_fp32"]).to(dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        if ours.shared_expert is not None:
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([hf.shared_expert.gate_proj.weight,
                                                                     hf.shared_expert.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(hf.shared_expert.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return hf, ours


class _Counting:
    """Wraps one of our bound experts: records the rows of each call, then runs it."""

    def __init__(self, inner, calls: list, e: int):
        self.inner, self.calls, self.e = inner, calls, e

    def __call__(self, x):
        self.calls.append((self.e, x.shape[0]))
        return self.inner(x)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_block_matches_transformers_and_runs_each_used_expert_once(name, rows):
    hf, ours = _blocks(name, torch.float32)
    step = ours.bind(TORCH, flat=True)
    calls: list = []
    step.experts = [_Counting(f, calls, e) for e, f in enumerate(step.experts)]
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        want = hf(x[None])[0]
        got = step(x)
        _, _, chosen = hf.gate(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    expected = torch.bincount(chosen.flatten(), minlength=8)
    ran = dict((e, n) for e, n in calls)
    assert len(calls) == len(ran), "an expert ran twice in one step"
    if rows == 1:
        assert ran == {e: 1 for e in chosen[0].tolist()}
    else:
        assert ran == {e: int(n) for e, n in enumerate(expected.tolist()) if n}


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-norm-topk"])
def test_block_in_bfloat16_stays_close_to_transformers(name):
    """Each family scales the experts' outputs as its reference does (Mixtral in float32,
    Qwen in bf16); the sums' order differs, so within a few bf16 roundings."""
    hf, ours = _blocks(name, torch.bfloat16)
    step = ours.bind(TORCH, flat=True)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        want, got, one = hf(x[None])[0].float(), step(x).float(), step(x[:1]).float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.02 * scale
    assert (one[0] - want[0]).abs().max().item() < 0.02 * scale


# ---- checkpoints written by transformers: greedy parity ------------------------------------

def _generate(llm: LLM, prompts, n, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False)


def _check_logprobs(hf, prompts, outs, tol=1e-4):
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < tol


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_saved_by_transformers_generates_what_transformers_generates(tmp_path, name):
    """Chunked prefill mixed with decodes, 4-token blocks and preemption (STRESS), MoE
    routing on every row; greedy tokens equal, first-token log-probabilities within 1e-4."""
    path = _save_checkpoint(CONFIGS[name](), tmp_path)
    prompts, n = _prompts()[:4], 16
    hf = _hf(path)
    events = []
    llm = LLM(str(path), observers=[events.append], **STRESS)
    outs = _generate(llm, prompts, n, logprobs=5)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, n)
    _check_logprobs(hf, prompts, outs)
    assert any(e.phase == "prefill_chunk" for ev in events for e in ev.entries)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]


def test_generic_pytorch_path_matches_transformers(tmp_path):
    """What other devices run: nn.Linear experts, PyTorch's ops and SDPA attention, the same
    grouping by expert."""
    path = _save_checkpoint(CONFIGS["qwen3-moe-dense-layer"](), tmp_path)
    prompts, n = _prompts()[:4], 12
    llm = LLM(str(path), linear_backend="torch", ops_backend="torch", attention_backend="sdpa", **STRESS)
    plan = llm.llm_engine.backends
    assert (plan.linear, plan.ops, plan.attention) == ("torch", "torch", "sdpa")
    assert type(llm.llm_engine.loaded.model.layers[0].mlp.experts[0].down_proj) is torch.nn.Linear
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, n)] == _hf_greedy(_hf(path), prompts, n)


def test_saved_names_are_per_expert_and_the_stacked_layout_loads_too(tmp_path):
    """transformers 5 writes the hub's per-expert names; a checkpoint holding the stacked 3D
    tensors transformers keeps in memory (`mlp.experts.gate_up_proj` [E, 2I, H]) loads to the
    same model."""
    from safetensors import safe_open

    per_expert = _save_checkpoint(CONFIGS["mixtral"](), tmp_path / "per-expert")
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    hf = _hf(per_expert)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 64)
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (stacked / extra).write_bytes((per_expert / extra).read_bytes())
    prompts = _prompts(5)[:3]
    want = _generate(LLM(str(per_expert), max_model_len=128, num_kv_blocks=64), prompts, 8)
    got = _generate(LLM(str(stacked), max_model_len=128, num_kv_blocks=64), prompts, 8)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == _hf_greedy(_hf(stacked), prompts, 8)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_make_model_presets_match_transformers(model_factory, preset):
    """`make-model --preset` writes each new family through transformers' config classes."""
    path = model_factory(preset)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] in ("mixtral", "qwen3_moe") and "rope_parameters" in cfg
    prompts = _prompts()
    llm = LLM(str(path), **STRESS)
    outs = _generate(llm, prompts, 12)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, 12)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_under_pressure_match_transformers(tmp_path):
    path = _save_checkpoint(CONFIGS["qwen2-moe-shared"](), tmp_path)
    g = torch.Generator().manual_seed(3)
    head = torch.randint(5, 1000, (37,), generator=g).tolist()
    prompts = [head + torch.randint(5, 1000, (n,), generator=g).tolist() for n in (1, 6, 11, 3)]
    ref = _hf_greedy(_hf(path), prompts, 16)
    llm = LLM(str(path), **STRESS)
    first = _generate(llm, prompts[:1], 16)
    rest = _generate(llm, prompts[1:], 16)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert rest[0].num_cached_tokens == 36
    assert llm.llm_engine.kv.pool.num_evictions > 0
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]


def test_bfloat16_stays_close_to_transformers_bfloat16(tmp_path):
    path = _save_checkpoint(CONFIGS["qwen3-moe-norm-topk"](), tmp_path)
    hf16 = _hf(path, torch.bfloat16)
    p = _prompts(2)[0]
    o = _generate(LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64), [p], 4,
                  logprobs=5)[0].outputs[0]
    for i, step in enumerate(o.logprobs):
        with torch.no_grad():
            ref = hf16(torch.tensor([p + o.token_ids[:i]])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in step.items():
            assert abs(lp.logprob - ref[tok].item()) < 0.1


# ---- int8 / int4 ------------------------------------------------------------------------------

def _fake_quantized_hf(path, name: str):
    """transformers' model with every matmul weight our engine quantizes replaced by its
    dequantized quantization: attention, each expert's fused gate_up and down (a slice of the
    stacked tensors), the shared expert, the LM head.  Routers stay as they are (as ours do)."""
    hf = _hf(path)
    scheme = parse_scheme(name)

    def deq(w):
        return TorchQuantized(w, scheme).dequantize()

    with torch.no_grad():
        for mod_name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and not mod_name.endswith("shared_expert_gate"):
                if mod_name.endswith(("gate_proj", "up_proj")):
                    continue  # fused with its sibling below: per-row schemes quantize it alike
                mod.weight.copy_(deq(mod.weight))
            if hasattr(mod, "gate_up_proj") and isinstance(mod.gate_up_proj, torch.nn.Parameter):
                for e in range(mod.gate_up_proj.shape[0]):
                    mod.gate_up_proj[e].copy_(deq(mod.gate_up_proj[e]))
                    mod.down_proj[e].copy_(deq(mod.down_proj[e]))
            if hasattr(mod, "gate_proj") and isinstance(mod.gate_proj, torch.nn.Linear):
                gu = deq(torch.cat([mod.gate_proj.weight, mod.up_proj.weight]))
                mod.gate_proj.weight.copy_(gu[: mod.gate_proj.out_features])
                mod.up_proj.weight.copy_(gu[mod.gate_proj.out_features:])
    return hf


@pytest.mark.parametrize("config,name,backend", [
    ("mixtral", "int8", "auto"),  # our int8 kernel (panels) where it builds
    ("qwen2-moe-shared", "int4", "auto"),  # our int4 kernel; the shared expert quantized too
    ("mixtral", "int4-g128", "torch"),  # the generic PyTorch path
])
def test_quantized_experts_generate_what_transformers_generates_dequantized(tmp_path, config, name, backend):
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.quantization import QuantLinear

    path = _save_checkpoint(CONFIGS[config](), tmp_path)
    prompts, n = _prompts()[:3], 8
    hf = _fake_quantized_hf(path, name)
    llm = LLM(str(path), quantization=name, linear_backend=backend, block_size=4, max_num_batched_tokens=12,
              num_kv_blocks=160, max_model_len=128)
    loaded = llm.llm_engine.loaded
    if backend == "auto" and cpu_kernels.quant_ops() is not None:
        assert loaded.linear_backend == "panels"
    block = loaded.model.layers[0].mlp
    assert all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear) for e in block.experts)
    assert not isinstance(block.gate, QuantLinear)  # routers stay in full precision
    assert block.gate.weight.dtype == torch.float32
    outs = _generate(llm, prompts, n, logprobs=5)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, n)
    _check_logprobs(hf, prompts, outs)


# ---- tensor parallel over the experts ---------------------------------------------------------

@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe-shared"])
def test_two_ranks_over_the_experts_give_transformers_tokens(tmp_path, name):
    """Each rank holds half of every expert's intermediate dimension (and of the shared
    expert's), the router whole; one all-reduce per MoE block."""
    path = _save_checkpoint(CONFIGS[name](), tmp_path)
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, 12)
    llm = LLM(str(path), tensor_parallel_size=2, **STRESS)
    try:
        eng = llm.llm_engine
        assert eng.loaded.args.moe_intermediate_size * 2 == model_args_fields(
            json.loads((path / "config.json").read_text()), eng.loaded.args.architecture)["moe_intermediate_size"]
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts, 12)] == ref
        assert eng.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


# ---- the estimator ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_spec_counts_the_parameters_transformers_builds(name):
    cfg = CONFIGS[name]().to_dict()
    spec = ModelSpec.from_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    assert spec.is_moe and spec.active_params < spec.total_params


def test_published_moe_shapes():
    mixtral, qwen = load_model_spec("mixtral-8x7b"), load_model_spec("qwen3-30b-a3b")
    assert mixtral.total_params == 46_702_792_704 and round(mixtral.active_params / 1e9, 1) == 12.9
    assert qwen.total_params == 30_532_122_624 and round(qwen.active_params / 1e9, 1) == 3.4


def test_estimator_counts_active_experts_at_one_token_and_the_union_at_more():
    from tokenloom.sim.estimate import CostModel
    from tokenloom.sim.step_features import StepFeatures
    from tokenloom.specs.hardware import get_hardware

    moe, dense = load_model_spec("qwen3-moe-bench"), load_model_spec("qwen3-dense-bench")
    e, k, layers = moe.num_experts, moe.num_experts_per_tok, moe.num_moe_layers
    assert moe.experts_touched(1) == k and moe.experts_touched(16) == pytest.approx(e * (1 - (1 - k / e) ** 16))
    assert moe.experts_touched(10_000) == pytest.approx(e)
    expert_bytes = moe.expert_params * 2
    one = moe.streamed_weight_bytes("bfloat16")
    # batch 1: the same bytes as the dense model with the same active parameters, plus the routers
    assert one - dense.streamed_weight_bytes("bfloat16") == 2 * layers * e * moe.hidden_size
    assert moe.streamed_weight_bytes("bfloat16", tokens=16) - one == pytest.approx(
        layers * (moe.experts_touched(16) - k) * expert_bytes, abs=1)
    every = moe.streamed_weight_bytes("bfloat16", tokens=10**6)
    assert every == pytest.approx(moe.weight_bytes("bfloat16") - moe.embedding_params * 2, rel=1e-6)
    assert moe.flops_per_token(0) < 1.02 * dense.flops_per_token(0)  # FLOPs: the active experts only
    # int8: the experts' bytes in the scheme
    assert moe.streamed_weight_bytes("bfloat16", "int8", 16) < moe.streamed_weight_bytes("bfloat16", None, 16) / 1.9
    hw = get_hardware("rtx4090")
    for form in ({}, {"mem_efficiency": 0.8}):  # kernel by kernel, and the plain roofline
        cm, cd = CostModel(moe, hw, "bfloat16", **form), CostModel(dense, hw, "bfloat16", **form)
        assert cm.decode_cost(16, 100).bytes > 5 * cm.decode_cost(1, 100).bytes
        assert cd.decode_cost(16, 100).bytes < 1.1 * cd.decode_cost(1, 100).bytes
        assert cm.total_weight_bytes == moe.weight_bytes("bfloat16")
        assert cm.crossover_batch(0) > 5 * cd.crossover_batch(0)
    assert cm.form == "roofline"
    assert cm.step_cost([(16, 0)], []).bytes == cm.decode_cost(16, 0).bytes  # by tokens, not requests
    # the crossover batch solves with the bytes of the experts that batch touches
    c = cm.decode_cost(round(cm.crossover_batch(0)), 0)
    assert c.mem_time_s == pytest.approx(c.compute_time_s, rel=0.01)
    f = StepFeatures(moe, "bfloat16")
    assert f.parts([(1, 10, True)]).layer_bytes < f.parts([(1, 10, True)] * 16).layer_bytes


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_estimator_counts_the_bytes_the_engine_stores(tmp_path, quantization):
    path = _save_checkpoint(CONFIGS["qwen2-moe-shared"](), tmp_path)
    llm = LLM(str(path), quantization=quantization, linear_backend="torch", max_model_len=64, num_kv_blocks=32)
    loaded = llm.llm_engine.loaded
    rope = loaded.model.rope.cos.nbytes + loaded.model.rope.sin.nbytes
    assert loaded.weight_bytes - rope == load_model_spec(str(path)).weight_bytes("float32", quantization)
