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

from typing import TYPE_CHECKING

from tokenloom.specs.hardware import Hardware
from tokenloom.specs.model_spec import ModelSpec, normalize_dtype

if TYPE_CHECKING:
    from tokenloom.sim.efficiency import Efficiency

# A plain roofline's efficiencies, used when they are passed by hand (`--mem-efficiency`,
# `--compute-efficiency`): the whole step at one memory and one compute share of the peaks.
# Without them, datasheet GPUs are timed kernel by kernel (`sim.gpu_cost`) at the shares
# `sim.efficiency` fitted to published measurements (docs/predictions.md).
DATASHEET_MEM_EFFICIENCY = 0.8
DATASHEET_COMPUTE_EFFICIENCY = 0.6
# Measured hardware (`local`): the figures already *are* achieved rates on this machine,
# so the estimate uses them as they are; the remaining gap is what `bench roofline` shows.
MEASURED_EFFICIENCY = 1.0


def default_efficiency(hw: Hardware) -> tuple[float, float]:
    """(mem_efficiency, compute_efficiency) of the plain roofline for `hw`."""
    if hw.measured:
        return MEASURED_EFFICIENCY, MEASURED_EFFICIENCY
    return DATASHEET_MEM_EFFICIENCY, DATASHEET_COMPUTE_EFFICIENCY


