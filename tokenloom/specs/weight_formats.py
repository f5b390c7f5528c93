"""Weight and KV-cache formats as bytes: what a decode step streams for each way of storing a model.

A decode step reads every weight once, so its time is set by how many bytes the format
stores per weight -- scales, zero-points and group indices included -- and by which tensors
the format leaves unquantized.  This module is that arithmetic, tensor by tensor, for the
formats tokenloom loads and the ones GPU engines serve:

* the checkpoint dtypes (float16, bfloat16, float32);
* the engine's own weight-only schemes (`int8`, `int4`, `int4-g128`, model/weights/quant_schemes.py);
* GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K and llama.cpp's Q4_K_M / Q5_K_M
  mixtures, which give attn_v and ffn_down more bits in some layers and the output Q6_K);
* GPTQ and AWQ (packed int4/int8, one fp16 scale per group, packed zero-points, GPTQ's g_idx),
  compressed-tensors (pack-quantized w4a16 / w8a16, w8a8 int8, fp8), with the head left in
  16 bits as those tools do;
* MLC's q4f16_1 (head and embedding quantized too) and the int4 of PyTorch's tinygemm kernel
  (gpt-fast, torchao: a bf16 scale *and* zero per group of 32, 5 bits a weight).

`compute` says which tensor-core rate the GEMMs run at: 16-bit for weight-only formats
(dequantized to fp16/bf16 on the fly), fp8 or int8 for W8A8 formats, which is how FP8 gets
its 2x rate.  `kernel` names the kernel family whose streaming efficiency applies
(`sim.efficiency`).  Pure Python, no torch: the simulator's clock calls into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

# ---------------------------------------------------------------- GGUF block types
# (weights per block, bytes per block), from ggml's block layouts: Q8_0 = 32 int8 + an fp16
# scale; Q4_0 = 32 nibbles + fp16 scale; Q4_1/Q5_1 add an fp16 minimum; K-quants are
# 256-weight super-blocks with 6-bit (Q4_K/Q5_K: 12 bytes) or 8-bit (Q6_K: 16 bytes) sub-scales
# and an fp16 super-scale (and minimum).
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}


def gguf_bits(block_type: str) -> float:
    n, nbytes = GGUF_BLOCKS[block_type]
    return 8.0 * nbytes / n


# The roles of a decoder layer's linear weights (names as in llama.cpp's GGUF tensors).
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class Tensor:
    """One weight matrix: its role, the layer it sits in (-1 outside the layers), shape [n, k]."""

    role: str  # one of ROLES, "output" (the vocab projection) or "token_embd"
    layer: int
    n: int  # output features (rows)
    k: int  # input features (the dimension groups run along)

    @property
    def params(self) -> int:
        return self.n * self.k


def linear_tensors(hidden: int, q_dim: int, kv_dim: int, intermediate: int, num_layers: int) -> Iterator[Tensor]:
    """Every decoder-layer linear weight of a Llama-shaped (SwiGLU, GQA) decoder."""
    for i in range(num_layers):
        yield Tensor("attn_q", i, q_dim, hidden)
        yield Tensor("attn_k", i, kv_dim, hidden)
        yield Tensor("attn_v", i, kv_dim, hidden)
        yield Tensor("attn_output", i, hidden, q_dim)
        yield Tensor("ffn_gate", i, intermediate, hidden)
        yield Tensor("ffn_up", i, intermediate, hidden)
        yield Tensor("ffn_down", i, hidden, intermediate)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_mixture(base: str, more: str) -> Callable[[Tensor, int], str]:
    """llama.cpp's *_K_M mixtures: attn_v and ffn_down in `more` where use_more_bits, else `base`."""
    def block(t: Tensor, num_layers: int) -> str:
        if t.role in ("attn_v", "ffn_down") and _more_bits(t.layer, num_layers):
            return more
        return base
    return block


