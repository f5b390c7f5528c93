"""Checkpoints that arrive quantized: GPTQ, AWQ and compressed-tensors (model/weights/formats/).

Each checkpoint is a quantized model in its own right: the one whose weights are its dequantized
matrices.  So for each format and setting: build the checkpoint (compressed-tensors with the
compressed-tensors library itself; GPTQ and AWQ with tests/prequant_packing.py, written from the
formats' published layouts), dequantize it with the reference math (the library's own
decompression, or the packer's), put those weights into transformers' own model, and check that
the engine generates the same greedy tokens with log-probabilities within 1e-4 -- and that each
layer ran where it should: on our int4 / int8 kernel where the layouts meet, dense where not.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from prequant_packing import AWQ_ORDER, _pack_rows, pack_awq, pack_gptq, quantize
from safetensors import safe_open
from safetensors.torch import save_file
from test_hf_checkpoints import TINY, _save_checkpoint
from test_parity import _hf, _hf_greedy, _prompts
from transformers import LlamaConfig, Qwen2Config

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.weights.formats import checkpoint_format
from tokenloom.model.weights.formats.int_weight import unpack_int32
from tokenloom.model.weights.formats.to_kernels import Prequantized, kernel_takes_fp16_scales
from tokenloom.model.weights.packed_linear import PanelLinear
from tokenloom.model.weights.quantization import PanelQuantized, QuantLinear, TorchQuantized

# Inputs of 128 and 256, so groups of 32, 64 and 128 all divide them.
SMALL = dict(TINY, hidden_size=128, intermediate_size=256)
ENGINE = dict(block_size=4, max_num_batched_tokens=12, num_kv_blocks=160, max_model_len=128)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
KERNEL = cpu_kernels.quant_ops() is not None


def _linears(sd: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix(".weight") for n in sd if n.rpartition(".")[0].rpartition(".")[2] in PROJ
                  and n.endswith(".weight"))


def _write(path: Path, sd: dict[str, torch.Tensor], quantization_config: dict) -> None:
    """Replace the checkpoint's weights by `sd` and declare its quantization in config.json."""
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))


def _reference_hf(dense: Path, weights: dict[str, torch.Tensor]):
    """transformers' model from the dense checkpoint with these (dequantized) weights put in."""
    hf = _hf(dense)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name + ".weight"].copy_(w)
    return hf


def _gptq_awq_checkpoint(tmp_path: Path, config, fmt: str, bits: int = 4, group: int = 128, sym: bool = True,
                         desc_act: bool = False, v1: bool = True, shared_order: bool = True):
    """A GPTQ or AWQ checkpoint of a random model and transformers' model with its dequantized
    weights.  desc_act: each layer's inputs in a random order (shared by the projections that
    read the same input, as GPTQ's Hessian order is, unless `shared_order` is off)."""
    dense = _save_checkpoint(config, tmp_path / "dense")
    with safe_open(str(dense / "model.safetensors"), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(7)
    orders: dict[str, torch.Tensor] = {}
    reference = {}
    for name in _linears(sd):
        w = sd.pop(name + ".weight")
        order = None
        if desc_act:
            key = name.rpartition(".")[0] + "." + SHARED_INPUT.get(name.rpartition(".")[2], name) \
                if shared_order else name
            order = orders.setdefault(key, torch.randperm(w.shape[1], generator=g))
        q = quantize(w, bits, group, sym, order, min_zero=1 if (fmt == "gptq" and v1) else 0)
        reference[name] = q.reference()
        packed = pack_gptq(q, v1) if fmt == "gptq" else pack_awq(q)
        sd.update({f"{name}.{k}": v for k, v in packed.items()})
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01, "true_sequential": True}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    out = tmp_path / fmt
    shutil.copytree(dense, out)
    _write(out, sd, qc)
    return out, _reference_hf(dense, reference), reference


