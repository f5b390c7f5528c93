"""Hardware catalog: the two numbers that decide a decode step.

The seed asks "how long does one decode step take on an RTX 4090, and how do you get
tokens/s from it?".  Every decode step streams the whole model's weights (plus each
request's KV history) through the chip and does only ~2 FLOPs per weight per request,
so the answer is governed by two datasheet figures: memory bandwidth (bytes/s) and
dense tensor-core throughput (FLOP/s).  This module holds those figures, each with the
vendor document it was taken from, plus `local`: the same figures *measured* on the
machine we are running on (see `tokenloom.specs.microbench`).

Conventions (so numbers from different datasheets are comparable):

* `memory_bytes`: vendors write "24 GB" for GPU memory but mean binary units (an RTX 4090
  reports 24564 MiB), so capacities are stored as GiB * 2**30.
* `mem_bandwidth`: decimal bytes/s as printed (1008 GB/s = 1.008e12 B/s).
* `peak_flops`: dense (no 2:4 sparsity) rates.  For float16/bfloat16 the tensor-core rate
  *with FP32 accumulate* -- what PyTorch's matmuls use -- which GeForce parts run at half
  the FP16-accumulate rate; datacenter parts run both at the same rate.  For float32 the
  non-tensor (CUDA core) rate, i.e. no TF32 shortcut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30
GB = 10**9
TFLOPS = 10**12

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or the local CPU) as the roofline sees it."""

    name: str
    memory_bytes: int  # device memory capacity (weights + KV cache must fit)
    mem_bandwidth: float  # bytes/s, peak DRAM/HBM bandwidth
    peak_flops: dict[str, float]  # dtype name -> dense FLOP/s
    source: str  # where the figures come from (document + URL, or "measured ...")
    description: str = ""
    measured: bool = False  # True for `local`: figures are achieved rates, not datasheet peaks
    # Seconds per dispatched eager-mode op (kernel launch / PyTorch dispatch).  Measured for
    # `local`; 0 for datasheet parts, whose launch cost depends on the software stack (CUDA
    # graphs hide most of it) and is no datasheet figure -- pass an explicit overhead instead.
    op_overhead_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)  # measurement details for `local`

    def flops_for(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"known: {', '.join(sorted(self.peak_flops))}"
            ) from None

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte above which a kernel is compute-bound (peak / bandwidth)."""
        return self.flops_for(dtype) / self.mem_bandwidth

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "mem_bandwidth": self.mem_bandwidth,
            "peak_flops": dict(self.peak_flops),
            "source": self.source,
            "description": self.description,
            "measured": self.measured,
            "op_overhead_s": self.op_overhead_s,
            "extra": dict(self.extra),
        }


def _tensor_peaks(fp16_bf16_tflops: float, fp32_tflops: float) -> dict[str, float]:
    return {
        "float16": fp16_bf16_tflops * TFLOPS,
        "bfloat16": fp16_bf16_tflops * TFLOPS,
        "float32": fp32_tflops * TFLOPS,
    }


_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper, Table 1 (GeForce RTX 4090) "
           "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper, Table 1 (GeForce RTX 3090) "
             "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_L4_DS = ("NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved for dense) "
          "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet (SXM column) "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 SXM5) "
            "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper; "
            "NVIDIA H100 datasheet https://www.nvidia.com/en-us/data-center/h100/")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s; same GH100 "
            "compute as H100 SXM5, dense = sparse/2) https://www.nvidia.com/en-us/data-center/h200/")

CATALOG: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        # AD102: 165.2 dense FP16/BF16 w/ FP32 accumulate (330.3 w/ FP16 accumulate), 82.6 FP32.
        Hardware("rtx4090", 24 * GiB, 1008 * GB, _tensor_peaks(165.2, 82.6), _ADA_WP,
                 "GeForce RTX 4090, 24 GB GDDR6X"),
        # GA102: 71 dense FP16/BF16 w/ FP32 accumulate (142 w/ FP16 accumulate), 35.6 FP32.
        Hardware("rtx3090", 24 * GiB, 936 * GB, _tensor_peaks(71.0, 35.6), _GA102_WP,
                 "GeForce RTX 3090, 24 GB GDDR6X"),
        # AD104 datacenter part: 242 FP16/BF16 *with sparsity* -> 121 dense; 30.3 FP32.
        Hardware("l4", 24 * GiB, 300 * GB, _tensor_peaks(121.0, 30.3), _L4_DS,
                 "L4, 24 GB GDDR6, 72 W"),
        # GA100: 312 dense FP16/BF16 (624 sparse), 19.5 FP32; 40GB HBM2 at 1,555 GB/s.
        Hardware("a100-40gb", 40 * GiB, 1555 * GB, _tensor_peaks(312.0, 19.5), _A100_DS,
                 "A100 40GB SXM, HBM2"),
        # Same compute; 80GB HBM2e at 2,039 GB/s (SXM; the PCIe card is 1,935 GB/s).
        Hardware("a100-80gb", 80 * GiB, 2039 * GB, _tensor_peaks(312.0, 19.5), _A100_DS,
                 "A100 80GB SXM, HBM2e"),
        # GH100 SXM5: 989.4 dense FP16/BF16 (1978.9 sparse), 66.9 FP32; 80GB HBM3 at 3.35 TB/s.
        Hardware("h100-sxm", 80 * GiB, 3350 * GB, _tensor_peaks(989.4, 66.9), _H100_WP,
                 "H100 SXM5 80GB, HBM3"),
        # Same GH100 compute as the H100 SXM5; the memory is what changed.
        Hardware("h200", 141 * GiB, 4800 * GB, _tensor_peaks(989.4, 66.9), _H200_DS,
                 "H200 SXM 141GB, HBM3e"),
    )
}

LOCAL = "local"


class UnknownHardwareError(KeyError):
    """A KeyError whose message reads cleanly (KeyError's own str() adds quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def hardware_names() -> list[str]:
    return sorted(CATALOG) + [LOCAL]


def local_hardware(refresh: bool = False, device: str = "cpu") -> Hardware:
    """This machine, from (cached) microbenchmarks; measuring takes a few seconds once."""
    from tokenloom.specs import microbench  # torch is only needed here, not by the catalog

    m = microbench.measure_local(refresh=refresh, device=device)
    return Hardware(
        name=LOCAL,
        memory_bytes=int(m["memory_bytes"]),
        mem_bandwidth=float(m["mem_bandwidth"]),
        peak_flops={k: float(v) for k, v in m["matmul_flops"].items()},
        source=f"measured on this machine by tokenloom.specs.microbench ({m['key']})",
        description=str(m.get("device_name", "local")),
        measured=True,
        op_overhead_s=float(m["op_overhead_s"]),
        extra={k: m[k] for k in ("key", "measured_at", "torch_threads", "torch_version") if k in m},
    )


def get_hardware(name: str, *, refresh_local: bool = False) -> Hardware:
    """Catalog entry by name (case-insensitive), or `local` measured on this machine."""
    key = name.strip().lower()
    if key == LOCAL:
        return local_hardware(refresh=refresh_local)
    try:
        return CATALOG[key]
    except KeyError:
        raise UnknownHardwareError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}") from None

