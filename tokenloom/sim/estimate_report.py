"""What `tokenloom estimate` prints: the decode table, the worked explanation, the hardware catalog.

Kept apart from the command's flags (`sim.cli`) so the report can be read (and changed) on
its own: the plain roofline's formula with every number plugged in, or -- for datasheet GPUs
timed kernel by kernel -- each part of the step with the share of the peak it runs at and the
band engines of lesser and greater quality reach.
"""

from __future__ import annotations

from tokenloom.specs.hardware import CATALOG, LOCAL, Hardware


# ---------------------------------------------------------------- number formatting
def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:,.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} µs"


def fmt_rate(x: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.4g} {prefix}{unit}"
    return f"{x:.4g} {unit}"


def catalog_table() -> "object":
    from rich.table import Table

    t = Table(title="hardware catalog (dense peaks; fp16/bf16 = tensor cores w/ FP32 accumulate)")
    for col in ("name", "memory", "bandwidth", "fp16/bf16", "fp8", "int8", "fp32", "ridge fp16 (FLOP/B)",
                "interconnect", "source"):
        t.add_column(col, overflow="fold")
    for hw in CATALOG.values():
        opt = lambda k: fmt_rate(hw.peak_flops[k], "FLOP/s") if k in hw.peak_flops else "-"  # noqa: E731
        t.add_row(hw.name, f"{hw.memory_bytes / 2**30:.0f} GiB", fmt_rate(hw.mem_bandwidth, "B/s"),
                  fmt_rate(hw.peak_flops["float16"], "FLOP/s"), opt("float8"), opt("int8"),
                  fmt_rate(hw.peak_flops["float32"], "FLOP/s"), f"{hw.ridge_point('float16'):.0f}",
                  f"{hw.interconnect} {fmt_rate(hw.link_bandwidth, 'B/s')}", hw.source)
    t.add_row(LOCAL, "-", "measured", "measured", "-", "-", "measured", "-", "-", "tokenloom.specs.microbench (cached)")
    return t


def model_line(cm) -> str:
    """One line naming the cost model a run uses."""
    if cm.form == "roofline":
        return (f"plain roofline: mem eff {cm.mem_efficiency:g}, compute eff {cm.compute_efficiency:g}, "
                f"overhead {fmt_time(cm.overhead_s)}/step")
    e = cm.efficiency
    tp = f", tp {cm.tensor_parallel_size}" if cm.tensor_parallel_size > 1 else ""
    return (f"kernel by kernel{tp}: weights at {cm.mem_efficiency:g} of bandwidth, KV at {e.kv_eff:g}, GEMMs up to "
            f"{cm.compute_efficiency:g} of peak, {fmt_time(e.layer_overhead_s)}/layer "
            f"({fmt_time(e.prefill_layer_overhead_s)} prefilling), host {fmt_time(e.step_overhead_s)}/step + "
            f"{fmt_time(e.seq_overhead_s)}/sequence")


def decode_table(est) -> "object":
    from rich.table import Table

    hw = est.hardware
    weights = est.dtype + (f", {est.quantization} weights" if est.quantization else "")
    if est.kv_cache_dtype and est.kv_cache_dtype != est.dtype:
        weights += f", {est.kv_cache_dtype} KV"
    tp = f" x{est.tensor_parallel_size}" if est.tensor_parallel_size > 1 else ""
    if est.form == "roofline":
        how = (f"mem eff {est.mem_efficiency:g}, compute eff {est.compute_efficiency:g}, "
               f"overhead {fmt_time(est.overhead_s)}")
    else:
        how = (f"kernel by kernel (host {fmt_time(est.overhead_s)}/step), band = engines of lesser/greater "
               "quality")
    t = Table(title=f"decode step: {est.model['name']} ({weights}) on {hw['name']}{tp}, "
                    f"context {est.context_len} tokens/request, {how}")
    cols = ["batch", "bytes/step", "FLOPs/step", "mem time", "compute time", "step time", "bound",
            "tok/s per req", "tok/s total"]
    if est.form == "kernels":
        cols.append("tok/s total band")
    cols += ["KV resident", "fits"]
    for col in cols:
        t.add_column(col, justify="right")
    for d in est.decode:
        row = [str(d.batch_size), fmt_bytes(d.bytes), fmt_rate(d.flops, "FLOP"), fmt_time(d.mem_time_s),
               fmt_time(d.compute_time_s), fmt_time(d.step_time_s), d.bound,
               f"{d.tokens_per_s_per_request:,.1f}", f"{d.tokens_per_s_total:,.0f}"]
        if est.form == "kernels":
            lo, hi = d.tokens_per_s_total_band
            row.append(f"{lo:,.0f}–{hi:,.0f}")
        row += [fmt_bytes(d.kv_cache_bytes), "yes" if d.fits_in_memory else "NO"]
        t.add_row(*row)
    return t