def _generate_and_compare(path: Path, hf, **engine) -> LLM:
    prompts, n = _prompts()[:3], 8
    llm = LLM(str(path), dtype="float32", **ENGINE, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf, prompts, n)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < 1e-4
    return llm


def _layer(llm: LLM, name: str):
    """Our module for a fused projection ("qkv_proj", "gate_up_proj") or o_proj / down_proj of layer 0."""
    layer = llm.llm_engine.loaded.model.layers[0]
    return getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)


def _check_matrix(llm: LLM, reference: dict[str, torch.Tensor], fused: str, parts: tuple[str, ...]) -> None:
    """Our layer-0 matrix, dequantized, is the reference's exactly (fused parts stacked)."""
    mod = _layer(llm, fused)
    block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
    want = torch.cat([reference[f"model.layers.0.{block}.{p}"] for p in parts])
    if isinstance(mod, QuantLinear):
        got = mod.matrix.dequantize()
    elif isinstance(mod, PanelLinear):  # dense, packed for our GEMM: read its rows back
        got = cpu_kernels.packed_rows(mod.weight, torch.arange(mod.out_features), mod.in_features).float()
    else:
        got = mod.weight.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _kind(mod) -> str:
    """How a layer runs: kernel (our quantized CPU kernel), torch (PyTorch's quantized path),
    +zeros / +order where the zero-point correction or the input order wraps it, or dense."""
    if not isinstance(mod, QuantLinear):
        return "dense"
    m, extra = mod.matrix, ""
    if isinstance(m, Prequantized):
        extra = ("+zeros" if m.correction is not None else "") + ("+order" if m.perm is not None else "")
        m = m.inner
    elif getattr(m, "offsets", None) is not None:  # our int4 kernel adding the zero points itself
        extra = "+zeros"
    return ("kernel" if isinstance(m, PanelQuantized) else "torch" if isinstance(m, TorchQuantized) else "?") + extra


# ---------------------------------------------------------------- unpacking


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_reads_what_the_spec_packers_write(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (24, 64), generator=g)
    along_rows = _pack_rows(codes, bits)  # [24 * bits / 32, 64]: packed along dim 0
    assert torch.equal(unpack_int32(along_rows, bits, 0, 24).long(), codes)
    along_cols = _pack_rows(codes.t(), bits).t()
    assert torch.equal(unpack_int32(along_cols, bits, 1, 64).long(), codes)
    if bits == 4:
        awq = _pack_rows(codes.t(), 4, AWQ_ORDER).t()
        assert torch.equal(unpack_int32(awq, 4, 1, 64, AWQ_ORDER).long(), codes)
        assert not torch.equal(unpack_int32(awq, 4, 1, 64).long(), codes)  # the interleave matters


# ---------------------------------------------------------------- GPTQ


GPTQ_CASES = {
    # name: (bits, group, sym, desc_act, v1)
    "int4-g128-sym-v1": (4, 128, True, False, True),  # the common AutoGPTQ layout
    "int4-g32-asym-descact-v1": (4, 32, False, True, True),
    "int4-g64-sym-descact-v2": (4, 64, True, True, False),
    "int4-g128-asym-v2": (4, 128, False, False, False),
    "int8-perrow-sym": (8, -1, True, True, True),
    "int8-g64-asym": (8, 64, False, False, True),
}


