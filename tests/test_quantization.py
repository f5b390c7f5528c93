"""Weight-only int8 / int4 quantization (model/weights/quantization.py, kernels/cpu_gemm_quant.cpp).

The quantized model is a model in its own right: the one whose weights are the dequantized
matrices.  So the checks are (1) the round trip stays within its error bound, (2) our CPU
kernel (both its AVX-512 and AVX2 builds) multiplies by exactly those dequantized matrices,
as does the PyTorch path, (3) the engine with `quantization=` generates what transformers
generates with the same dequantized weights put into its own model (greedy tokens, log-probs),
and stays close to the unquantized model, (4) the flag round-trips and the estimator counts
the bytes.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from test_hf_checkpoints import TINY, _save_checkpoint
from test_parity import _hf, _hf_greedy, _prompts
from transformers import LlamaConfig, Qwen2Config

from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineArgs, spell_flags
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.weights.quantization import (SCHEMES, PanelQuantized, TorchQuantized, dequantize_int4,
                                                  dequantize_int8, pack_nibbles, parse_scheme, quantize_int4,
                                                  quantize_int8, unpack_nibbles)

NAMES = sorted(SCHEMES)


AVX512 = {"avx512f", "avx512bw", "avx512vl"}
VNNI = AVX512 | {"avx512_vnni", "avx512vbmi"}


def _builds() -> list[str]:
    """The kernel builds this CPU runs: AVX2 wherever the kernels build, AVX-512 where present,
    and ("auto") the AVX-512 build with VNNI's integer dot products for decode rows."""
    flags = cpu_kernels._cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return []
    out = ["avx2"]
    if AVX512 <= flags:
        out.append("avx512")
    if VNNI <= flags:
        out.append("auto")
    return out


@pytest.fixture(params=_builds())
def kernel_build(request, monkeypatch):
    """Each build of our quantized kernel in turn (TOKENLOOM_CPU_QUANT picks it)."""
    monkeypatch.setenv("TOKENLOOM_CPU_QUANT", request.param)
    cpu_kernels.quant_ops.cache_clear()
    if cpu_kernels.quant_ops() is None:
        pytest.skip("our quantized CPU kernel does not build here")
    yield request.param
    cpu_kernels.quant_ops.cache_clear()


def test_kernel_builds_where_the_cpu_has_the_instructions(monkeypatch):
    from test_kernel_builds import has_toolchain

    if not has_toolchain:
        pytest.skip("needs a C++ toolchain with ninja")
    flags = cpu_kernels._cpu_flags()
    monkeypatch.delenv("TOKENLOOM_CPU_QUANT", raising=False)
    cpu_kernels.quant_ops.cache_clear()
    ops = cpu_kernels.quant_ops()
    if {"avx2", "fma", "f16c"} | VNNI <= flags:
        assert ops is torch.ops.tokenloom_q512v
    elif {"avx2", "fma", "f16c"} | AVX512 <= flags:
        assert ops is torch.ops.tokenloom_q512
    elif {"avx2", "fma", "f16c"} <= flags:
        assert ops is torch.ops.tokenloom_q256
    else:
        assert ops is None


# ---------------------------------------------------------------- round trip


