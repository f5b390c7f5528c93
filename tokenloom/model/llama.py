"""The decoder-only transformer of the Llama family, configured by config.json.

One class covers Llama, Mistral, Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each
head's q and k): they differ only in switches.  The forward pass takes *all* tokens
of *all* requests scheduled in a step, flattened into one sequence — prefill chunks
and decode tokens together — and returns hidden states; logits are computed only for
the rows that will be sampled (`compute_logits`).  The model knows nothing about
requests: the paged-attention metadata tells each token where its history is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenloom.model.attention import AttentionMetadata, paged_attention
from tokenloom.model.flat_decode import FlatDecode
from tokenloom.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from tokenloom.model.ops import TORCH, Ops, rotate


@dataclass(frozen=True)
class ModelArgs:
    """The config.json fields the forward pass needs, resolved per family."""

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
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, cfg: dict, architecture: str) -> "ModelArgs":
        """config.json read with transformers' meaning, both its 4.x and 5.x formats
        (model/hf_config.py); ValueError for settings the model cannot honour."""
        from tokenloom.model.hf_config import model_args_fields

        return cls(**model_args_fields(cfg, architecture))


class Attention(nn.Module):
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
        self.scale = a.head_dim ** -0.5
        self.ops: Ops = TORCH  # the model's ops backend (CausalLM.set_ops)

    def forward(self, x, positions, rope, cs, k_cache, v_cache, meta: AttentionMetadata):
        """`cs`: this step's rotation tables (`RotaryEmbedding.at`), shared by every layer."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.ops.rope_write_kv is not None and self.q_norm is None:
            # rotation and the KV cache write in one op (kernels/cpu_fused.cpp, kernels/triton/fused.py)
            q = self.ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                                       self.num_heads, self.num_kv_heads)
            o = paged_attention(q, None, None, k_cache, v_cache, meta, self.scale)
            return self.o_proj(o.reshape(t, self.q_size))
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in the qkv output and share positions: one rotation
            # for both (half the ops; on a GPU, half the launches).
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = rotate(qk, *cs)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = rope(positions, q, k, cs)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)

    def forward(self, x, residual, positions, rope, cs, k_cache, v_cache, meta):
        """x: the previous layer's output, not yet added to `residual`, the stream of sums
        before it (None at the first layer); each add happens inside the norm that follows
        it (RMSNorm's `residual`).  Returns this layer's (output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, cs, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs, max_positions: int):
        super().__init__()
        self.args = a
        # _weight skips nn.Embedding's random init (pointless before loading, and on the meta
        # device it drags in torch._dynamo, seconds of start-up).
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the rest is built on the meta device
            self.rope = RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling)
        self.flat: FlatDecode | None = None  # set_ops builds it where it applies

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.flat is not None and self.flat.applies(input_ids, meta):
            return self.flat.forward(input_ids, positions, kv_caches, meta)
        x, residual = self.embed_tokens(input_ids), None
        cs = self.rope.at(positions, x.dtype)
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rope, cs, kc, vc, meta)
        return x + residual  # final norm is applied in compute_logits, only on the rows that need it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return torch.nn.functional.linear(h, self.embed_tokens.weight).float()  # tied embeddings

    def prepack(self) -> int:
        """CPU fast path: oneDNN-packed weights for every matmul (see packed_linear.py).

        A tied lm_head never gets a second copy of the vocab matrix (a quarter of a small
        model's bytes): where our kernels build, the matrix is stored once in our GEMM's
        panels, which stream faster than oneDNN reading the unpacked matrix (figures:
        docs/performance.md, "Why each CPU kernel is chosen"); elsewhere the head reads the
        embedding in place."""
        from tokenloom.kernels import cpu as cpu_kernels
        from tokenloom.model.packed_linear import PackedLinear, prepack_linears

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
        from tokenloom.model.packed_linear import PanelLinear, prepack_linears

        n = prepack_linears(self, PanelLinear)
        if self.lm_head is None:
            self._tie_through_panels()
            n += 1
        return n

    def set_ops(self, ops: Ops, flat: bool = False) -> None:
        """Every norm, rotary embedding, SwiGLU activation and attention layer through one ops
        backend (model/ops.py), as the backend plan chose it (model/backends.py); with `flat`,
        decode-only steps without the module machinery (model/flat_decode.py), built here,
        after loading and packing, from the modules as they now are."""
        self.ops = ops
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        self.flat = FlatDecode.build(self, ops) if flat else None

    def _tie_through_panels(self) -> None:
        """Tied embeddings packed once, into the panels the lm_head streams; the embedding
        lookup reads its rows from there.  One copy of the vocab matrix."""
        from tokenloom.kernels import cpu as cpu_kernels
        from tokenloom.model.packed_linear import PanelEmbedding, PanelLinear

        vocab, hidden = self.embed_tokens.weight.shape
        packed = cpu_kernels.pack_for(self.embed_tokens.weight)
        self.embed_tokens = PanelEmbedding(packed, vocab, hidden)
        self.lm_head = PanelLinear(None, None, packed=packed, shape=(vocab, hidden))
