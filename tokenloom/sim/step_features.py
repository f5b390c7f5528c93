"""Step features: one engine step's work, before any rate is applied.

The calibrated step-time formula (`sim.engine_cost`) reads a step as the GEMM bytes and
FLOPs of the decoder layers (over all T new tokens) and of the vocabulary projection
(over the S rows that sample a token), the padded attention's query x key pairs, the KV
it gathers and the new K/V it writes.  `StepFeatures` turns a step's scheduled entries
-- (new tokens, tokens already cached, samples a token) per request -- into those
quantities for one model, dtype and block size.

Attention is costed as the model runner does it: each request's KV blocks gathered
into a dense `[rows, L_max]` tensor (L_max = the longest block table in the group, in
whole blocks), one masked attention for the decodes and one for the prefill chunks
(queries padded to the longest chunk) -- unless decode attention reads the blocks in
place (`paged_decode`, our CPU kernel), when a decode's work is its actual context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenloom.config import DTYPE_BYTES
from tokenloom.specs.model_spec import ModelSpec, normalize_dtype

# One scheduled request in a step: (new tokens, tokens already in its KV cache, samples a token).
Entry = tuple[int, int, bool]


@dataclass(frozen=True)
class StepParts:
    """A step's work before any rate is applied (see the module docstring)."""

    num_seqs: int
    num_tokens: int
    num_sampled: int
    layer_bytes: float
    layer_flops: float
    head_bytes: float  # 0 when no row samples
    head_flops: float
    attn_flops: float  # padded query x key pairs x attention FLOPs per pair
    gather_bytes: float  # KV of the padded positions gathered for attention
    kv_write_bytes: float  # new K/V written into the cache


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class StepFeatures:
    """Turns step entries into `StepParts` for one model, dtype and block size."""

    def __init__(self, spec: ModelSpec, dtype: str, block_size: int = 16, paged_decode: bool = False) -> None:
        nb = DTYPE_BYTES[normalize_dtype(dtype)]
        self.block_size = block_size
        # True where decode attention reads each request's blocks in place (our CPU kernel):
        # its work is the actual context, not the group's padded, gathered length.
        self.paged_decode = paged_decode
        streamed = spec.streamed_weight_bytes(dtype)
        self.head_bytes = spec.logits_matmul_params * nb
        # Norms and biases travel with the layers; the vocab matrix is the head's.
        self.layer_bytes = streamed - self.head_bytes
        self.spec, self.dtype = spec, dtype  # mixture of experts: layer bytes depend on the step's tokens
        self.layer_flops_per_token = 2 * spec.layer_matmul_params
        self.head_flops_per_row = 2 * spec.logits_matmul_params
        self.attn_flops_per_pair = spec.attention_flops_per_position
        self.kv_bytes_per_token = spec.kv_bytes_per_token(dtype)

    def _layer_bytes(self, tokens: int) -> float:
        """The decoder layers' bytes a step of `tokens` tokens reads (`ModelSpec.experts_touched`)."""
        if not self.spec.is_moe:
            return self.layer_bytes
        return self.spec.streamed_weight_bytes(self.dtype, None, tokens) - self.head_bytes

    def parts(self, entries: Sequence[Entry]) -> StepParts:
        bs = self.block_size
        tokens = sampled = 0
        dec_rows = dec_len = dec_in_place = 0
        pre_rows = pre_q = pre_len = 0
        for n, c, s in entries:
            tokens += n
            sampled += bool(s)
            if n == 1 and c > 0:  # a decode (or a one-token chunk after a cached prefix: same work)
                if self.paged_decode:
                    dec_in_place += c + 1
                    continue
                dec_rows += 1
                dec_len = max(dec_len, round_up(c + 1, bs))
            else:
                pre_rows += 1
                pre_q = max(pre_q, n)
                pre_len = max(pre_len, round_up(c + n, bs))
        pairs = dec_in_place + dec_rows * dec_len + pre_rows * pre_q * pre_len
        gathered = dec_in_place + dec_rows * dec_len + pre_rows * pre_len
        return StepParts(
            num_seqs=len(entries),
            num_tokens=tokens,
            num_sampled=sampled,
            layer_bytes=float(self._layer_bytes(tokens)) if entries else 0.0,
            layer_flops=float(tokens * self.layer_flops_per_token),
            head_bytes=float(self.head_bytes) if sampled else 0.0,
            head_flops=float(sampled * self.head_flops_per_row),
            attn_flops=float(pairs * self.attn_flops_per_pair),
            gather_bytes=float(gathered * self.kv_bytes_per_token),
            kv_write_bytes=float(tokens * self.kv_bytes_per_token),
        )
