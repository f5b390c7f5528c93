"""Decode-only CPU steps as one flat loop over the layers: the same ops, without nn.Module.

A batch-1 decode step on a CPU is a stream of weights with a few small ops between the
matmuls: per layer two norms, the fused rotary + KV write, paged attention and SwiGLU's
activation.  Through the module tree each of those also costs Python's module machinery
(`nn.Module.__call__`, attribute lookups through `nn.Module.__getattr__`), about a dozen
calls a layer, and it runs with cold caches: the weight stream of the matmul before it
has just evicted the interpreter's objects along with everything else.  `FlatDecode` holds,
per layer, the tensors and op callables the modules would reach, and runs a decode-only
step as one loop over them.  It calls the same ops on the same tensors in the same order as
`CausalLM.forward`, so the result is bit for bit the module path's (tests/test_flat_decode.py);
only the Python around the ops is gone.

It applies where the step's every op is one of ours that takes everything as arguments: the
CPU ops backend with the fused rotary + KV write (model/ops.py), our CPU decode attention
without a sliding window (model/attention.py), no per-head q/k norm, and linear layers that
can give their forward as a plain function (`as_function`: packed, panel and quantized
linears, and plain nn.Linear).  Anything else (GPUs, tensor parallel, torch.compile, steps
with prefill chunks) keeps the module path.  Speculative verifying steps are decode rows
and take the flat path too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.ops import Ops

Linear = Callable[[torch.Tensor], torch.Tensor]


def linear_function(m: nn.Module) -> Linear | None:
    """`m`'s forward as a plain function of x, or None for a kind of layer this cannot run
    (a tensor-parallel shard, whose forward also communicates)."""
    if hasattr(m, "as_function"):
        return m.as_function()
    if type(m) is nn.Linear:
        return functools.partial(F.linear, weight=m.weight, bias=m.bias)
    return None


@dataclass(frozen=True)
class FlatLayer:
    """What one decoder layer's decode step reads: its two norm weights and four linears."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class FlatDecode:
    """A model's decode-only steps as one loop over `FlatLayer`s (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: list[FlatLayer], ops: Ops):
        a = model.args
        self.embed = model.embed_tokens.forward
        self.rope = model.rope
        self.layers = layers
        self.eps = a.rms_norm_eps
        self.num_heads, self.num_kv_heads = a.num_heads, a.num_kv_heads
        self.q_size = a.num_heads * a.head_dim
        self.scale = a.head_dim ** -0.5
        self.rms_norm, self.add_rms_norm = ops.rms_norm, ops.add_rms_norm
        self.rope_write_kv, self.silu_and_mul = ops.rope_write_kv, ops.silu_and_mul

    @classmethod
    def build(cls, model: nn.Module, ops: Ops) -> "FlatDecode":
        """The flat loop for `model` under `ops`, where the backend plan (model/backends.py)
        said it applies: our CPU ops with the fused rotary + KV write, no q/k norm."""
        assert ops.name == "cpu" and ops.rope_write_kv is not None and not model.args.qk_norm
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fns = [linear_function(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(f is None for f in fns):
                raise ValueError("the flat decode loop needs linears with a plain-function forward")
            layers.append(FlatLayer(layer.input_layernorm.weight, fns[0], fns[1],
                                    layer.post_attention_layernorm.weight, fns[2], fns[3]))
        return cls(model, layers, ops)

    @staticmethod
    def applies(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is decode rows only (the plan chose our CPU attention, no window)."""
        return not meta.has_prefill and meta.num_decode == input_ids.shape[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """`CausalLM.forward` for a step `applies` accepts: the hidden states before the final norm."""
        x, residual = self.embed(input_ids), None
        t = x.shape[0]
        cos, sin = self.rope.cos, self.rope.sin
        eps, hq, hk, q_size, scale = self.eps, self.num_heads, self.num_kv_heads, self.q_size, self.scale
        rms_norm, add_rms_norm, rope_write_kv, silu_and_mul = (self.rms_norm, self.add_rms_norm, self.rope_write_kv,
                                                               self.silu_and_mul)
        attend = meta.backend.decode_op
        slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                h, residual = rms_norm(x, layer.input_norm, eps), x
            else:
                h, residual = add_rms_norm(x, residual, layer.input_norm, eps)
            q = rope_write_kv(layer.qkv(h), positions, cos, sin, k_cache, v_cache, slots, hq, hk)
            x = layer.o(attend(q, k_cache, v_cache, tables, lens, scale).reshape(t, q_size))
            h, residual = add_rms_norm(x, residual, layer.post_norm, eps)
            x = layer.down(silu_and_mul(layer.gate_up(h)))
        return x + residual
