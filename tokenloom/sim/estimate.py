"""Roofline estimate of a decode step: the seed's "how long is one step on a 4090?".

A decode step feeds every running request one token.  To do it the chip must

    read   every weight once                       W bytes   (shared by the whole batch)
    read   each request's KV history               B * L * kv bytes
    write  each request's new K/V                  B * kv bytes
    compute                                        B * F(L) FLOPs

where kv = KV bytes per token and F(L) = 2 * matmul params + 4 * layers * heads *
head_dim * (L + 1) (see `model_spec`).  Memory and compute overlap, so

    step time  = max(bytes / (bandwidth * mem_eff),  FLOPs / (peak * compute_eff)) + overhead
    tokens/s   = 1 / step time  per request,  B / step time  for the whole batch.

At batch 1 the bytes term wins by two orders of magnitude (each weight byte buys ~1
FLOP), so decode is memory-bound and batching is nearly free: W is read once however
many requests share the step.  That is why continuous batching "saves decode".  The
crossover batch B* where compute catches up solves

    (W + B*(L+1)*kv) / bw'  =  B*F(L) / peak'   =>   B* = (W/bw') / (F(L)/peak' - (L+1)*kv/bw')

and does not exist when the denominator is <= 0: then KV reads grow as fast as FLOPs
(attention is memory-bound at any batch) and the step never becomes compute-bound.

Contexts: L is the number of tokens already in a request's KV cache before the step;
the new token attends L + 1 positions (itself included) but its own K/V never has to be
re-read, so reads are L*kv and writes kv.

`CostModel` is the same arithmetic for an arbitrary mixed step (prefill chunks + decodes)
and drives the simulator's virtual clock, so it is pure Python and O(batch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

from tokenloom.specs.hardware import Hardware
from tokenloom.specs.model_spec import ModelSpec, normalize_dtype

# Default efficiencies for datasheet hardware (fractions of the printed peak a real step
# achieves).  Rules of thumb, not measurements -- override them with the CLI flags:
# * memory 0.8: a plain copy kernel gets close to ~90% of datasheet DRAM/HBM bandwidth;
#   decode's GEMVs and paged attention add launch gaps and tails, so ~80% is a fair
#   target for a well-tuned engine.
# * compute 0.6: big square GEMMs reach ~70-80% of the dense tensor-core peak, but a step
#   also runs skinny GEMMs, attention and elementwise ops, and consumer cards clock down
#   under sustained load; 60% is a conservative planning figure.
DATASHEET_MEM_EFFICIENCY = 0.8
DATASHEET_COMPUTE_EFFICIENCY = 0.6
# Measured hardware (`local`): the figures already *are* achieved rates on this machine,
# so the estimate uses them as they are; the remaining gap is what `bench roofline` shows.
MEASURED_EFFICIENCY = 1.0


def default_efficiency(hw: Hardware) -> tuple[float, float]:
    """(mem_efficiency, compute_efficiency) defaults for `hw`."""
    if hw.measured:
        return MEASURED_EFFICIENCY, MEASURED_EFFICIENCY
    return DATASHEET_MEM_EFFICIENCY, DATASHEET_COMPUTE_EFFICIENCY


def default_overhead_s(spec: ModelSpec, hw: Hardware) -> float:
    """Fixed per-step cost: measured per-op dispatch time x ops per forward (0 for datasheet parts)."""
    return hw.op_overhead_s * spec.eager_ops_per_step


class StepCost(NamedTuple):
    """Breakdown of one step's cost."""

    bytes: float  # weights streamed + KV read + KV written
    flops: float
    mem_time_s: float  # bytes / (bandwidth * mem_eff)
    compute_time_s: float  # flops / (peak * compute_eff)
    overhead_s: float
    time_s: float  # max(mem, compute) + overhead

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.mem_time_s else "memory"