def _packed_bits(bits: int, group: int, scale_bits: int = 16, zero_bits: int = 0,
                 row_index_bits: int = 0) -> Callable[[Tensor], float]:
    """Bits per weight of a packed integer format: `bits` per weight, one scale (and zero-point)
    per `group` weights along K (0: one per output row), plus `row_index_bits` per input row
    (GPTQ's g_idx: one int32 per input feature, shared by the n outputs)."""
    def per_weight(t: Tensor) -> float:
        g = t.k if group == 0 else group
        return bits + (scale_bits + zero_bits) / g + row_index_bits / t.n
    return per_weight


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its weights, tensor by tensor.

    `layer_bits(t)` gives bits per weight of a decoder-layer linear; `head` and `embedding`
    say how the vocab projection and the input embedding are stored: "16" (fp16/bf16),
    "same" (like the layers), or a GGUF block type.  Norms and biases stay 16-bit everywhere.
    """

    name: str
    description: str
    kernel: str  # kernel family whose efficiency applies (sim.efficiency.KERNEL_FAMILIES)
    compute: str = "16"  # "16": GEMMs at the fp16/bf16 tensor rate; "float8" / "int8": that rate
    layer_bits: Callable[[Tensor], float] | None = None
    gguf_block: Callable[[Tensor, int], str] | None = None  # GGUF: block type per tensor
    head: str = "16"
    embedding: str = "16"
    engine_scheme: str | None = None  # the engine's --quantization scheme this format is

    def tensor_bits(self, t: Tensor, num_layers: int, dense_bits: float = 16.0) -> float:
        """Bits per weight of one tensor (layers, head or embedding); "16" parts are stored in
        the checkpoint's dtype (`dense_bits`)."""
        if t.role in ("output", "token_embd"):
            how = self.head if t.role == "output" else self.embedding
            if how == "16":
                return dense_bits
            if how != "same":
                return gguf_bits(how)
        if self.gguf_block is not None:
            return gguf_bits(self.gguf_block(t, num_layers))
        assert self.layer_bits is not None
        return self.layer_bits(t)

    def tensor_bytes(self, t: Tensor, num_layers: int, dense_bits: float = 16.0) -> float:
        return t.params * self.tensor_bits(t, num_layers, dense_bits) / 8.0


def _gguf(name: str, block: str, description: str, head: str | None = None) -> WeightFormat:
    # llama.cpp keeps a Q8_0 model's output in Q8_0 and puts every other mixture's output in Q6_K;
    # the token embedding takes the file's base type.
    return WeightFormat(name, description, "gguf-" + block.lower(), gguf_block=lambda t, n: block,
                        head=head or ("Q8_0" if block == "Q8_0" else "Q6_K"), embedding=block)



WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("int8", "the engine's int8: one int8 a weight, a float32 scale per output row",
                 "int8-wo", layer_bits=_packed_bits(8, 0, scale_bits=32), head="same", engine_scheme="int8"),
    WeightFormat("int4", "the engine's int4: 4 bits, a bfloat16 scale per 32 weights (4.5 bits)",
                 "int4-wo", layer_bits=_packed_bits(4, 32), head="same", engine_scheme="int4"),
    WeightFormat("int4-g128", "the engine's int4 with groups of 128 (4.125 bits)",
                 "int4-wo", layer_bits=_packed_bits(4, 128), head="same", engine_scheme="int4-g128"),
    WeightFormat("tinygemm-int4", "PyTorch's int4 (gpt-fast, torchao): 4 bits, a bf16 scale and zero per 32 (5 bits)",
                 "int4-wo", layer_bits=_packed_bits(4, 32, zero_bits=16), head="same"),
    _gguf("gguf-q8_0", "Q8_0", "GGUF Q8_0: 32 int8 + fp16 scale per block (8.5 bits)"),
    _gguf("gguf-q4_0", "Q4_0", "GGUF Q4_0: 32 nibbles + fp16 scale (4.5 bits), output Q6_K"),
    _gguf("gguf-q4_1", "Q4_1", "GGUF Q4_1: Q4_0 plus an fp16 minimum (5 bits), output Q6_K"),
    _gguf("gguf-q5_0", "Q5_0", "GGUF Q5_0 (5.5 bits), output Q6_K"),
    _gguf("gguf-q5_1", "Q5_1", "GGUF Q5_1 (6 bits), output Q6_K"),
    _gguf("gguf-q2_k", "Q2_K", "GGUF Q2_K (2.625 bits), output Q6_K"),
    _gguf("gguf-q3_k", "Q3_K", "GGUF Q3_K (3.4375 bits), output Q6_K"),
    _gguf("gguf-q4_k", "Q4_K", "GGUF Q4_K (4.5 bits), output Q6_K"),
    _gguf("gguf-q5_k", "Q5_K", "GGUF Q5_K (5.5 bits), output Q6_K"),
    _gguf("gguf-q6_k", "Q6_K", "GGUF Q6_K (6.5625 bits)"),
    WeightFormat("gguf-q4_k_m", "GGUF Q4_K_M: Q4_K, attn_v and ffn_down Q6_K in 1/8+1/8+1/3 of the layers, output Q6_K",
                 "gguf-q4_k", gguf_block=_k_mixture("Q4_K", "Q6_K"), head="Q6_K", embedding="Q4_K"),
    WeightFormat("gguf-q5_k_m", "GGUF Q5_K_M: Q5_K, attn_v and ffn_down Q6_K in use_more_bits layers, output Q6_K",
                 "gguf-q5_k", gguf_block=_k_mixture("Q5_K", "Q6_K"), head="Q6_K", embedding="Q5_K"),
    WeightFormat("gptq-int4",
                 "GPTQ 4-bit, group 128: packed int4, fp16 scales, packed 4-bit zeros, int32 g_idx; head fp16",
                 "marlin", layer_bits=_packed_bits(4, 128, zero_bits=4, row_index_bits=32)),
    WeightFormat("gptq-int8", "GPTQ 8-bit, group 128: int8, fp16 scales, packed 8-bit zeros, int32 g_idx; head fp16",
                 "int8-wo", layer_bits=_packed_bits(8, 128, zero_bits=8, row_index_bits=32)),
    WeightFormat("awq", "AWQ 4-bit, group 128: packed int4, fp16 scales, packed 4-bit zeros; head fp16",
                 "marlin", layer_bits=_packed_bits(4, 128, zero_bits=4)),
    WeightFormat("ct-w4a16", "compressed-tensors pack-quantized w4a16, group 128, symmetric (bf16 scales); head 16-bit",
                 "marlin", layer_bits=_packed_bits(4, 128)),
    WeightFormat("ct-w8a16", "compressed-tensors w8a16, channel-wise int8 (one scale per row); head 16-bit",
                 "int8-wo", layer_bits=_packed_bits(8, 0)),
    WeightFormat("ct-w8a8-int8", "compressed-tensors w8a8 int8: int8 weights and activations, int8 tensor-core GEMMs",
                 "dense", compute="int8", layer_bits=_packed_bits(8, 0, scale_bits=32)),
    WeightFormat("fp8", "FP8 (e4m3) W8A8 weights, per-channel scales, FP8 tensor-core GEMMs; head 16-bit",
                 "dense", compute="float8", layer_bits=_packed_bits(8, 0, scale_bits=32)),
    WeightFormat("mlc-q4f16_1", "MLC q4f16_1: 4 bits + fp16 scale per 32 (4.5 bits), head and embedding too",
                 "mlc", layer_bits=_packed_bits(4, 32), head="same", embedding="same"),
)}