def explain(est, spec, hw: Hardware) -> str:
    """The batch-smallest decode step, prefill and crossover with every number plugged in."""
    if est.form == "kernels":
        return explain_kernels(est, spec, hw)
    d = min(est.decode, key=lambda p: p.batch_size)
    B, L, kv = d.batch_size, est.context_len, est.kv_bytes_per_token
    nb = {"float16": 2, "bfloat16": 2, "float32": 4}[est.dtype]
    bw, peak = hw.mem_bandwidth, hw.peak_flops[est.dtype]
    em, ec = est.mem_efficiency, est.compute_efficiency
    bw_eff, peak_eff = bw * em, peak * ec
    per_req_flops = d.flops / B
    lines = [
        "",
        f"How one decode step at batch {B} was computed ({spec.name}, {est.dtype}, {hw.name}, context L = {L}):",
        "",
        f"  weights read per step   W  = {spec.streamed_params:,} params x {nb} B = {fmt_bytes(est.weight_bytes_streamed)}"
        if not est.quantization else
        f"  weights read per step   W  = {spec.matmul_params:,} matmul params in {est.quantization} (scales included)"
        f" + {spec.streamed_params - spec.matmul_params:,} others x {nb} B = {fmt_bytes(est.weight_bytes_streamed)}",
        f"  KV bytes per token      kv = 2 (K and V) x {spec.num_layers} layers x {spec.num_kv_heads} kv heads"
        f" x {spec.head_dim} head_dim x {nb} B = {kv:,} B",
        f"  bytes per step             = W + B*L*kv + B*kv = {fmt_bytes(d.weight_bytes)} + {B} x {L} x {kv:,} B"
        f" + {B} x {kv:,} B = {fmt_bytes(d.bytes)}",
        f"  memory time                = bytes / (bandwidth x mem_eff) = {fmt_bytes(d.bytes)}"
        f" / ({fmt_rate(bw, 'B/s')} x {em:g}) = {fmt_time(d.mem_time_s)}",
        f"  FLOPs per token         F  = 2 x {spec.matmul_params:,} matmul params + 4 x {spec.num_layers} layers"
        f" x {spec.num_heads} heads x {spec.head_dim} head_dim x (L+1 = {L + 1}) = {fmt_rate(per_req_flops, 'FLOP')}",
        f"  compute time               = B*F / (peak x compute_eff) = {B} x {fmt_rate(per_req_flops, 'FLOP')}"
        f" / ({fmt_rate(peak, 'FLOP/s')} x {ec:g}) = {fmt_time(d.compute_time_s)}",
        f"  step time                  = max({fmt_time(d.mem_time_s)}, {fmt_time(d.compute_time_s)})"
        f" + overhead {fmt_time(d.overhead_s)} = {fmt_time(d.step_time_s)}  ({d.bound}-bound)",
        f"  tokens/s                   = 1 / step = {d.tokens_per_s_per_request:,.1f} tok/s per request;"
        f"  B / step = {d.tokens_per_s_total:,.1f} tok/s in total",
        "",
        f"  arithmetic intensity at batch {B}: {d.flops / d.bytes:.1f} FLOP/B vs ridge point"
        f" {peak_eff / bw_eff:.0f} FLOP/B (peak' / bw') -> each weight byte is reused by only B requests",
    ]
    w_t = est.weight_bytes_streamed / bw_eff
    kv_t = (L + 1) * kv / bw_eff
    f_t = per_req_flops / peak_eff
    if est.crossover_batch is None:
        lines.append(
            f"  crossover batch  B* = (W/bw') / (F/peak' - (L+1)*kv/bw') = {fmt_time(w_t)} / ({fmt_time(f_t)} - {fmt_time(kv_t)})"
            f" -> none: at L = {L} each request's KV reads take longer than its FLOPs, so decode stays memory-bound at any batch")
    else:
        lines.append(
            f"  crossover batch  B* = (W/bw') / (F/peak' - (L+1)*kv/bw') = {fmt_time(w_t)} / ({fmt_time(f_t)} - {fmt_time(kv_t)})"
            f" = {est.crossover_batch:,.1f}  (below it: memory-bound, batching is ~free; above: compute-bound)")
    lines.append(
        f"  memory capacity: {fmt_bytes(est.weight_bytes_total)} of weights + {fmt_bytes((L + 1) * kv)} KV per request"
        f" -> at most {est.max_batch_in_memory:,} requests of {L + 1} tokens fit in {hw.memory_bytes / 2**30:.0f} GiB")
    if est.prefill is not None:
        p = est.prefill
        P = p.prompt_len
        lines += [
            "",
            f"  prefill of P = {P} prompt tokens ({p.num_steps} step{'s' if p.num_steps != 1 else ''}), the TTFT floor:",
            f"    FLOPs = 2 x P x {spec.layer_matmul_params:,} layer matmul params + 2 x {spec.logits_matmul_params:,}"
            f" logits params (last token only) + 4 x {spec.num_layers} x {spec.num_heads} x {spec.head_dim}"
            f" x P(P+1)/2 = {fmt_rate(p.flops, 'FLOP')}",
            f"    time  = max(bytes/bw' = {fmt_time(p.mem_time_s)}, FLOPs/peak' = {fmt_time(p.compute_time_s)})"
            f" + overhead {fmt_time(p.overhead_s)} = {fmt_time(p.time_s)}  ({p.bound}-bound, {p.tokens_per_s:,.0f} prompt tok/s)",
            "    TTFT >= this: the prefill step's last position also yields the first output token.",
        ]
    if not hw.measured:
        lines += ["", "  Roofline floor: real engines add per-step CPU/launch overhead (pass --overhead-ms) and "
                      "rarely reach the efficiencies above on every kernel."]
    return "\n".join(lines)


