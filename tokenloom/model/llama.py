"""The decoder-only transformer, configured by config.json: Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 (text) and Phi-3, and the mixtures of experts Mixtral, Qwen3-MoE and
Qwen2-MoE, whose sparse layers' MLP is a router over experts (model/moe.py).

One layer loop covers them all; the families differ only in switches and in the pieces
`DecoderLayer.bind` chooses once: biases (Qwen2), RMSNorm on each head's q and k (Qwen3,
Gemma 3), the MLP's activation (SwiGLU; Gemma's GeGLU), Gemma's "sandwich" norms (after
attention and around the MLP too), a layer's MLP (dense, or a mixture of experts), each
layer's attention kind (a sliding window on some
layers, soft-capped scores: model/attention.py) and rotation (Gemma 3's sliding layers
rotate with their own base).  Loading maps each family's checkpoint onto the same weights
(model/weights/loader.py: Phi-3 stores q/k/v and gate/up already fused; Gemma stores its
norm weights as offsets from 1).  The forward pass takes *all* tokens of *all* requests
scheduled in a step, flattened into one sequence -- prefill chunks and decode tokens
together -- and returns hidden states; logits are computed only for the rows that will be
sampled (`compute_logits`).  The model knows nothing about requests: the paged-attention
metadata tells each token where its history is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenloom.model.attention import AttentionBackend, AttentionMetadata, LayerAttention, attention_kinds
from tokenloom.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, WrapLinear, bound_linear
from tokenloom.model.moe import SparseMoE
from tokenloom.model.ops import Ops, rotate

RopeKV = Callable  # (qkv, StepInputs, k_cache, v_cache) -> q: `Attention.bind_rope_kv`


def _no_tables(positions: torch.Tensor, dtype: torch.dtype) -> None:
    return None


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields the forward pass needs, resolved per family (model/hf_config.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the window of the layers `layer_types` marks sliding
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer (empty: all full)
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh | gelu
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (Gemma), else head_dim's
    attn_softcap: float | None = None  # attention scores capped by cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits capped the same way (Gemma)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # RMSNorm weights stored as offsets from 1 (Gemma: x * (1 + w))
    sandwich_norm: bool = False  # norms after attention and around the MLP too (Gemma)
    local_rope_theta: float | None = None  # sliding layers rotate with this base instead (Gemma 3)
    local_rope_scaling: dict | None = None
    # Mixture of experts (model/moe.py; `hf_config.moe_fields` says what each means): the
    # layers in `moe_layers` route each token to `num_experts_per_tok` of `num_experts`
    # SwiGLU experts; a dense family leaves them at zero.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_weights_fp32: bool = False
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict, architecture: str) -> "ModelArgs":
        """config.json read with transformers' meaning, both its 4.x and 5.x formats
        (model/hf_config.py); ValueError for settings the model cannot honour."""
        from tokenloom.model.hf_config import model_args_fields

        return cls(**model_args_fields(cfg, architecture))

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention kind: its window and its scores' soft-cap."""
        return tuple(LayerAttention(self.sliding_window if self.sliding(i) else None, self.attn_softcap)
                     for i in range(self.num_layers))