_ZERO = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class CostModel:
    """Roofline time of one engine step; the simulator's clock.

    `step_time(prefill, decode_context_lens)`:
      * `prefill`: one `(new_tokens, context_len)` per request in a prefill (chunk), where
        `context_len` is the tokens already cached before the chunk (prefix hits or earlier
        chunks).  Each entry is charged one logits row (an upper bound for chunks that stop
        short of the prompt's end; the lm_head row is < 1% of a chunk's FLOPs).
      * `decode_context_lens`: per decoding request, tokens already in its KV cache.
    Activations are ignored: they stay in cache/registers at these sizes.
    """

    def __init__(
        self,
        spec: ModelSpec,
        hardware: Hardware,
        dtype: str | None = None,
        *,
        mem_efficiency: float | None = None,
        compute_efficiency: float | None = None,
        overhead_s: float | None = None,
        per_seq_overhead_s: float = 0.0,
        quantization: str | None = None,
    ) -> None:
        self.spec = spec
        # weight-only int8/int4 (model/weights/quant_schemes.py): fewer bytes per step, the same FLOPs
        self.quantization = quantization
        self.hardware = hardware
        self.dtype = normalize_dtype(dtype) if dtype else spec.default_dtype()
        em, ec = default_efficiency(hardware)
        self.mem_efficiency = em if mem_efficiency is None else float(mem_efficiency)
        self.compute_efficiency = ec if compute_efficiency is None else float(compute_efficiency)
        if not (0 < self.mem_efficiency <= 1.5 and 0 < self.compute_efficiency <= 1.5):
            raise ValueError("efficiencies must be in (0, 1.5]")
        self.overhead_s = default_overhead_s(spec, hardware) if overhead_s is None else float(overhead_s)
        # Per scheduled request: sampling, bookkeeping.  0 unless calibrated from real steps.
        self.per_seq_overhead_s = float(per_seq_overhead_s)
        # Precompute the constants so a step is a handful of multiply-adds.
        self.bandwidth = hardware.mem_bandwidth * self.mem_efficiency
        self.flop_rate = hardware.flops_for(self.dtype) * self.compute_efficiency
        self.weight_bytes = spec.streamed_weight_bytes(self.dtype, quantization)  # a one-token step's
        # Mixture of experts: a step of T tokens reads the experts they touch (`ModelSpec.experts_touched`).
        self._moe_bytes: dict[int, int] | None = {} if spec.is_moe else None
        self.total_weight_bytes = spec.weight_bytes(self.dtype, quantization)
        self.kv_bytes_per_token = spec.kv_bytes_per_token(self.dtype)
        self.layer_flops_per_token = 2 * spec.layer_matmul_params
        self.logits_flops = 2 * spec.logits_matmul_params
        self.attn_flops_per_position = spec.attention_flops_per_position

    # ------------------------------------------------------------ general step
    def step_cost(self, prefill: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]) -> StepCost:
        n_seq = len(prefill) + len(decode_context_lens)
        if n_seq == 0:
            return _ZERO
        kv_read_tokens = 0
        new_tokens = 0
        attn_positions = 0
        for n, c in prefill:
            kv_read_tokens += c
            new_tokens += n
            attn_positions += n * c + n * (n + 1) // 2  # causal: j-th new token sees c + j
        n_dec = len(decode_context_lens)
        sum_ctx = sum(decode_context_lens)
        kv_read_tokens += sum_ctx
        new_tokens += n_dec
        attn_positions += sum_ctx + n_dec  # each decode token sees its history + itself
        nbytes = self.weights_read(new_tokens) + (kv_read_tokens + new_tokens) * self.kv_bytes_per_token
        flops = (new_tokens * self.layer_flops_per_token + n_seq * self.logits_flops
                 + attn_positions * self.attn_flops_per_position)
        mem_t = nbytes / self.bandwidth
        comp_t = flops / self.flop_rate
        over = self.overhead_s + self.per_seq_overhead_s * n_seq
        return StepCost(float(nbytes), float(flops), mem_t, comp_t, over, max(mem_t, comp_t) + over)

    def weights_read(self, tokens: int) -> int:
        """Weight bytes a step of `tokens` new tokens streams: all of them in a dense model."""
        if self._moe_bytes is None:
            return self.weight_bytes
        if tokens not in self._moe_bytes:
            self._moe_bytes[tokens] = self.spec.streamed_weight_bytes(self.dtype, self.quantization, tokens)
        return self._moe_bytes[tokens]

    def step_time(self, prefill: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]) -> float:
        """Seconds for one step (see class docstring); 0 for an empty step."""
        return self.step_cost(prefill, decode_context_lens).time_s

    # ------------------------------------------------------------ uniform decode (closed form)
    def decode_cost(self, batch_size: int, context_len: int) -> StepCost:
        """`step_cost([], [context_len] * batch_size)` in O(1)."""
        b, ctx = batch_size, context_len
        if b <= 0:
            return _ZERO
        nbytes = self.weights_read(b) + b * (ctx + 1) * self.kv_bytes_per_token
        flops = b * (self.layer_flops_per_token + self.logits_flops + (ctx + 1) * self.attn_flops_per_position)
        mem_t, comp_t = nbytes / self.bandwidth, flops / self.flop_rate
        over = self.overhead_s + self.per_seq_overhead_s * b
        return StepCost(float(nbytes), float(flops), mem_t, comp_t, over, max(mem_t, comp_t) + over)

    def crossover_batch(self, context_len: int) -> float | None:
        """Batch size where compute time equals memory time; None if decode never turns compute-bound."""
        per_req_flops = self.layer_flops_per_token + self.logits_flops + (context_len + 1) * self.attn_flops_per_position
        denom = per_req_flops / self.flop_rate - (context_len + 1) * self.kv_bytes_per_token / self.bandwidth
        if denom <= 0:
            return None
        b = (self.weight_bytes / self.bandwidth) / denom
        if self._moe_bytes is not None:
            # The weights read grow with the batch (the experts it touches), towards all of them:
            # B = W(B) / bw' / denom, reached from below by iterating (W rises and is bounded).
            for _ in range(100):
                nxt = (self.spec.streamed_weight_bytes(self.dtype, self.quantization, max(1, round(b)))
                       / self.bandwidth) / denom
                if abs(nxt - b) < 0.5:
                    break
                b = nxt
        return b

    def prefill_cost(self, prompt_len: int, chunk_size: int | None = None, context_start: int = 0) -> tuple[StepCost, int]:
        """Summed cost of prefilling one prompt alone, in steps of `chunk_size` tokens; (cost, steps)."""
        chunk = prompt_len if not chunk_size or chunk_size <= 0 else chunk_size
        done, steps = 0, 0
        tot = [0.0] * 6
        while done < prompt_len:
            n = min(chunk, prompt_len - done)
            c = self.step_cost([(n, context_start + done)], [])
            tot = [a + b for a, b in zip(tot, c)]
            done += n
            steps += 1
        return StepCost(*tot), steps


