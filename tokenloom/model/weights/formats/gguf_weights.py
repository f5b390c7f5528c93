"""A GGUF file's tensors into our model: llama.cpp's names, llama's q/k row order, kept blocks.

Tensor names are llama.cpp's (`blk.3.attn_q.weight`); `hf_name` turns them into the names
transformers gives the same weights, so the loader's own mapping places them (q/k/v and
gate/up fused into one matrix each: model/weights/loader.py `_target`).  Then each of our
parameters is one of two kinds:

* kept: a linear's weight (fused or not, or the vocab matrix of a tied embedding) whose every
  part is a kept type (gguf_blocks.py): its blocks become one `QuantizedMatrix` -- int4 where
  every part is Q4_0, else int8 groups (a Q4_0 or Q5_0 part's integers fit int8 exactly) --
  run by our kernel (`PanelQuantized`) or, where it does not build or `--linear-backend torch`,
  by PyTorch ops (`TorchQuantized`); Q4_K as int4 with float32 scales and a per-group offset,
  which our kernel adds itself (PyTorch ops: around them, to_kernels.py `Prequantized`).  A
  fused matrix is its parts' rows stacked: a block never spans rows, so stacking changes no
  block.
* dense: everything else, read (dequantized where quantized) into the parameter in the model's
  dtype, to be packed for the linear backend like any checkpoint's weights.

llama.cpp's converter stores a llama-architecture file's q and k rows permuted (each head's two
rotary halves interleaved); they are put back here exactly as transformers' GGUF loader puts
them back -- on whole rows, so on the rows of a kept matrix's blocks and scales alike.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tokenloom.model.llama import CausalLM, ModelArgs
from tokenloom.model.weights.formats.gguf import open_file
from tokenloom.model.weights.formats.gguf_blocks import KEPT, T, dense, kept_blocks, q4_0_bytes, q4_k_groups
from tokenloom.model.weights.formats.gguf_file import GGUFTensor
from tokenloom.model.weights.quant_schemes import QuantScheme

log = logging.getLogger("tokenloom")

# The kept types as our kernel's schemes (quant_schemes.py): 4.5, 8.5 and 6 bits a weight.
Q4_0 = QuantScheme("gguf-q4_0", 4, 32)
Q8_0 = QuantScheme("gguf-q8_0", 8, 32)
Q4_K = QuantScheme("gguf-q4_k", 4, 32, group_bytes=8)  # a float32 scale and offset per group

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors llama.cpp writes that transformers' models have no place for: rotary frequency factors
# (rope_freqs), which gguf.py `open_file` accepts only when they are all 1 (no scaling).
_IGNORED = ("rope_freqs.weight",)
# Our parameters that are a linear's weight (kept quantized where their parts allow).
_LINEAR_RE = re.compile(r"^(lm_head|layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj))\.weight$")


def hf_name(name: str) -> str | None:
    """transformers' name for GGUF tensor `name`; None for one to skip.  ValueError for a
    name of no family we read (a fused qkv tensor, an MoE expert)."""
    if name in _IGNORED:
        return None
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no place in the llama / qwen2 / qwen3 models tokenloom runs")


def _row_order(arch: str, hf: str, a: ModelArgs) -> torch.Tensor | None:
    """Which stored row each of transformers' rows is, for a llama file's q / k weight or bias
    (llama.cpp's permute, undone); None where the rows are in order."""
    if arch != "llama" or not (".q_proj." in hf or ".k_proj." in hf):
        return None
    heads = a.num_heads if ".q_proj." in hf else a.num_kv_heads
    # stored row (h, i, t) is transformers' row (h, t, i): t picks a rotary half, i a pair
    return torch.arange(heads * a.head_dim).view(heads, a.head_dim // 2, 2).transpose(1, 2).reshape(-1)


# The loader's placement of a checkpoint name: (our parameter, which part of a fused one) or None,
# and a fused parameter's rows of part i (model/weights/loader.py `_target`, `_shard_bounds`).
Place = Callable[[str, ModelArgs], "tuple[str, int | None] | None"]
Bounds = Callable[[str, int, ModelArgs, int], "tuple[int, int]"]  # (name, part, args, rows in all)


def load_gguf_weights(path: Path, model: CausalLM, a: ModelArgs, params: dict[str, torch.nn.Parameter],
                      filled: dict[str, int], dtype: torch.dtype, device: torch.device, kernels: bool,
                      place: Place, bounds: Bounds) -> int:
    """Fill `model` from GGUF file `path`: dense parameters in `params` (counted in `filled`, as
    the loader counts a safetensors checkpoint's), kept matrices installed as quantized linears
    (`kernels`: in our CPU kernel's layout).  Returns how many matrices stay quantized."""
    reader = open_file(path)
    arch = reader.metadata["general.architecture"]
    parts: dict[str, list[tuple[GGUFTensor, int | None, torch.Tensor | None]]] = {}
    for t in reader.tensors:
        hf = hf_name(t.name)
        tgt = None if hf is None else place(hf, a)
        if tgt is None:
            continue
        pname, idx = tgt
        if pname not in params:
            raise ValueError(f"GGUF tensor {t.name!r} ({hf}) has no place in {a.architecture} ({pname})")
        parts.setdefault(pname, []).append((t, idx, _row_order(arch, hf, a)))
    kept = {p: ts for p, ts in parts.items() if _keeps(p, ts, a)}
    for pname, ts in parts.items():
        if pname in kept:
            filled[pname] = filled.get(pname, 0) + len(ts)
            continue
        for t, idx, rows in ts:
            _fill_dense(params[pname], pname, idx, t, rows, a, dtype, device, bounds)
            filled[pname] = filled.get(pname, 0) + 1
    for pname, ts in kept.items():
        _install(model, pname, ts, dtype, device, kernels)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    log.info("%s: tensors %s; %d matrices kept quantized (%s), the rest in %s", path.name,
             ", ".join(f"{n} x{c}" for n, c in sorted(types.items())), len(kept),
             "our kernel" if kernels else "PyTorch ops", str(dtype).removeprefix("torch."))
    return len(kept)


def _keeps(pname: str, ts: list, a: ModelArgs) -> bool:
    """Whether our parameter `pname` runs from its blocks: a linear's weight (or a tied vocab
    matrix) whose every part is a kept type -- all of them int4 where one is Q4_K (only the int4
    kernel takes offsets)."""
    linear = _LINEAR_RE.match(pname) is not None or (pname == "embed_tokens.weight" and a.tie_word_embeddings)
    types = [t.tensor_type for t, _, _ in ts]
    if T.Q4_K in types and any(KEPT.get(t) != "int4" for t in types):
        return False
    return linear and all(t in KEPT for t in types)


def _fill_dense(p: torch.nn.Parameter, pname: str, idx: int | None, t: GGUFTensor, rows: torch.Tensor | None,
                a: ModelArgs, dtype: torch.dtype, device: torch.device, bounds: Bounds) -> None:
    w = dense(t, dtype, rows)
    if idx is None:
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"GGUF tensor {t.name}: shape {tuple(w.shape)} != expected {tuple(p.shape)}")
        p.data = w.to(device)
        return
    lo, hi = bounds(pname, idx, a, p.shape[0])
    if tuple(w.shape) != (hi - lo, *p.shape[1:]):
        raise ValueError(f"GGUF tensor {t.name}: shape {tuple(w.shape)} != expected {(hi - lo, *p.shape[1:])}")
    if p.dtype != dtype:
        p.data = torch.empty(p.shape, dtype=dtype, device=device)
    p.data[lo:hi].copy_(w)


def _stack(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The parts of a fused matrix, rows stacked (integers, scales and offsets alike)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.from_numpy(np.concatenate([p[i].numpy() for p in parts])) for i in range(len(parts[0])))


def _q4_k_parts(t: GGUFTensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part of a matrix that holds Q4_K: (q, float32 scales, offsets), w = q s + o per group
    of 32 -- a Q4_0 part beside it as its float16 scales widened, with no offset."""
    if t.tensor_type == T.Q4_K:
        return q4_k_groups(t, rows)
    q, d = kept_blocks(t, rows)
    return q, d.float(), torch.zeros(d.shape, dtype=torch.float32)


def _install(model: CausalLM, pname: str, ts: list, dtype: torch.dtype, device: torch.device, kernels: bool) -> None:
    """Replace the linear (or the tied embedding and head) of `pname` by its kept blocks."""
    from tokenloom.model.weights.formats.to_kernels import Prequantized
    from tokenloom.model.weights.quantization import (PanelQuantized, QuantEmbedding, QuantLinear,
                                                      TorchQuantized)

    ts = sorted(ts, key=lambda x: x[1] or 0)
    make = PanelQuantized if kernels else TorchQuantized
    if any(t.tensor_type == T.Q4_K for t, _, _ in ts):  # int4, float32 scales and offsets
        q, s, o = _stack([_q4_k_parts(t, rows) for t, _, rows in ts])
        if kernels:  # the offsets inside our kernel
            inner = matrix = PanelQuantized.from_quantized(q, s, Q4_K, q.shape[1], offsets=o)
        else:
            inner = TorchQuantized.from_quantized(q.to(device), s.to(device), Q4_K, q.shape[1])
            matrix = Prequantized(inner, None, o.to(device), Q4_K.group)
    elif all(KEPT[t.tensor_type] == "int4" for t, _, _ in ts):
        if kernels:  # our panels straight from the file's nibbles
            blocks, d = _stack([q4_0_bytes(t, rows) for t, _, rows in ts])
            inner = matrix = PanelQuantized.from_int4_blocks(blocks, d, Q4_0)
        else:
            q, d = _stack([kept_blocks(t, rows) for t, _, rows in ts])
            inner = matrix = make.from_quantized(q.to(device), d.to(device), Q4_0, q.shape[1])
    else:
        q, d = _stack([kept_blocks(t, rows) for t, _, rows in ts])
        inner = matrix = make.from_quantized(q.to(device), d.to(device), Q8_0, q.shape[1])
    pad = inner.qweight.shape[0] * 32 if kernels else None
    module = pname.removesuffix(".weight")
    if module == "embed_tokens":  # tied: one matrix for the lookup and the head
        if (matrix.out_features, matrix.in_features) != tuple(model.embed_tokens.weight.shape):
            raise ValueError(f"GGUF tensor token_embd.weight: shape {(matrix.out_features, matrix.in_features)} "
                             f"!= expected {tuple(model.embed_tokens.weight.shape)}")
        model.embed_tokens = QuantEmbedding(matrix, dtype)
        model.lm_head = QuantLinear(matrix, None, pad)
        return
    parent_name, _, attr = module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    expect = tuple(old.weight.shape)
    if (matrix.out_features, matrix.in_features) != expect:
        raise ValueError(f"GGUF tensors {', '.join(t.name for t, _, _ in ts)}: shape "
                         f"{(matrix.out_features, matrix.in_features)} != expected {expect}")
    setattr(parent, attr, QuantLinear(matrix, old.bias, pad))

