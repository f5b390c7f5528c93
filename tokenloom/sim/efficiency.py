"""How much of a datasheet GPU a real engine gets, by what runs: the defaults and their bands.

A step on a datasheet GPU is timed (`sim.gpu_cost`) from the bytes and FLOPs of what it runs,
each at the rate its kind of kernel reaches:

* weight streaming at `weight_eff[kernel family]` of the memory bandwidth -- a plain 16-bit
  GEMV streams better than a kernel that dequantizes GGUF blocks or tinygemm's int4 on the fly;
* KV reads (paged attention) at `kv_eff` of the bandwidth;
* GEMMs at `compute_eff_max * T / (T + gemm_half_rows)` of the tensor-core peak for the
  format's compute dtype (T = rows, i.e. tokens in the step): a 128-row GEMM is far from
  peak, a 4096-row one close to it; FP8 and int8 GEMMs reach a smaller share of their 2x peak;
* attention FLOPs at `attn_eff` of the 16-bit peak;
* a fixed `layer_overhead_s` per layer and step (kernel launches, tails of small kernels,
  norms and rotary that are not bandwidth-bound at decode sizes), `prefill_layer_overhead_s`
  instead when the step prefills (engines replay decode steps from CUDA graphs but launch a
  prefill's kernels one by one, with variable-length attention set up per step);
* host time: `step_overhead_s` per step plus `seq_overhead_s` per scheduled sequence
  (scheduling, input preparation, sampling, detokenizing, streaming);
* tensor parallel: two all-reduces per layer, each `allreduce_latency_s[link]` plus its bytes
  at `link_eff` of the link's bandwidth.

Every default is fitted to published measurements; docs/predictions.md names the figures
each one was set from and checks the whole model against the others.  `BANDS` gives the
low and high profiles: what engines of lesser and greater quality reach on the same setup
(the spread of the published figures around the central one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

# Kernel families (`specs.weight_formats.WeightFormat.kernel`) -> share of memory bandwidth
# their weight streaming reaches.  "dense": 16/32-bit and FP8/int8 W8A8 weights (cuBLAS-class
# GEMV/GEMM); "int8-wo"/"int4-wo": dequantize-in-GEMV weight-only kernels (gpt-fast/torchao
# int8, tinygemm int4); "gguf-*": llama.cpp's quantized mat-vec kernels per block type;
# "marlin": the fast 4-bit GPTQ/AWQ kernels (Marlin, TurboMind, exllama); "mlc": TVM's fused
# dequantizing GEMV for q4f16_1.
DEFAULT_WEIGHT_EFF: dict[str, float] = {
    "dense": 0.75,
    "int8-wo": 0.62,
    "int4-wo": 0.47,
    "gguf-q8_0": 0.74,
    "gguf-q4_0": 0.63,
    "gguf-q4_1": 0.63,
    "gguf-q5_0": 0.63,
    "gguf-q5_1": 0.63,
    "gguf-q4_k": 0.63,
    "gguf-q5_k": 0.63,
    "gguf-q6_k": 0.63,
    "gguf-q2_k": 0.31,
    "gguf-q3_k": 0.31,
    "marlin": 0.92,
    "mlc": 0.92,
}
KERNEL_FAMILIES = tuple(DEFAULT_WEIGHT_EFF)


@dataclass(frozen=True)
class Efficiency:
    """The fractions and fixed costs `sim.gpu_cost` times a step with (see the module docstring)."""

    weight_eff: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHT_EFF))
    kv_eff: float = 0.8
    compute_eff_max: Mapping[str, float] = field(default_factory=lambda: {"16": 0.78, "float8": 0.54, "int8": 0.54})
    gemm_half_rows: float = 16.0
    # A GEMM's weight streaming and its FLOPs overlap, but not perfectly near the ridge point:
    # its time is the `gemm_overlap`-norm of the two, (w^p + c^p)^(1/p) (inf: max(w, c)).
    gemm_overlap: float = 2.0
    attn_eff: float = 0.3
    layer_overhead_s: float = 10e-6
    prefill_layer_overhead_s: float = 140e-6
    step_overhead_s: float = 0.3e-3
    seq_overhead_s: float = 10e-6
    allreduce_latency_s: Mapping[str, float] = field(default_factory=lambda: {"nvlink": 20e-6, "pcie": 80e-6,
                                                                              "infinity-fabric": 20e-6})
    link_eff: float = 0.7
    label: str = "central"

    def weight(self, kernel: str) -> float:
        try:
            return self.weight_eff[kernel]
        except KeyError:
            raise ValueError(f"no weight-streaming efficiency for kernel family {kernel!r}; "
                             f"known: {', '.join(sorted(self.weight_eff))}") from None

    def compute(self, kind: str, rows: float) -> float:
        """Share of the `kind` tensor-core peak a GEMM over `rows` rows reaches."""
        top = self.compute_eff_max.get(kind, self.compute_eff_max["16"])
        if rows <= 0:
            return top
        return top * rows / (rows + self.gemm_half_rows)

    def combine(self, weights_s: float, compute_s: float) -> float:
        """Seconds of one GEMM from its streaming and compute times (see `gemm_overlap`)."""
        p = self.gemm_overlap
        if math.isinf(p):
            return max(weights_s, compute_s)
        hi = max(weights_s, compute_s)
        if hi <= 0:
            return 0.0
        return hi * ((weights_s / hi) ** p + (compute_s / hi) ** p) ** (1.0 / p)

    def allreduce_latency(self, link: str) -> float:
        return self.allreduce_latency_s.get(link, self.allreduce_latency_s["pcie"])

    def scaled(self, *, weight: float = 1.0, kv: float = 1.0, compute: float = 1.0, attn: float = 1.0,
               overhead: float = 1.0, host: float = 1.0, allreduce: float = 1.0, label: str = "") -> "Efficiency":
        """A copy with every streaming/compute share multiplied (capped at 0.95) and every fixed cost scaled."""
        cap = lambda x: min(0.95, x)  # noqa: E731 - nothing streams or computes above ~95% of a datasheet peak
        return replace(
            self,
            weight_eff={k: cap(v * weight) for k, v in self.weight_eff.items()},
            kv_eff=cap(self.kv_eff * kv),
            compute_eff_max={k: cap(v * compute) for k, v in self.compute_eff_max.items()},
            attn_eff=cap(self.attn_eff * attn),
            layer_overhead_s=self.layer_overhead_s * overhead,
            prefill_layer_overhead_s=self.prefill_layer_overhead_s * overhead,
            step_overhead_s=self.step_overhead_s * host,
            seq_overhead_s=self.seq_overhead_s * host,
            allreduce_latency_s={k: v * allreduce for k, v in self.allreduce_latency_s.items()},
            label=label or self.label,
        )

    def to_dict(self) -> dict:
        return {
            "label": self.label, "weight_eff": dict(self.weight_eff), "kv_eff": self.kv_eff,
            "compute_eff_max": dict(self.compute_eff_max), "gemm_half_rows": self.gemm_half_rows,
            "gemm_overlap": self.gemm_overlap,
            "attn_eff": self.attn_eff, "layer_overhead_s": self.layer_overhead_s,
            "prefill_layer_overhead_s": self.prefill_layer_overhead_s,
            "step_overhead_s": self.step_overhead_s, "seq_overhead_s": self.seq_overhead_s,
            "allreduce_latency_s": dict(self.allreduce_latency_s), "link_eff": self.link_eff,
        }


CENTRAL = Efficiency()
# What the published figures spread over for one setup (docs/predictions.md, "Bands"):
# the best engines (fused kernels, CUDA graphs, C++ host loops) stream ~15% more and pay
# a third of the fixed costs; the weaker ones (older or eager engines, PCIe all-reduce
# without custom kernels) stream a quarter less and pay twice the fixed costs.
BANDS: dict[str, Efficiency] = {
    "low": CENTRAL.scaled(weight=0.75, kv=0.8, compute=0.8, attn=0.8, overhead=2.0, host=2.5, allreduce=2.5,
                          label="low"),
    "high": CENTRAL.scaled(weight=1.15, kv=1.15, compute=1.15, attn=1.3, overhead=0.35, host=0.35,
                           allreduce=0.6, label="high"),
}