class Attention(nn.Module):
    """The attention block's weights and shape; it runs as part of its layer's `LayerStep`."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        # q, k and v projections fused into one matmul at load time (one weight read per step).
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = (a.query_pre_attn_scalar or a.head_dim) ** -0.5

    def bind_rope_kv(self, ops: Ops, rope: RotaryEmbedding, rope_index: int, backend: AttentionBackend) -> RopeKV:
        """This block's step from the qkv projection to the query: rotate q and k (with
        `rope`, whose step tables are `StepInputs.cs[rope_index]`), normalise them first
        where the family does (Qwen3, Gemma 3), and write k and v into the paged cache --
        in one op where the ops backend has it.  Chosen here, once, not on every call."""
        hq, hk, d, q_size, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.kv_size
        cos, sin, write_kv = rope.cos, rope.sin, backend.write_kv
        if ops.rope_write_kv is not None and self.q_norm is None:
            # rotation and the KV cache write in one op (kernels/cpu_fused.cpp, kernels/triton/fused.py)
            rope_write_kv = ops.rope_write_kv

            def fused(qkv, s, k_cache, v_cache):
                return rope_write_kv(qkv, s.positions, cos, sin, k_cache, v_cache, s.slots, hq, hk)

            return fused
        if self.q_norm is None:
            def together(qkv, s, k_cache, v_cache):
                # q and k sit side by side in the qkv output and share positions: one rotation
                # for both (half the ops; on a GPU, half the launches).
                t = qkv.shape[0]
                qk = rotate(qkv[:, : q_size + kv_size].view(t, hq + hk, d), *s.cs[rope_index])
                write_kv(qk[:, hq:], qkv[:, q_size + kv_size:].view(t, hk, d), k_cache, v_cache, s.slots)
                return qk[:, :hq]

            return together
        rms_norm, rope_op, eps = ops.rms_norm, ops.rope, self.q_norm.eps
        qw, kw = self.q_norm.weight, self.k_norm.weight

        def normed(qkv, s, k_cache, v_cache):
            t = qkv.shape[0]
            q = rms_norm(qkv[:, :q_size].view(t, hq, d), qw, eps)
            k = rms_norm(qkv[:, q_size: q_size + kv_size].view(t, hk, d), kw, eps)
            q, k = rope_op(q, k, s.positions, cos, sin, s.cs[rope_index])
            write_kv(k, qkv[:, q_size + kv_size:].view(t, hk, d), k_cache, v_cache, s.slots)
            return q

        return normed


class DecoderLayer(nn.Module):
    """One layer's weights (what loading, sharding, packing and quantizing act on); it runs
    as the `LayerStep` that `bind` makes of it.  `kind` and `rope_index` (set by `CausalLM`):
    which of the backend's attention kinds and which of the model's rotations it uses."""

    def __init__(self, a: ModelArgs, index: int = 0):
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(a)
        # Llama & co: the MLP's input norm.  Gemma ("sandwich"): the attention output's norm,
        # the MLP then between pre_ and post_feedforward_layernorm.
        self.post_attention_layernorm = RMSNorm(h, eps)
        if a.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(h, eps)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp: GatedMLP | SparseMoE
        if index in a.moe_layers:
            self.mlp = SparseMoE(h, a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size,
                                 a.shared_expert_intermediate_size, a.norm_topk_prob, a.moe_weights_fp32)
        else:
            self.mlp = GatedMLP(h, a.intermediate_size, a.mlp_bias, a.hidden_act)
        self.kind, self.rope_index = 0, 0

    def bind(self, ops: Ops, ropes: tuple[RotaryEmbedding, ...], backend: AttentionBackend,
             flat: bool, wrap: WrapLinear | None = None) -> "LayerStep":
        attn = self.self_attn
        call = functools.partial(bound_linear, flat=flat)
        qkv, o = call(attn.qkv_proj), call(attn.o_proj)
        if wrap is not None:  # e.g. LoRA adapters' deltas beside the linears (model/lora.py)
            qkv, o = wrap("qkv", qkv), wrap("o", o)
        sandwich = hasattr(self, "pre_feedforward_layernorm")
        attn_out_norm = self.post_attention_layernorm.weight if sandwich else None
        ffn_norm = (self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm).weight
        ffn_out_norm = self.post_feedforward_layernorm.weight if sandwich else None
        rope_kv = attn.bind_rope_kv(ops, ropes[self.rope_index], self.rope_index, backend)
        return LayerStep(self.input_layernorm.weight, attn_out_norm, ffn_norm, ffn_out_norm, self.input_layernorm.eps,
                         qkv, o, self.mlp.bind(ops, flat, wrap) if isinstance(self.mlp, GatedMLP)
                         else self.mlp.bind(ops, flat), rope_kv, self.kind,
                         attn.q_size, attn.scale, ops)


class StepInputs:
    """What every layer reads of one step: positions, KV slots, the rotation tables of each
    of the model's rotations (where a layer rotates with them, not the fused op) and the
    step's attention for each attention kind (`AttentionBackend.attend`)."""

    __slots__ = ("positions", "slots", "cs", "attend")

    def __init__(self, positions, slots, cs, attend):
        self.positions, self.slots, self.cs, self.attend = positions, slots, cs, attend