def test_int8_round_trip_within_half_a_step_per_row():
    w = torch.randn(37, 91, generator=torch.Generator().manual_seed(0)) * 3
    w[5] = 0  # an all-zero row keeps a usable scale
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize_int8(q, s)[5], torch.zeros(91))
    # the largest magnitude of each row lands on +-127 exactly
    assert (q.abs().amax(dim=1)[s > 0][torch.arange(37) != 5] == 127).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_round_trip_within_one_step_per_group(group):
    k = 200  # not a multiple of either group: padded
    w = torch.randn(19, k, generator=torch.Generator().manual_seed(1))
    q, s = quantize_int4(w, group)
    kp = -(-k // group) * group
    assert q.shape == (19, kp) and s.shape == (19, kp // group) and s.dtype == torch.bfloat16
    assert q.min() >= -8 and q.max() <= 7
    d = dequantize_int4(q, s, k)
    step = s.float().abs().repeat_interleave(group, dim=1)[:, :k]
    err = (d - w).abs()
    # Clamping at +7 costs at most one step, and the scale's rounding to bfloat16 (2^-9 relative,
    # times 8 levels) up to 1/32 of a step more.
    assert (err <= step * (1 + 1 / 32)).all()
    assert err.mean() < step.mean() / 3  # rounding, mostly within half a step
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


def test_scheme_names_and_bytes_per_weight():
    assert parse_scheme("int4").group == 32 and parse_scheme("int4-g128").group == 128
    assert parse_scheme("int8").bytes_per_weight(896) == pytest.approx(1 + 4 / 896)
    assert parse_scheme("int4").bytes_per_weight(896) == pytest.approx(0.5 + 2 / 32)
    with pytest.raises(ValueError, match="int8"):
        parse_scheme("int3")


# ---------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,k", [(70, 100), (64, 256), (96, 33)])
def test_kernel_multiplies_by_the_dequantized_weight(kernel_build, name, n, k):
    g = torch.Generator().manual_seed(n * k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    scheme = parse_scheme(name)
    ours, generic = PanelQuantized(w, scheme), TorchQuantized(w, scheme)
    deq = generic.dequantize()
    assert torch.equal(ours.dequantize(), deq)  # the same quantized weight in either layout
    pad = ours.qweight.shape[0] * 32
    padded_bias = torch.nn.functional.pad(bias, (0, pad - n))
    for m in (1, 3, 32, 100):
        x = torch.randn(m, k, generator=g)
        ref = (x.double() @ deq.double().t() + bias.double()).float()
        tol = 2e-5 * math.sqrt(k) * x.abs().max().item() * deq.abs().max().item()
        torch.testing.assert_close(ours.matmul(x, padded_bias), ref, atol=tol, rtol=0)
        torch.testing.assert_close(generic.matmul(x, bias), ref, atol=tol, rtol=0)
    xb = torch.randn(2, 5, k, generator=g).bfloat16()  # leading dims kept, bf16 in, bf16 out
    y = ours.matmul(xb, None)
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, generic.matmul(xb, None), atol=1e-2 * deq.abs().max().item() * math.sqrt(k), rtol=1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_decode_rows_keep_activation_precision_across_magnitudes(kernel_build, name):
    """Decode rows (1-4) on the VNNI build multiply by activations split into three byte limbs
    per block of 32 (kernels/quant_vnni.h): each activation is kept to 2^-20 of its block's
    largest, far below bfloat16's own rounding, even beside an outlier 10^4 times larger."""
    g = torch.Generator().manual_seed(11)
    n, k = 96, 512
    w = torch.randn(n, k, generator=g)
    scheme = parse_scheme(name)
    ours = PanelQuantized(w, scheme)
    deq = TorchQuantized(w, scheme).dequantize().double()
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k, dtype=torch.float32)
        x[:, 5] = 1e4  # an outlier channel, as LLM activations have
        blockmax = x.abs().view(m, -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
        bound = (blockmax * 2.0**-20) @ deq.abs().t() + 1e-6 * (x.double().abs() @ deq.abs().t())
        err = (ours.matmul(x, None).double() - x.double() @ deq.t()).abs()
        assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("name", NAMES)
def test_bf16_decode_rows_keep_activations_to_2_to_the_minus_13(kernel_build, name):
    """bfloat16 activations take two limbs on the VNNI build (kernels/quant_vnni.h): each kept to
    2^-13 of its block's largest (one unit of the second limb); the weights' own rounding is ~30
    (int8) to ~500 (int4) times coarser.  The result is rounded to bfloat16, so the check reads
    one weight per output (y[j] = x[at[j]] * w[j]): small activations beside a block's largest
    show their own error, not the rounding of a large sum."""
    if cpu_kernels.quant_ops() is not getattr(torch.ops, "tokenloom_q512v", None):
        pytest.skip("the integer path is the VNNI build's")
    g = torch.Generator().manual_seed(17)
    n, k = 96, 512
    at = torch.randperm(k, generator=g)[:n]
    w = torch.zeros(n, k)
    w[torch.arange(n), at] = torch.rand(n, generator=g) + 0.5
    ours = PanelQuantized(w, parse_scheme(name))
    deq = ours.dequantize().double()[torch.arange(n), at]
    for m in (1, 3, 4, 16, 37):  # every count of bfloat16 rows takes the integer path
        x = torch.rand(m, k, generator=g) * torch.logspace(-12, 0, k, base=2.0)[torch.randperm(k, generator=g)]
        x[:, ::32] = 1.0  # each block's largest
        x = (x * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)).bfloat16()
        ref = x.double()[:, at] * deq
        got = ours.matmul(x, None).double()
        bound = 2.0**-13 * deq.abs() + 2.0**-8 * ref.abs()
        assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max()


@pytest.mark.parametrize("name", NAMES)
def test_integer_path_rows_do_not_depend_on_the_rows_beside_them(kernel_build, name):
    """On the VNNI build, float32 rows up to 8 and bfloat16 rows of any count take the integer
    path, each row on its own arithmetic: row i of an M-row call is bit for bit the 1-row call (a
    speculative verifying step of k + 1 rows must give what one-row steps give; in bfloat16 a
    batch of any size, a prefill's rows too, each split in parallel)."""
    if cpu_kernels.quant_ops() is not getattr(torch.ops, "tokenloom_q512v", None):
        pytest.skip("the integer path is the VNNI build's")
    g = torch.Generator().manual_seed(13)
    ours = PanelQuantized(torch.randn(80, 320, generator=g), parse_scheme(name))
    x = torch.randn(300, 320, generator=g)  # float32 out: the sums unrounded
    one = torch.cat([ours.matmul(x[i:i + 1], None) for i in range(8)])
    for m in range(2, 9):
        assert torch.equal(ours.matmul(x[:m], None), one[:m]), m
    xb = x.bfloat16()  # two limbs (5 rows in one pass, then four at a time)
    one = torch.cat([ours.matmul(xb[i:i + 1], None) for i in range(len(xb))])
    for m in (2, 5, 8, 9, 16, 33, 300):
        assert torch.equal(ours.matmul(xb[:m], None), one[:m]), m


@pytest.mark.parametrize("name", NAMES)
def test_decode_rows_propagate_inf_and_nan(kernel_build, name):
    ours = PanelQuantized(torch.randn(64, 256, generator=torch.Generator().manual_seed(5)), parse_scheme(name))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 256)
        x[1, 40] = bad
        y = ours.matmul(x, None)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_rows_propagate_inf_and_nan(kernel_build, name):
    """bfloat16 rows of a prefill take the integer path, their limbs split in parallel (256 rows a
    piece at K = 256): a value that is not finite in a later piece still sends the call to the
    float path, which keeps it to its own row."""
    ours = PanelQuantized(torch.randn(64, 256, generator=torch.Generator().manual_seed(6)), parse_scheme(name))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(600, 256).bfloat16()
        x[550, 40] = bad
        y = ours.matmul(x, None)
        finite = torch.isfinite(y).all(dim=1)
        assert not finite[550] and finite[:550].all() and finite[551:].all()


@pytest.mark.parametrize("name", NAMES)
def test_tied_head_rows_read_back_from_the_panels(kernel_build, name):
    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(3))
    scheme = parse_scheme(name)
    ours, generic = PanelQuantized(w, scheme), TorchQuantized(w, scheme)
    ids = torch.tensor([[0, 31, 32], [47, 99, 16]])
    assert torch.equal(ours.rows(ids), generic.rows(ids))
    assert torch.equal(ours.rows(ids), generic.dequantize()[ids])