# ---------------------------------------------------------------- report objects
@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    context_len: int
    bytes: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    flops: float
    mem_time_s: float
    compute_time_s: float
    overhead_s: float
    step_time_s: float
    bound: str
    tokens_per_s_per_request: float
    tokens_per_s_total: float
    kv_cache_bytes: float  # resident KV after the step: B * (L + 1) * kv
    fits_in_memory: bool  # all weights + resident KV <= device memory


@dataclass(frozen=True)
class PrefillPoint:
    prompt_len: int
    num_steps: int
    bytes: float
    flops: float
    mem_time_s: float
    compute_time_s: float
    overhead_s: float
    time_s: float  # TTFT floor: the prefill step also samples the first output token
    bound: str
    tokens_per_s: float


@dataclass(frozen=True)
class Estimate:
    hardware: dict
    model: dict
    dtype: str
    quantization: str | None
    mem_efficiency: float
    compute_efficiency: float
    overhead_s: float
    context_len: int
    kv_bytes_per_token: int
    weight_bytes_total: int  # whole checkpoint (must fit)
    weight_bytes_streamed: int  # read every step
    flops_per_token: int  # at context_len (decode, with logits)
    max_batch_in_memory: int  # requests whose KV at context_len fits next to the weights
    crossover_batch: float | None
    decode: tuple[DecodePoint, ...]
    prefill: PrefillPoint | None

    def to_dict(self) -> dict:
        return asdict(self)