def explain_kernels(est, spec, hw: Hardware) -> str:
    """The kernel-by-kernel form of `explain`: each part of the smallest batch's step, with its rate."""
    from tokenloom.sim.efficiency import CENTRAL

    d = min(est.decode, key=lambda p: p.batch_size)
    B, L, kv, tp = d.batch_size, est.context_len, est.kv_bytes_per_token, est.tensor_parallel_size
    e = est.efficiency or CENTRAL.to_dict()
    p = d.parts or {}
    bw = hw.mem_bandwidth
    per = f" per GPU (of {tp})" if tp > 1 else ""
    fmt = est.weight_format or est.dtype
    lines = [
        "",
        f"How one decode step at batch {B} was computed ({spec.name}, {fmt} weights, {est.kv_cache_dtype} KV, "
        f"{hw.name}, context L = {L}), kernel by kernel:",
        "",
        f"  weights read per step{per}   W  = {fmt_bytes(est.weight_bytes_streamed)} ({fmt}: scales, zero-points "
        f"and the 16-bit parts included)",
        f"  streaming them               W / (bandwidth x {est.mem_efficiency:g}) = "
        f"{fmt_bytes(est.weight_bytes_streamed)} / ({fmt_rate(bw, 'B/s')} x {est.mem_efficiency:g}) = "
        f"{fmt_time(p.get('weights_s', 0))}",
        f"  their GEMMs' FLOPs           2 x B x matmul params{per} / (peak x {est.compute_efficiency:g} x "
        f"B/(B + {e['gemm_half_rows']:g})) = {fmt_time(p.get('gemm_s', 0))}",
        f"  GEMMs (stream and compute overlap: the {e['gemm_overlap']:g}-norm of the two) = "
        f"{fmt_time(p.get('linear_s', 0))}",
        f"  attention                    {B} x {L + 1} x {kv:,} B of KV / (bandwidth x {e['kv_eff']:g}) + FLOPs / "
        f"(peak x {e['attn_eff']:g}) = {fmt_time(p.get('attention_s', 0))}",
        f"  fixed                        {spec.num_layers} layers x {fmt_time(e['layer_overhead_s'])}"
        + (f" + {2 * spec.num_layers} all-reduces over {hw.interconnect}" if tp > 1 else "")
        + f" = {fmt_time(p.get('fixed_s', 0))}",
        f"  host                         {fmt_time(e['step_overhead_s'])} + {B} x {fmt_time(e['seq_overhead_s'])} = "
        f"{fmt_time(p.get('host_s', 0))}",
        f"  step time                    sum = {fmt_time(d.step_time_s)}  ({d.bound}-bound);  engines of greater / "
        f"lesser quality: {fmt_time(d.step_time_band_s[0])} / {fmt_time(d.step_time_band_s[1])}",
        f"  tokens/s                     1 / step = {d.tokens_per_s_per_request:,.1f} per request; B / step = "
        f"{d.tokens_per_s_total:,.1f} in total (band {d.tokens_per_s_total_band[0]:,.1f}–"
        f"{d.tokens_per_s_total_band[1]:,.1f})",
        "",
    ]
    if est.crossover_batch is None:
        lines.append("  crossover batch: none -- the layers' GEMMs stay memory-bound at any batch")
    else:
        lines.append(f"  crossover batch  B* = (W/bw') x peak x {est.compute_efficiency:g} / (2 x matmul params) - "
                     f"{e['gemm_half_rows']:g} = {est.crossover_batch:,.1f}  (below it the GEMMs are memory-bound; "
                     "attention's KV reads come on top at any batch)")
    lines.append(
        f"  memory capacity{per}: {fmt_bytes(est.weight_bytes_total)} of weights + {fmt_bytes((L + 1) * kv)} KV per "
        f"request -> at most {est.max_batch_in_memory:,} requests of {L + 1} tokens fit in "
        f"{hw.memory_bytes / 2**30:.0f} GiB")
    if est.prefill is not None:
        pf = est.prefill
        pp = pf.parts or {}
        lines += [
            "",
            f"  prefill of P = {pf.prompt_len} prompt tokens ({pf.num_steps} step{'s' if pf.num_steps != 1 else ''}),"
            " the TTFT floor:",
            f"    GEMMs {fmt_time(pp.get('linear_s', 0))} (compute {fmt_time(pp.get('gemm_s', 0))}, streaming "
            f"{fmt_time(pp.get('weights_s', 0))}) + attention {fmt_time(pp.get('attention_s', 0))} + "
            f"{spec.num_layers} layers x {fmt_time(e['prefill_layer_overhead_s'])} launched one by one"
            + (" + all-reduces" if tp > 1 else "") + f" + host {fmt_time(pp.get('host_s', 0))}",
            f"    = {fmt_time(pf.time_s)}  ({pf.bound}-bound, {pf.tokens_per_s:,.0f} prompt tok/s); engines of greater"
            f" / lesser quality: {fmt_time(pf.time_band_s[0])} / {fmt_time(pf.time_band_s[1])}",
        ]
    lines += ["", "  Efficiencies fitted to published measurements of other engines: docs/predictions.md."]
    return "\n".join(lines)