# ---------------------------------------------------------------- the engine


def _fake_quantized_hf(path, name: str, load=_hf):
    """transformers' model (`load(path)`) with each matmul weight replaced by its dequantized
    quantization (the tied embedding too; an untied input embedding is only gathered and stays as is)."""
    hf = load(path)
    scheme = parse_scheme(name)
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(TorchQuantized(mod.weight, scheme).dequantize())
        if hf.config.tie_word_embeddings:
            emb = hf.get_input_embeddings().weight
            emb.copy_(TorchQuantized(emb, scheme).dequantize())
    return hf


CONFIGS = {
    "qwen2-bias-untied": lambda: Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e6),
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=1e4),
}
ENGINE = dict(block_size=4, max_num_batched_tokens=12, num_kv_blocks=160, max_model_len=128)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name,backend", [("int8", "auto"), ("int4", "auto"), ("int4-g128", "torch")])
def test_engine_generates_what_transformers_generates_with_the_dequantized_weights(tmp_path, config, name, backend):
    path = _save_checkpoint(CONFIGS[config](), tmp_path)
    prompts, n = _prompts()[:3], 8
    hf = _fake_quantized_hf(path, name)
    llm = LLM(str(path), quantization=name, linear_backend=backend, **ENGINE)
    if backend == "auto" and cpu_kernels.quant_ops() is not None:
        assert llm.llm_engine.loaded.linear_backend == "panels"
    assert llm.llm_engine.loaded.quantization == name
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, n)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < 1e-4