def default_overhead_s(spec: ModelSpec, hw: Hardware) -> float:
    """Fixed per-step cost of the plain roofline: measured per-op dispatch time x ops per forward
    (0 for datasheet parts, whose fixed costs the kernel-by-kernel model charges instead)."""
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
        per_seq_overhead_s: float | None = None,
        quantization: str | None = None,
        weight_format: str | None = None,
        kv_cache_dtype: str | None = None,
        tensor_parallel_size: int = 1,
        efficiency: "Efficiency | None" = None,
    ) -> None:
        from tokenloom.sim.efficiency import CENTRAL
        from tokenloom.sim.gpu_cost import GpuStepModel, weight_bytes
        from tokenloom.specs.weight_formats import get_kv_format, get_weight_format

        self.spec = spec
        self.hardware = hardware
        self.dtype = normalize_dtype(dtype) if dtype else spec.default_dtype()
        # The weight format: the engine's --quantization schemes are formats too (int8, int4, int4-g128).
        if quantization and weight_format and get_weight_format(quantization) != get_weight_format(weight_format):
            raise ValueError(f"--quantization {quantization} and --weight-format {weight_format} disagree; give one")
        fmt_name = weight_format or quantization
        self.weight_format = get_weight_format(fmt_name) if fmt_name else None
        self.quantization = self.weight_format.name if self.weight_format else None
        self.kv_format = get_kv_format(kv_cache_dtype or self.dtype)
        self.tensor_parallel_size = int(tensor_parallel_size)
        # Plain roofline (measured hardware, or efficiencies passed by hand) or kernel by kernel.
        self.form = ("roofline" if hardware.measured or mem_efficiency is not None or compute_efficiency is not None
                     else "kernels")
        if self.form == "roofline" and self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size needs the kernel-by-kernel model: "
                             "leave --mem-efficiency/--compute-efficiency out, on a datasheet GPU")
        eff = efficiency or CENTRAL
        if overhead_s is not None or per_seq_overhead_s is not None:
            from dataclasses import replace

            step = eff.step_overhead_s if overhead_s is None else float(overhead_s)
            per_seq = eff.seq_overhead_s if per_seq_overhead_s is None else float(per_seq_overhead_s)
            eff = replace(eff, step_overhead_s=step, seq_overhead_s=per_seq)
        self.efficiency = eff
        self.gpu = GpuStepModel(spec, hardware, self.dtype, self.weight_format, self.kv_format,
                                self.tensor_parallel_size, eff)
        parts = self.gpu.parts
        tp = self.tensor_parallel_size
        # Per GPU: what each of the tp GPUs streams, stores and caches.
        self.weight_bytes = int(round(parts.streamed / tp))  # a one-token step's
        # Mixture of experts: a step of T tokens reads the experts they touch (`ModelSpec.experts_touched`).
        self._moe_bytes: dict[int, int] | None = {} if spec.is_moe else None
        self.total_weight_bytes = int(round(parts.total / tp))
        self.kv_bytes_per_token = int(round(self.gpu.kv_per_token))
        self.layer_flops_per_token = 2 * spec.layer_matmul_params // tp
        self.logits_flops = 2 * spec.logits_matmul_params // tp
        self.attn_flops_per_position = spec.attention_flops_per_position // tp
        if self.form == "roofline":
            em, ec = default_efficiency(hardware)
            self.mem_efficiency = em if mem_efficiency is None else float(mem_efficiency)
            self.compute_efficiency = ec if compute_efficiency is None else float(compute_efficiency)
            if not (0 < self.mem_efficiency <= 1.5 and 0 < self.compute_efficiency <= 1.5):
                raise ValueError("efficiencies must be in (0, 1.5]")
            self.overhead_s = default_overhead_s(spec, hardware) if overhead_s is None else float(overhead_s)
            # Per scheduled request: sampling, bookkeeping.  0 unless calibrated from real steps.
            self.per_seq_overhead_s = 0.0 if per_seq_overhead_s is None else float(per_seq_overhead_s)
            self.bandwidth = hardware.mem_bandwidth * self.mem_efficiency
            self.flop_rate = self.gpu.peak_fmt * self.compute_efficiency
        else:
            self.mem_efficiency = eff.weight(self.weight_format.kernel if self.weight_format else "dense")
            self.compute_efficiency = eff.compute_eff_max.get(self.gpu.compute_kind, eff.compute_eff_max["16"])
            self.overhead_s = eff.step_overhead_s
            self.per_seq_overhead_s = eff.seq_overhead_s
            self.bandwidth = hardware.mem_bandwidth * self.mem_efficiency
            self.flop_rate = self.gpu.peak_fmt * self.compute_efficiency

    @property
    def layer_overhead_s(self) -> float:
        """Fixed seconds per step for the layers' small kernels (kernel-by-kernel model only)."""
        return self.gpu.layer_fixed if self.form == "kernels" else 0.0

    def with_efficiency(self, efficiency: "Efficiency") -> "CostModel":
        """The same model, format and GPU timed with other efficiencies (the band's low/high ends);
        host overheads passed by hand scale with the band as the defaults do."""
        from dataclasses import replace

        from tokenloom.sim.efficiency import CENTRAL

        if self.efficiency.step_overhead_s != CENTRAL.step_overhead_s and CENTRAL.step_overhead_s:
            efficiency = replace(efficiency, step_overhead_s=self.efficiency.step_overhead_s
                                 * efficiency.step_overhead_s / CENTRAL.step_overhead_s)
        if self.efficiency.seq_overhead_s != CENTRAL.seq_overhead_s and CENTRAL.seq_overhead_s:
            efficiency = replace(efficiency, seq_overhead_s=self.efficiency.seq_overhead_s
                                 * efficiency.seq_overhead_s / CENTRAL.seq_overhead_s)
        return CostModel(self.spec, self.hardware, self.dtype, quantization=self.quantization,
                         kv_cache_dtype=self.kv_format.name, tensor_parallel_size=self.tensor_parallel_size,
                         efficiency=efficiency)

    # ------------------------------------------------------------ kernel by kernel
    def entries_cost(self, entries: Sequence[tuple[int, int, bool]]) -> StepCost:
        """Cost of a step given as (new tokens, cached tokens, samples a token) per request."""
        if not entries:
            return _ZERO
        if self.form == "roofline":  # a one-token entry costs what a decode at its context costs
            return self.step_cost([(n, c) for n, c, _ in entries if n != 1], [c for n, c, _ in entries if n == 1])
        p = self.gpu.parts_for(entries)
        return StepCost(p.bytes, p.flops, p.weights + p.attention, p.gemm, p.fixed + p.host, p.total)

    # ------------------------------------------------------------ general step
    def step_cost(self, prefill: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]) -> StepCost:
        n_seq = len(prefill) + len(decode_context_lens)
        if n_seq == 0:
            return _ZERO
        if self.form == "kernels":
            return self.entries_cost([(1, c, True) for c in decode_context_lens] + [(n, c, True) for n, c in prefill])
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
        """Weight bytes (per GPU) a step of `tokens` new tokens streams: all of them in a dense model."""
        if self._moe_bytes is None:
            return self.weight_bytes
        if tokens not in self._moe_bytes:
            self._moe_bytes[tokens] = int(round(self.gpu.streamed_at(tokens)))
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
        if self.form == "kernels":
            return self.entries_cost([(1, ctx, True)] * b)
        nbytes = self.weights_read(b) + b * (ctx + 1) * self.kv_bytes_per_token
        flops = b * (self.layer_flops_per_token + self.logits_flops + (ctx + 1) * self.attn_flops_per_position)
        mem_t, comp_t = nbytes / self.bandwidth, flops / self.flop_rate
        over = self.overhead_s + self.per_seq_overhead_s * b
        return StepCost(float(nbytes), float(flops), mem_t, comp_t, over, max(mem_t, comp_t) + over)

    def crossover_batch(self, context_len: int) -> float | None:
        """Batch size where compute time equals memory time; None if decode never turns compute-bound.

        Kernel by kernel, attention runs apart from the GEMMs, so the crossover is the layers'
        GEMM's: B rows of FLOPs at peak * e_max * B / (B + h) take as long as streaming the
        weights, B* = (W / bw') * peak * e_max / (2 * P_layers) - h.  A mixture of experts' W
        grows with B (the experts B tokens touch), so there B = f(W(B)) is iterated from below
        (W rises and is bounded: the iteration climbs to the crossing)."""
        if self.form == "kernels":
            g = self.gpu
            top = self.efficiency.compute_eff_max.get(g.compute_kind, self.efficiency.compute_eff_max["16"])

            def crossing(w: float) -> float:
                return (w / g.bw_layers) * g.peak_fmt * top / g.p_layers - self.efficiency.gemm_half_rows
        else:
            per_req_flops = (self.layer_flops_per_token + self.logits_flops
                             + (context_len + 1) * self.attn_flops_per_position)
            denom = per_req_flops / self.flop_rate - (context_len + 1) * self.kv_bytes_per_token / self.bandwidth
            if denom <= 0:
                return None

            def crossing(w: float) -> float:
                return (w / self.bandwidth) / denom
        weights = (lambda t: self.gpu.w_layers_at(t)) if self.form == "kernels" else self.weights_read
        b = crossing(weights(1))
        if self._moe_bytes is not None:
            for _ in range(100):
                nxt = crossing(weights(max(1, round(b))))
                if abs(nxt - b) < 0.5:
                    break
                b = nxt
        return b if b > 0 else None

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
    # What engines of greater and lesser quality reach (sim.efficiency.BANDS): (fast, slow)
    # step times and (low, high) tokens/s in total; equal to the central figure for a plain roofline.
    step_time_band_s: tuple[float, float] = (math.nan, math.nan)
    tokens_per_s_total_band: tuple[float, float] = (math.nan, math.nan)
    parts: dict | None = None  # kernel by kernel: seconds of each part (sim.gpu_cost.StepParts)


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
    time_band_s: tuple[float, float] = (math.nan, math.nan)  # (best engines, weaker engines)
    parts: dict | None = None  # kernel by kernel, the last chunk's parts


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
    weight_format: str | None = None
    kv_cache_dtype: str = ""
    tensor_parallel_size: int = 1
    form: str = "roofline"  # "kernels": kernel by kernel at fitted efficiencies; "roofline": one max()
    layer_overhead_s: float = 0.0
    efficiency: dict | None = None  # the central profile's figures (kernel-by-kernel model)

    def to_dict(self) -> dict:
        return asdict(self)


