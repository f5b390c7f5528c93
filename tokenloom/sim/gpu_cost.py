"""One engine step on a datasheet GPU, timed kernel by kernel at the rates `sim.efficiency` gives.

`estimate.CostModel`'s plain roofline, max(all bytes / bandwidth, all FLOPs / peak), lets
every byte and FLOP of a step overlap with every other and charges nothing else.  Real steps
run their kernels one after another, and each kind reaches its own share of the peaks.  For a
step of T new tokens over N sequences, S of which sample a token, on one of `tp` GPUs::

    layers     max(W_layers / (bw * e_w[kernel]),  2 * T * P_layers / (peak_fmt * e_c(T)))
    head       max(W_head   / (bw * e_w[kernel]),  2 * S * P_head   / (peak_16  * e_c(S)))   (S > 0)
    attention  (KV read + KV written) / (bw * e_kv)  +  attention FLOPs / (peak_16 * e_attn)
    fixed      layers * (prefill_)layer_overhead  +  2 * layers * all-reduce(T)  (tp > 1)
    host       step_overhead + seq_overhead * N

    step = layers + head + attention + fixed + host

W are the bytes the weight format stores (`specs.weight_formats`: scales, zero-points, the
16-bit head) -- of a mixture of experts' routed experts, those the step's T tokens touch
(`ModelSpec.experts_touched`) --, P the matmul parameters (a token's active ones), each divided over the `tp` GPUs (the KV heads too,
never below one per GPU).  `peak_fmt` is the tensor rate of the format's compute dtype: FP8
and int8 W8A8 formats get their 2x rate, weight-only formats dequantize to 16 bits.  An
all-reduce of T tokens' hidden states moves 2 * (tp-1)/tp * T * hidden * 2 bytes at
`link_eff` of the link, after a fixed latency.  Pure Python: the simulator calls it per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenloom.sim.efficiency import Efficiency
from tokenloom.specs.hardware import Hardware
from tokenloom.specs.model_spec import ModelSpec
from tokenloom.specs.weight_formats import KVFormat, Tensor, WeightFormat, linear_tensors

ACT_BYTES = 2  # activations (and all-reduced hidden states) in 16 bits

Entry = tuple[int, int, bool]  # (new tokens, tokens already cached, samples a token)


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a checkpoint by part, for the whole model (not per GPU)."""

    layers: float  # decoder-layer linears every step reads (a sparse layer's routed experts apart), in the format
    head: float  # the vocab projection (the embedding when tied)
    embedding: float  # an untied input embedding (gathered, never streamed); 0 when tied
    other: float  # norms, biases and mixture-of-experts routers, 16-bit
    experts: float = 0.0  # every routed expert of a mixture of experts, in the format
    experts_one_token: float = 0.0  # the k of E a one-token step reads

    @property
    def total(self) -> float:
        return self.layers + self.experts + self.head + self.embedding + self.other

    @property
    def streamed(self) -> float:
        """What a one-token step reads."""
        return self.layers + self.experts_one_token + self.head + self.other


def weight_bytes(spec: ModelSpec, fmt: WeightFormat | None, dtype_bytes: int) -> WeightBytes:
    """What `spec` stores in `fmt` (None: every weight in the dtype)."""
    static = spec.static_layer_matmul_params  # every step reads them (a routed expert's aside)
    other = (spec.total_params - static - spec.routed_expert_params - spec.embedding_params
             - spec.lm_head_params) * dtype_bytes
    share = spec.num_experts_per_tok / spec.num_experts if spec.is_moe else 0.0
    if fmt is None:
        emb = 0.0 if spec.tie_word_embeddings else spec.embedding_params * dtype_bytes
        experts = spec.routed_expert_params * dtype_bytes
        return WeightBytes(static * dtype_bytes, spec.logits_matmul_params * dtype_bytes, emb, other, experts,
                           experts * share)
    n = spec.num_layers
    layers = experts = 0.0
    dense_layers = n - spec.num_moe_layers  # where a model mixes them, counted as if the dense ones came first
    for t in linear_tensors(spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size, n):
        if t.role.startswith("attn") or t.layer < dense_layers:
            layers += fmt.tensor_bytes(t, n)
    for i in range(dense_layers, n):  # a sparse layer: its shared expert, its routed experts
        if spec.shared_expert_intermediate_size:
            shared = _ffn(spec.hidden_size, spec.shared_expert_intermediate_size, i)
            layers += sum(fmt.tensor_bytes(t, n) for t in shared)
        experts += spec.num_experts * sum(fmt.tensor_bytes(t, n) for t in _ffn(spec.hidden_size,
                                                                                spec.moe_intermediate_size, i))
    vocab = (spec.vocab_size, spec.hidden_size)
    head_t = Tensor("output", -1, *vocab)  # a tied embedding is stored as the head is (llama.cpp does the same)
    head = fmt.tensor_bytes(head_t, n, 8 * dtype_bytes)
    emb = 0.0 if spec.tie_word_embeddings else fmt.tensor_bytes(Tensor("token_embd", -1, *vocab), n, 8 * dtype_bytes)
    return WeightBytes(layers, head, emb, other, experts, experts * share)


def _ffn(hidden: int, intermediate: int, layer: int) -> list[Tensor]:
    """One SwiGLU's weights (an expert's, under the roles a dense layer's have)."""
    return [Tensor("ffn_gate", layer, intermediate, hidden), Tensor("ffn_up", layer, intermediate, hidden),
            Tensor("ffn_down", layer, hidden, intermediate)]