class LayerStep:
    """One decoder layer, bound for running: its norm weights, its linears and MLP as
    callables, its attention kind and the model's ops.  The layer is written here once for
    every family; how each piece is called (our CPU ops or PyTorch's, linears as plain
    functions or through their modules, the fused rotary + KV write or not, SwiGLU or
    GeGLU) was bound by `DecoderLayer.bind` from the backend plan (model/backends.py), so
    the same code runs a batch-1 CPU decode step, a chunked prefill, a tensor-parallel
    shard and a CUDA graph.  `attn_out_norm` / `ffn_out_norm` (Gemma's extra norms) are
    None where the family has none.

    x: the previous layer's output, not yet added to `residual`, the stream of sums before
    it (None at the first layer); each add happens inside the norm that follows it."""

    __slots__ = ("input_norm", "attn_out_norm", "ffn_norm", "ffn_out_norm", "eps", "qkv", "o", "mlp", "rope_kv",
                 "kind", "q_size", "scale", "rms_norm", "add_rms_norm")

    def __init__(self, input_norm, attn_out_norm, ffn_norm, ffn_out_norm, eps, qkv, o, mlp, rope_kv, kind,
                 q_size, scale, ops: Ops):
        self.input_norm, self.attn_out_norm = input_norm, attn_out_norm
        self.ffn_norm, self.ffn_out_norm = ffn_norm, ffn_out_norm
        self.eps, self.qkv, self.o, self.mlp, self.rope_kv, self.kind = eps, qkv, o, mlp, rope_kv, kind
        self.q_size, self.scale = q_size, scale
        self.rms_norm, self.add_rms_norm = ops.rms_norm, ops.add_rms_norm

    def __call__(self, x, residual, s: StepInputs, k_cache, v_cache):
        """Returns this layer's (output, residual)."""
        if residual is None:
            h, residual = self.rms_norm(x, self.input_norm, self.eps), x
        else:
            h, residual = self.add_rms_norm(x, residual, self.input_norm, self.eps)
        q = self.rope_kv(self.qkv(h), s, k_cache, v_cache)
        x = self.o(s.attend[self.kind](q, k_cache, v_cache, self.scale).reshape(x.shape[0], self.q_size))
        if self.attn_out_norm is not None:
            x = self.rms_norm(x, self.attn_out_norm, self.eps)
        h, residual = self.add_rms_norm(x, residual, self.ffn_norm, self.eps)
        x = self.mlp(h)
        if self.ffn_out_norm is not None:
            x = self.rms_norm(x, self.ffn_out_norm, self.eps)
        return x, residual


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs, max_positions: int):
        super().__init__()
        self.args = a
        # _weight skips nn.Embedding's random init (pointless before loading, and on the meta
        # device it drags in torch._dynamo, seconds of start-up).
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the rest is built on the meta device
            self.rope = RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling)
            self.local_rope = (RotaryEmbedding(a.head_dim, max_positions, a.local_rope_theta, a.local_rope_scaling)
                               if a.local_rope_theta is not None else None)
        if self.local_rope is not None and self.rope.long_from is not None:
            raise ValueError("longrope with a second rotation for sliding layers is not supported")
        # the backend serves these attention kinds (model/attention.py); each layer names its own.
        # A window no shorter than the longest sequence is full attention (Phi-3-128k's 262144):
        # left out, so those layers keep the kernels that have no window.
        per_layer = [LayerAttention(k.window if k.window is not None and k.window < max_positions else None,
                                    k.softcap) for k in a.layer_attention]
        self.attention_kinds, kinds = attention_kinds(per_layer)
        for i, layer in enumerate(self.layers):
            layer.kind = kinds[i]
            layer.rope_index = 1 if self.local_rope is not None and a.sliding(i) else 0
        self.steps: list[LayerStep] = []  # `bind` makes them, after loading and packing

    @property
    def ropes(self) -> tuple[RotaryEmbedding, ...]:
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def bind(self, ops: Ops, backend: AttentionBackend, flat: bool = True,
             wrap: Callable[[int, str, Linear], Linear] | None = None) -> None:
        """Bind every layer for running, as the backend plan chose (model/backends.py): its
        small ops through `ops` (model/ops.py), its KV writes and attention through `backend`
        (built for `self.attention_kinds`), its linears as plain functions where `flat` (no
        nn.Module dispatch per call: a batch-1 CPU decode step is weights streamed with little
        else, and the module machinery around a dozen calls a layer shows), else through their
        modules (torch.compile traces those), each then through `wrap(layer index, name, fn)`
        where given (LoRA: model/lora.py).  Called once the weights are in their final form
        (loaded, sharded, packed)."""
        if backend.kinds != self.attention_kinds:
            raise ValueError(f"the attention backend serves kinds {backend.kinds}, the model's layers "
                             f"{self.attention_kinds}")
        self.ops = ops
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        ropes = self.ropes
        self.steps = [layer.bind(ops, ropes, backend, flat, functools.partial(wrap, i) if wrap else None)
                      for i, layer in enumerate(self.layers)]
        embed = self.embed_tokens.forward if flat else self.embed_tokens
        if self.args.embed_scale is not None:
            # Gemma: times sqrt(hidden) rounded to the model's dtype, as the reference rounds it
            scale = torch.tensor(self.args.embed_scale).to(self.norm.weight)

            def scaled_embed(ids):
                return embed(ids) * scale

            self._embed = scaled_embed
        else:
            self._embed = embed
        # the rotation tables of a step, where some layer rotates with them (not the fused op)
        fused = ops.rope_write_kv is not None and not self.args.qk_norm

        def tables(positions, dtype):
            return tuple(r.at(positions, dtype) for r in ropes)

        self._tables = _no_tables if fused else tables

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The hidden states of every row, before the final norm (applied in `compute_logits`,
        only on the rows that need it)."""
        x, residual = self._embed(input_ids), None
        s = StepInputs(positions, meta.slot_mapping, self._tables(positions, x.dtype), meta.backend.attend(meta))
        for layer, (k_cache, v_cache) in zip(self.steps, kv_caches):
            x, residual = layer(x, residual, s, k_cache, v_cache)
        return x + residual

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of `forward`'s hidden states after the final norm: what an embedding pools
        (the base model's `last_hidden_state` in transformers)."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of the rows of `hidden`, float32.  `float32=False` leaves them in the head's
        own dtype (the values are the same: the float32 copy is exact) for a consumer that
        widens them as it reads (a greedy step's argmax); a soft cap is applied in float32
        either way."""
        h = self.norm(hidden)
        if self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = torch.nn.functional.linear(h, self.embed_tokens.weight)  # tied embeddings
        cap = self.args.final_softcap
        if cap is not None:  # Gemma: cap * tanh(logits / cap), in the reference's order
            return torch.tanh(logits.float() / cap) * cap
        return logits.float() if float32 else logits

    def prepack(self) -> int:
        """CPU fast path: oneDNN-packed weights for every matmul (see packed_linear.py).

        A tied lm_head never gets a second copy of the vocab matrix (a quarter of a small
        model's bytes): where our kernels build, the matrix is stored once in our GEMM's
        panels, which stream faster than oneDNN reading the unpacked matrix (figures:
        docs/performance.md, "Why each CPU kernel is chosen"); elsewhere the head reads the
        embedding in place."""
        from tokenloom.kernels import cpu as cpu_kernels
        from tokenloom.model.weights.packed_linear import PackedLinear, prepack_linears

        n = prepack_linears(self)
        if self.lm_head is None:
            if cpu_kernels.tied_head_in_panels():
                self._tie_through_panels()
            else:
                self.lm_head = PackedLinear(self.embed_tokens.weight, None, pack=False)
            n += 1
        return n

    def prepack_panels(self) -> int:
        """CPU fast path where our GEMM wins (kernels/cpu.py `preferred`): every matmul through it."""
        from tokenloom.model.weights.packed_linear import PanelLinear, prepack_linears

        n = prepack_linears(self, PanelLinear)
        if self.lm_head is None:
            self._tie_through_panels()
            n += 1
        return n

    def _tie_through_panels(self) -> None:
        """Tied embeddings packed once, into the panels the lm_head streams; the embedding
        lookup reads its rows from there.  One copy of the vocab matrix."""
        from tokenloom.kernels import cpu as cpu_kernels
        from tokenloom.model.weights.packed_linear import PanelEmbedding, PanelLinear

        vocab, hidden = self.embed_tokens.weight.shape
        packed = cpu_kernels.pack_for(self.embed_tokens.weight)
        self.embed_tokens = PanelEmbedding(packed, vocab, hidden)
        self.lm_head = PanelLinear(None, None, packed=packed, shape=(vocab, hidden))