def _parts(cm: CostModel, entries: list[tuple[int, int, bool]]) -> dict | None:
    if cm.form != "kernels":
        return None
    p = cm.gpu.parts_for(entries)
    return {"weights_s": p.weights, "gemm_s": p.gemm, "linear_s": p.linear, "attention_s": p.attention,
            "fixed_s": p.fixed, "host_s": p.host, "total_s": p.total}


def _bands(cm: CostModel) -> tuple[CostModel, CostModel] | None:
    """(high-quality, low-quality) siblings of `cm`, or None for a plain roofline."""
    if cm.form != "kernels":
        return None
    from tokenloom.sim.efficiency import BANDS

    return cm.with_efficiency(BANDS["high"]), cm.with_efficiency(BANDS["low"])


def decode_point(cm: CostModel, batch_size: int, context_len: int) -> DecodePoint:
    c = cm.decode_cost(batch_size, context_len)
    bands = _bands(cm)
    if bands is None:
        step_band = (c.time_s, c.time_s)
    else:
        step_band = (bands[0].decode_cost(batch_size, context_len).time_s,
                     bands[1].decode_cost(batch_size, context_len).time_s)
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
        step_time_band_s=step_band,
        tokens_per_s_total_band=(batch_size / step_band[1], batch_size / step_band[0]),
        parts=_parts(cm, [(1, context_len, True)] * batch_size),
    )


def prefill_point(cm: CostModel, prompt_len: int, chunk_size: int | None = None) -> PrefillPoint:
    c, steps = cm.prefill_cost(prompt_len, chunk_size)
    bands = _bands(cm)
    band = ((c.time_s, c.time_s) if bands is None else
            tuple(b.prefill_cost(prompt_len, chunk_size)[0].time_s for b in bands))
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
        time_band_s=band,
        parts=_parts(cm, [(prompt_len if not chunk_size else min(chunk_size, prompt_len), 0, True)]),
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
    per_seq_overhead_s: float | None = None,
    prefill_chunk: int | None = None,
    quantization: str | None = None,
    weight_format: str | None = None,
    kv_cache_dtype: str | None = None,
    tensor_parallel_size: int = 1,
) -> Estimate:
    """Decode estimate at each batch size, crossover batch, and the prefill/TTFT floor,
    each with the band engines of lesser and greater quality reach (kernel-by-kernel model)."""
    if context_len < 0:
        raise ValueError("context_len must be >= 0")
    if any(b < 1 for b in batch_sizes):
        raise ValueError("batch sizes must be >= 1")
    cm = CostModel(spec, hardware, dtype, mem_efficiency=mem_efficiency,
                   compute_efficiency=compute_efficiency, overhead_s=overhead_s,
                   per_seq_overhead_s=per_seq_overhead_s, quantization=quantization, weight_format=weight_format,
                   kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size)
    return Estimate(
        hardware=hardware.to_dict(),
        model=spec.to_dict(),
        dtype=cm.dtype,
        quantization=cm.quantization,
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
        weight_format=cm.quantization,
        kv_cache_dtype=cm.kv_format.name,
        tensor_parallel_size=cm.tensor_parallel_size,
        form=cm.form,
        layer_overhead_s=cm.layer_overhead_s,
        efficiency=cm.efficiency.to_dict() if cm.form == "kernels" else None,
    )