@dataclass(frozen=True)
class StepParts:
    """Seconds of each part of one step (see the module docstring)."""

    weights: float  # weight streaming of the layers and the head (the memory side of their GEMMs)
    gemm: float  # FLOPs side of the same GEMMs
    linear: float  # what the GEMMs take: per GEMM the larger of the two
    attention: float
    fixed: float  # per-layer overheads and all-reduces
    host: float
    bytes: float
    flops: float

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.fixed + self.host


class GpuStepModel:
    """The per-GPU constants of one (model, format, GPU, tp) and the step formula over them."""

    def __init__(self, spec: ModelSpec, hw: Hardware, dtype: str, fmt: WeightFormat | None, kv: KVFormat,
                 tp: int, eff: Efficiency) -> None:
        from tokenloom.config import DTYPE_BYTES

        if tp < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if spec.num_heads % tp:
            raise ValueError(f"{spec.name}: {spec.num_heads} attention heads do not split over {tp} GPUs")
        self.spec, self.hw, self.dtype, self.fmt, self.kv, self.tp, self.eff = spec, hw, dtype, fmt, kv, tp, eff
        self.parts = weight_bytes(spec, fmt, DTYPE_BYTES[dtype])
        self.w_layers = (self.parts.layers + self.parts.other + self.parts.experts_one_token) / tp  # one token's
        self.w_head = self.parts.head / tp
        kernel = fmt.kernel if fmt is not None else "dense"
        head_kernel = kernel if fmt is not None and fmt.head != "16" else "dense"
        self.bw_layers = hw.mem_bandwidth * eff.weight(kernel)
        self.bw_head = hw.mem_bandwidth * eff.weight(head_kernel)
        self.bw_kv = hw.mem_bandwidth * eff.kv_eff
        compute = fmt.compute if fmt is not None and fmt.compute in hw.peak_flops else "16"
        self.compute_kind = compute
        self.peak_16 = hw.flops_for(dtype)
        self.peak_fmt = self.peak_16 if compute == "16" else hw.peak_flops[compute]
        self.p_layers = 2.0 * spec.layer_matmul_params / tp  # FLOPs per token through the layers
        self.p_head = 2.0 * spec.logits_matmul_params / tp
        kv_heads = -(-spec.num_kv_heads // tp)  # a GPU holds at least one KV head (replicated when kv < tp)
        self.kv_per_token = 2 * spec.num_layers * kv_heads * kv.bytes_per_head_token(spec.head_dim)
        self.attn_per_pos = 4.0 * spec.num_layers * (spec.num_heads // tp) * spec.head_dim
        self.layer_fixed = spec.num_layers * eff.layer_overhead_s
        self.prefill_layer_fixed = spec.num_layers * eff.prefill_layer_overhead_s
        self.ar_latency = eff.allreduce_latency(hw.interconnect)
        self.ar_bytes_per_token = 2.0 * (tp - 1) / tp * spec.hidden_size * ACT_BYTES
        self.link_rate = hw.link_bandwidth * eff.link_eff

    def w_layers_at(self, tokens: int) -> float:
        """The layers' bytes (per GPU) a step of `tokens` new tokens streams: a mixture of experts
        reads the experts those tokens touch."""
        if not self.spec.is_moe or tokens <= 1:
            return self.w_layers
        touched = self.spec.experts_touched(tokens) / self.spec.num_experts
        return (self.parts.layers + self.parts.other + self.parts.experts * touched) / self.tp

    def streamed_at(self, tokens: int) -> float:
        """All weight bytes (per GPU) a step of `tokens` new tokens streams, the head's included."""
        return self.w_layers_at(tokens) + self.w_head

    def parts_for(self, entries: Sequence[Entry]) -> StepParts:
        if not entries:
            return StepParts(0, 0, 0, 0, 0, 0, 0, 0)
        eff = self.eff
        t = s = kv_read = attn_pos = 0
        prefills = False
        for n, c, sample in entries:
            prefills = prefills or n > 1
            t += n
            s += 1 if sample else 0
            kv_read += c
            attn_pos += n * c + n * (n + 1) // 2  # causal: the j-th new token sees c + j positions
        w_layers = self.w_layers_at(t)
        w_t = w_layers / self.bw_layers
        g_t = t * self.p_layers / (self.peak_fmt * eff.compute(self.compute_kind, t))
        weights, gemm, linear = w_t, g_t, eff.combine(w_t, g_t)
        flops = t * self.p_layers
        nbytes = w_layers
        if s:
            wh = self.w_head / self.bw_head
            gh = s * self.p_head / (self.peak_16 * eff.compute("16", s))
            weights, gemm, linear = weights + wh, gemm + gh, linear + eff.combine(wh, gh)
            flops += s * self.p_head
            nbytes += self.w_head
        kv_bytes = (kv_read + t) * self.kv_per_token
        attn_flops = attn_pos * self.attn_per_pos
        attention = kv_bytes / self.bw_kv + attn_flops / (self.peak_16 * eff.attn_eff)
        fixed = self.prefill_layer_fixed if prefills else self.layer_fixed
        if self.tp > 1:
            fixed += 2 * self.spec.num_layers * (self.ar_latency + t * self.ar_bytes_per_token / self.link_rate)
        host = eff.step_overhead_s + eff.seq_overhead_s * len(entries)
        return StepParts(weights, gemm, linear, attention, fixed, host, nbytes + kv_bytes, flops + attn_flops)