# Spellings people use for the same formats.
_ALIASES = {
    "q8_0": "gguf-q8_0", "q4_0": "gguf-q4_0", "q4_k_m": "gguf-q4_k_m", "q5_k_m": "gguf-q5_k_m",
    "q6_k": "gguf-q6_k", "gptq": "gptq-int4", "awq-int4": "awq", "w4a16": "ct-w4a16", "w8a16": "ct-w8a16",
    "w8a8": "ct-w8a8-int8", "fp8-w8a8": "fp8", "compressed-tensors-w4a16": "ct-w4a16",
    "q4f16_1": "mlc-q4f16_1", "int4-g32-tinygemm": "tinygemm-int4",
}

DENSE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}


def weight_format_names() -> list[str]:
    return sorted(WEIGHT_FORMATS)


def get_weight_format(name: str) -> WeightFormat:
    """A format by name (case-insensitive, common aliases accepted); ValueError lists the known ones."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return WEIGHT_FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(weight_format_names())}") from None


# ---------------------------------------------------------------- KV cache
@dataclass(frozen=True)
class KVFormat:
    """Bytes per cached element: `bits` per value plus `scale_bytes` per head and token (K and V each)."""

    name: str
    bits: float
    scale_bytes_per_head: float = 0.0
    description: str = ""

    def bytes_per_head_token(self, head_dim: int) -> float:
        return head_dim * self.bits / 8.0 + self.scale_bytes_per_head


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float16", 16, description="fp16 cache"),
    KVFormat("bfloat16", 16, description="bf16 cache"),
    KVFormat("float32", 32, description="fp32 cache"),
    # FP8 caches (vLLM/TensorRT-LLM fp8_e4m3 / e5m2) keep one scale per layer: nothing per token.
    KVFormat("fp8", 8, description="fp8 (e4m3/e5m2) cache, per-tensor scales"),
    # Integer caches quantize per head and token (LMDeploy's online int8/int4): an fp16 scale and
    # zero-point for each head's vector.
    KVFormat("int8", 8, 4.0, "int8 cache, fp16 scale + zero per head and token"),
    KVFormat("int4", 4, 4.0, "int4 cache, fp16 scale + zero per head and token"),
)}


def get_kv_format(name: str) -> KVFormat:
    key = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}.get(
        name.strip().lower(), name.strip().lower())
    try:
        return KV_FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; known: {', '.join(sorted(KV_FORMATS))}") from None


def weight_format_from_config(config: dict) -> str | None:
    """The weight format a checkpoint's config.json declares (its `quantization_config`), or None.

    GPTQ and AWQ name their method and bits; compressed-tensors describes its weights' scheme
    in config_groups (num_bits, type int/float, and whether activations are quantized too).
    Group sizes other than 128 are counted as 128 (a difference below 0.1 bit a weight)."""
    q = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    bits = int(q.get("bits", 4) or 4)
    if method == "gptq":
        return "gptq-int8" if bits == 8 else "gptq-int4"
    if method == "awq":
        return "awq"
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            a = group.get("input_activations")
            if str(w.get("type", "int")) == "float":
                return "fp8"
            nbits = int(w.get("num_bits", 8))
            if a:
                return "ct-w8a8-int8"
            return "ct-w4a16" if nbits == 4 else "ct-w8a16"
    raise ValueError(f"quantization_config method {method!r} is not a weight format the estimator counts; "
                     f"pass --weight-format (one of {', '.join(weight_format_names())})")