def decode_point(cm: CostModel, batch_size: int, context_len: int) -> DecodePoint:
    c = cm.decode_cost(batch_size, context_len)
    kv = cm.kv_bytes_per_token
    resident = batch_size * (context_len + 1) * kv
    return DecodePoint(
        batch_size=batch_size,
        context_len=context_len,
        bytes=c.bytes,
        weight_bytes=float(cm.weights_read(batch_size)),
        kv_read_bytes=float(batch_size * context_len * kv),
        kv_write_bytes=float(batch_size * kv),
        flops=c.flops,
        mem_time_s=c.mem_time_s,
        compute_time_s=c.compute_time_s,
        overhead_s=c.overhead_s,
        step_time_s=c.time_s,
        bound=c.bound,
        tokens_per_s_per_request=1.0 / c.time_s,
        tokens_per_s_total=batch_size / c.time_s,
        kv_cache_bytes=float(resident),
        fits_in_memory=cm.total_weight_bytes + resident <= cm.hardware.memory_bytes,
    )


def prefill_point(cm: CostModel, prompt_len: int, chunk_size: int | None = None) -> PrefillPoint:
    c, steps = cm.prefill_cost(prompt_len, chunk_size)
    return PrefillPoint(
        prompt_len=prompt_len,
        num_steps=steps,
        bytes=c.bytes,
        flops=c.flops,
        mem_time_s=c.mem_time_s,
        compute_time_s=c.compute_time_s,
        overhead_s=c.overhead_s,
        time_s=c.time_s,
        bound=c.bound,
        tokens_per_s=prompt_len / c.time_s if c.time_s > 0 else math.inf,
    )


def max_batch_in_memory(cm: CostModel, context_len: int) -> int:
    free = cm.hardware.memory_bytes - cm.total_weight_bytes
    per_req = (context_len + 1) * cm.kv_bytes_per_token
    return max(0, int(free // per_req)) if per_req > 0 else 0


def estimate(
    spec: ModelSpec,
    hardware: Hardware,
    dtype: str | None = None,
    batch_sizes: Sequence[int] = (1, 8, 32, 128),
    context_len: int = 1024,
    prompt_len: int | None = 512,
    *,
    mem_efficiency: float | None = None,
    compute_efficiency: float | None = None,
    overhead_s: float | None = None,
    prefill_chunk: int | None = None,
    quantization: str | None = None,
) -> Estimate:
    """Decode estimate at each batch size, crossover batch, and the prefill/TTFT floor."""
    if context_len < 0:
        raise ValueError("context_len must be >= 0")
    if any(b < 1 for b in batch_sizes):
        raise ValueError("batch sizes must be >= 1")
    cm = CostModel(spec, hardware, dtype, mem_efficiency=mem_efficiency,
                   compute_efficiency=compute_efficiency, overhead_s=overhead_s, quantization=quantization)
    return Estimate(
        hardware=hardware.to_dict(),
        model=spec.to_dict(),
        dtype=cm.dtype,
        quantization=quantization,
        mem_efficiency=cm.mem_efficiency,
        compute_efficiency=cm.compute_efficiency,
        overhead_s=cm.overhead_s,
        context_len=context_len,
        kv_bytes_per_token=cm.kv_bytes_per_token,
        weight_bytes_total=cm.total_weight_bytes,
        weight_bytes_streamed=cm.weight_bytes,
        flops_per_token=spec.flops_per_token(context_len + 1),
        max_batch_in_memory=max_batch_in_memory(cm, context_len),
        crossover_batch=cm.crossover_batch(context_len),
        decode=tuple(decode_point(cm, b, context_len) for b in batch_sizes),
        prefill=prefill_point(cm, prompt_len, prefill_chunk) if prompt_len else None,
    )