def _expected_gptq_kind(bits: int, group: int, sym: bool, desc_act: bool) -> str:
    if bits == 8:
        return "kernel" if group == -1 else "dense"  # our int8 kernel: one scale per row
    if not kernel_takes_fp16_scales():
        return "dense"  # fp16 scales that our int4 kernel cannot hold exactly (bf16 only here)
    return "kernel" + ("" if sym else "+zeros") + ("+order" if desc_act else "")


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_generates_what_transformers_generates_with_the_dequantized_weights(tmp_path, case):
    bits, group, sym, desc_act, v1 = GPTQ_CASES[case]
    path, hf, ref = _gptq_awq_checkpoint(tmp_path, LlamaConfig(**SMALL, rope_theta=1e4), "gptq", bits, group, sym,
                                         desc_act, v1)
    llm = _generate_and_compare(path, hf)
    assert "gptq" in llm.llm_engine.backends.prequantized
    if KERNEL:
        assert llm.llm_engine.loaded.linear_backend == "panels"
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert _kind(_layer(llm, name)) == _expected_gptq_kind(bits, group, sym, desc_act), name
    _check_matrix(llm, ref, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    _check_matrix(llm, ref, "down_proj", ("down_proj",))


def test_gptq_desc_act_orders_that_differ_within_a_fused_projection_are_dequantized(tmp_path):
    path, hf, ref = _gptq_awq_checkpoint(tmp_path, Qwen2Config(**SMALL, rope_theta=1e6), "gptq", 4, 32, False,
                                         desc_act=True, shared_order=False)
    llm = _generate_and_compare(path, hf)
    assert _kind(_layer(llm, "qkv_proj")) == "dense"
    if KERNEL and kernel_takes_fp16_scales():
        assert _kind(_layer(llm, "o_proj")) == "kernel+zeros+order"  # one weight: its own order serves
    _check_matrix(llm, ref, "qkv_proj", ("q_proj", "k_proj", "v_proj"))


# ---------------------------------------------------------------- AWQ


@pytest.mark.parametrize("group,backend", [(128, "auto"), (64, "auto"), (32, "torch")])
def test_awq_generates_what_transformers_generates_with_the_dequantized_weights(tmp_path, group, backend):
    config = Qwen2Config(**SMALL, rope_theta=1e6, tie_word_embeddings=False)  # q/k/v biases beside qweight
    path, hf, ref = _gptq_awq_checkpoint(tmp_path, config, "awq", 4, group, sym=False)
    llm = _generate_and_compare(path, hf, linear_backend=backend)
    if backend == "torch":
        want = "torch+zeros"
    elif KERNEL:
        want = "kernel+zeros" if kernel_takes_fp16_scales() else "dense"
    else:
        want = "torch+zeros"
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert _kind(_layer(llm, name)) == want, name
    _check_matrix(llm, ref, "gate_up_proj", ("gate_proj", "up_proj"))
    _check_matrix(llm, ref, "o_proj", ("o_proj",))


# ---------------------------------------------------------------- compressed-tensors


def _ct_checkpoint(tmp_path: Path, weights: dict, dtype: torch.dtype):
    """A checkpoint quantized and packed by the compressed-tensors library (its own `calculate_qparams`
    on each group's min/max, its ModelCompressor), and transformers' model with the weights the
    library's own decompression gives (its dequantize, in float32)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    dense = _save_checkpoint(LlamaConfig(**SMALL, rope_theta=1e4), tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=dtype)
    model.save_pretrained(dense)  # the reference's unquantized weights (embeddings, norms) as rounded to `dtype`
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "quantization_scheme"):
                w = mod.weight.float()
                g = w.unflatten(1, (-1, args.group_size)) if args.strategy == "group" else w[:, None, :]
                s, z = calculate_qparams(g.amin(-1), g.amax(-1), args)
                mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
                if hasattr(mod, "weight_zero_point"):
                    mod.weight_zero_point.copy_(z.reshape(mod.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = tmp_path / "ct"
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in dense.iterdir():  # the tokenizer
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    reference = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        for name in {n.rpartition(".")[0] for n in names if n.endswith(".weight_packed")}:
            state = {k.rpartition(".")[2]: f.get_tensor(k) for k in names if k.rpartition(".")[0] == name}
            state["weight_scale"] = state["weight_scale"].float()  # the library's dequantize, exact in float32
            reference[name] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return out, _reference_hf(dense, {k: v for k, v in reference.items()}), reference


CT_CASES = {
    # W4A16 (the preset: int4, groups of 128, symmetric) in bf16: maps onto our int4 kernel as is
    "w4a16-g128": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
                   torch.bfloat16, "kernel"),
    # W8A16 (int8, one scale per channel): our int8 kernel exactly
    "w8a16-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), torch.bfloat16, "kernel"),
    # W4A16_ASYM with groups of 32 (packed zero points): the kernel plus the zero-point correction
    "w4a16-asym-g32": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                       torch.bfloat16, "kernel+zeros"),
    # float32 scales that neither bf16 nor fp16 holds exactly: dequantized at load
    "w4a16-g64-fp32": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64),
                       torch.float32, "dense"),
}


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_generates_what_transformers_generates_with_the_library_dequantized_weights(
        tmp_path, case):
    weights, dtype, want = CT_CASES[case]
    path, hf, ref = _ct_checkpoint(tmp_path, weights, dtype)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    llm = _generate_and_compare(path, hf)
    if KERNEL:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert _kind(_layer(llm, name)) == want, name
        # the LM head the checkpoint kept dense runs on our dense GEMM, not as a quantized layer
        assert not isinstance(llm.llm_engine.loaded.model.lm_head, QuantLinear)
    _check_matrix(llm, ref, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    _check_matrix(llm, ref, "down_proj", ("down_proj",))


# ---------------------------------------------------------------- refusals


def _qc(method: str, **kw) -> dict:
    base = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128}}}},
    }[method]
    return {**base, **kw}


def _ct_group(**weights) -> dict:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, **weights}
    return {"group_0": {"targets": ["Linear"], "weights": w}}


REFUSED = {
    "unknown method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method = 'bitsandbytes'"),
    "fp8 method": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"quant_method = 'fp8'"),
    "gptq 3 bits": (_qc("gptq", bits=3), r"quantization_config\.bits = 3"),
    "gptq marlin layout": (_qc("gptq", checkpoint_format="marlin"), r"checkpoint_format = 'marlin'"),
    "gptq dynamic": (_qc("gptq", dynamic={"-:.*down": {}}), r"quantization_config\.dynamic"),
    "awq gemv": (_qc("awq", version="gemv"), r"version = 'gemv'"),
    "awq 8 bits": (_qc("awq", bits=8), r"bits = 8"),
    "awq no zero point": (_qc("awq", zero_point=False), r"zero_point = False"),
    "ct W8A8": (_qc("compressed-tensors", config_groups={"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}),
        r"config_groups\.group_0\.input_activations"),
    "ct fp8": (_qc("compressed-tensors", format="float-quantized"), r"format = 'float-quantized'"),
    "ct float weights": (_qc("compressed-tensors", config_groups=_ct_group(type="float", num_bits=8)),
                         r"weights\.type = 'float'"),
    "ct 2 bits": (_qc("compressed-tensors", config_groups=_ct_group(num_bits=2)), r"weights\.num_bits = 2"),
    "ct tensor strategy": (_qc("compressed-tensors", config_groups=_ct_group(strategy="tensor")),
                           r"weights\.strategy = 'tensor'"),
    "ct not compressed": (_qc("compressed-tensors", quantization_status="frozen"), r"quantization_status = 'frozen'"),
    "ct sparse": (_qc("compressed-tensors", sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused_naming_them(case):
    qc, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        checkpoint_format({"quantization_config": qc})


def test_refused_at_load_before_any_weight_is_read(tmp_path):
    path = _save_checkpoint(LlamaConfig(**TINY), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = _qc("gptq", bits=2)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config\.bits = 2"):
        LLM(str(path), max_model_len=64, num_kv_blocks=32)


@pytest.mark.parametrize("engine,message", [
    (dict(quantization="int8"), "already quantized"),
    (dict(linear_backend="onednn"), "onednn"),
    (dict(tensor_parallel_size=2), "tensor-parallel-size"),
])
def test_engine_settings_that_cannot_hold_a_prequantized_checkpoint_are_refused(tmp_path, engine, message):
    path, _, _ = _gptq_awq_checkpoint(tmp_path, LlamaConfig(**SMALL, rope_theta=1e4), "awq")
    with pytest.raises(ValueError, match=message):
        LLM(str(path), max_model_len=64, num_kv_blocks=32, **engine)


def test_scales_repeat_exactly_over_the_kernel_groups():
    """A per-row int4 scale (GPTQ group_size -1) over a K that is not a multiple of 128: the
    kernel's groups of 128 each carry the row's scale, the padding adds nothing."""
    from tokenloom.model.weights.formats.int_weight import IntWeight
    from tokenloom.model.weights.formats.to_kernels import map_weight

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (40, 200), generator=g).to(torch.uint8)
    scales = torch.rand(40, 1, generator=g).to(torch.bfloat16)
    w = IntWeight(bits=4, codes=codes, scales=scales, zeros=None, group=200)
    mapped = map_weight([w], panels=KERNEL, dtype=torch.float32)
    assert mapped.matrix is not None and "groups of 128" in mapped.why
    torch.testing.assert_close(mapped.matrix.dequantize(), w.dequantize(), rtol=0, atol=0)
    x = torch.randn(3, 200, generator=g)
    ref = (x.double() @ w.dequantize().double().t()).float()
    tol = 2e-5 * math.sqrt(200) * x.abs().max().item() * w.dequantize().abs().max().item()
    torch.testing.assert_close(mapped.matrix.matmul(x, None), ref, atol=tol, rtol=0)


def _kernel_paths() -> list[bool]:
    return [True, False] if KERNEL else [False]


@pytest.mark.parametrize("panels", _kernel_paths(), ids=lambda p: "panels" if p else "torch")
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, -1)])
def test_zero_points_and_input_order_wrap_the_kernel_exactly(panels, bits, group):
    """Zero points (the per-group correction) and a desc_act input order (x gathered to it)
    around our kernel: the matrix is the checkpoint's, and so are its products with x, at decode
    row counts (the VNNI integer path) and batched ones, in float32 and bfloat16."""
    from tokenloom.model.weights.formats.int_weight import IntWeight
    from tokenloom.model.weights.formats.to_kernels import map_weight

    g = torch.Generator().manual_seed(bits * 1000 + group)
    n, k = 96, 256
    gs = k if group == -1 else group
    groups = -(-k // gs)
    order = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // gs
    dtype = torch.float16 if (not panels or kernel_takes_fp16_scales()) else torch.bfloat16
    w = IntWeight(bits=bits, codes=torch.randint(0, 2 ** bits, (n, k), generator=g).to(torch.uint8),
                  scales=(torch.rand(n, groups, generator=g) / 8).to(dtype),
                  zeros=torch.randint(0, 2 ** bits, (n, groups), generator=g), group=gs, g_idx=g_idx)
    mapped = map_weight([w], panels=panels, dtype=torch.float32)
    kind = ("kernel" if panels else "torch") + "+zeros" + ("+order" if group != -1 else "")  # one group: no order
    assert _kind(QuantLinear(mapped.matrix, None)) == kind
    deq = w.dequantize()
    torch.testing.assert_close(mapped.matrix.dequantize(), deq, rtol=0, atol=0)
    for m in (1, 3, 8, 20):
        x = torch.randn(m, k, generator=g)
        ref = (x.double() @ deq.double().t()).float()
        tol = 3e-5 * math.sqrt(k) * x.abs().max().item() * deq.abs().max().item()
        torch.testing.assert_close(mapped.matrix.matmul(x, None), ref, atol=tol, rtol=0)
        yb = mapped.matrix.matmul(x.bfloat16(), None)
        assert yb.dtype == torch.bfloat16
        torch.testing.assert_close(yb.float(), (x.bfloat16().double() @ deq.double().t()).float(),
                                   atol=tol + 1e-2 * ref.abs().max().item(), rtol=0)