@pytest.mark.parametrize("name,tol", [("int8", 0.06), ("int4", 0.6)])  # measured 0.029, 0.33
def test_quantized_bundled_model_stays_close_to_full_precision(name, tol):
    """The bundled (trained) model with and without quantization: the same greedy tokens for a
    short generation, and top log-probabilities of every step within `tol` nats."""
    prompts = ["def quicksort(arr):\n", "import os\n\n\nclass ", "    for i in range(len("]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = {q: LLM(quantization=q, max_model_len=128, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
            for q in (None, name)}
    for full, quant in zip(runs[None], runs[name]):
        if name == "int8":
            assert quant.outputs[0].token_ids == full.outputs[0].token_ids
        steps = next((i for i, (a, b) in enumerate(zip(full.outputs[0].token_ids, quant.outputs[0].token_ids))
                      if a != b), 8)  # compare while both followed the same tokens
        for i in range(max(steps, 1)):
            for tok, lp in full.outputs[0].logprobs[i].items():
                if tok in quant.outputs[0].logprobs[i]:
                    assert abs(quant.outputs[0].logprobs[i][tok].logprob - lp.logprob) < tol


def test_quantization_with_onednn_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="onednn"):
        LLM(str(tiny_llama), quantization="int8", linear_backend="onednn", max_model_len=64, num_kv_blocks=32)


# ---------------------------------------------------------------- flag, estimate


def test_cli_flag_round_trips():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", "int4-g128"])
    assert EngineArgs.from_cli_args(args).quantization == "int4-g128"
    assert spell_flags(parser, args) == ["--quantization", "int4-g128"]
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int2"])


@pytest.mark.parametrize("name", NAMES)
def test_estimator_counts_the_bytes_the_engine_stores(tiny_llama, name):
    """specs/model_spec.py's quantized bytes are the PyTorch path's buffers, byte for byte (the
    kernel's panels add only padding to whole panels)."""
    from tokenloom.specs.model_spec import load_model_spec

    llm = LLM(str(tiny_llama), quantization=name, linear_backend="torch", max_model_len=64, num_kv_blocks=32)
    loaded = llm.llm_engine.loaded
    rope = loaded.model.rope.cos.nbytes + loaded.model.rope.sin.nbytes
    dtype = str(loaded.dtype).removeprefix("torch.")
    assert loaded.weight_bytes - rope == load_model_spec(str(tiny_llama)).weight_bytes(dtype, name)


def test_estimate_reads_fewer_bytes_per_step_quantized():
    from tokenloom.sim.estimate import estimate
    from tokenloom.specs.hardware import get_hardware
    from tokenloom.specs.model_spec import load_model_spec

    spec, hw = load_model_spec("qwen2.5-0.5b"), get_hardware("rtx4090")
    full, q8, q4 = (estimate(spec, hw, "bfloat16", batch_sizes=(1,), quantization=q) for q in (None, "int8", "int4"))
    w = full.weight_bytes_streamed
    assert q8.weight_bytes_streamed == pytest.approx(w / 2, rel=0.01)
    assert q4.weight_bytes_streamed == pytest.approx(w * 4.5 / 16, rel=0.01)
    assert q8.quantization == "int8" and q4.decode[0].step_time_s < q8.decode[0].step_time_s < full.decode[0].step_time_s
