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
    # How GPUs of this kind reach each other for tensor-parallel all-reduces: "nvlink",
    # "pcie" or "infinity-fabric", and the bytes/s one GPU sends in one direction on it.
    interconnect: str = "pcie"
    link_bandwidth: float = 32 * GB  # PCIe 4.0 x16: 32 GB/s per direction (the spec's 16 GT/s x 16 lanes)

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
            "interconnect": self.interconnect,
            "link_bandwidth": self.link_bandwidth,
        }


def _tensor_peaks(fp16_bf16_tflops: float, fp32_tflops: float, fp8_tflops: float | None = None,
                  int8_tops: float | None = None) -> dict[str, float]:
    peaks = {
        "float16": fp16_bf16_tflops * TFLOPS,
        "bfloat16": fp16_bf16_tflops * TFLOPS,
        "float32": fp32_tflops * TFLOPS,
    }
    if fp8_tflops:
        peaks["float8"] = fp8_tflops * TFLOPS
    if int8_tops:
        peaks["int8"] = int8_tops * TFLOPS
    return peaks


_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper, Table 1 (GeForce RTX 4090) "
           "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper, Table 1 (GeForce RTX 3090) "
             "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_3090TI = ("NVIDIA GeForce RTX 3090 Ti specifications (84 SMs, 1.86 GHz boost, 24 GB GDDR6X at 21 Gbps on 384 bits "
           "= 1008 GB/s) https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/; tensor rates "
           "= the GA102 whitepaper's RTX 3090 rates scaled by SMs x clock (84 x 1.86 / 82 x 1.695)")
_L4_DS = ("NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved for dense) "
          "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet")
_A10_DS = ("NVIDIA A10 Tensor Core GPU datasheet (sparse figures halved for dense) "
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf")
_A10G = ("AWS EC2 G5 instances: NVIDIA A10G, 24 GB, 600 GB/s https://aws.amazon.com/ec2/instance-types/g5/; "
         "NVIDIA publishes no A10G datasheet, so its tensor rates are the A10 datasheet's " + _A10_DS.split(" ")[-1])
_L40S_DS = ("NVIDIA L40S datasheet (48 GB GDDR6 at 864 GB/s; sparse figures halved for dense) "
            "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe columns) "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3 (H100 SXM5) "
            "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper; "
            "NVIDIA H100 datasheet https://www.nvidia.com/en-us/data-center/h100/")
_H100_DS = ("NVIDIA H100 datasheet, PCIe and NVL columns (sparse figures halved for dense) "
            "https://www.nvidia.com/en-us/data-center/h100/")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s; same GH100 "
            "compute as H100 SXM5, dense = sparse/2) https://www.nvidia.com/en-us/data-center/h200/")
_MI300X_DS = ("AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, 1307.4 TFLOPS FP16 / 2614.9 FP8 dense, "
              "7 Infinity Fabric links of 128 GB/s) https://www.amd.com/content/dam/amd/en/documents/"
              "instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf")
_MI250X_DS = ("AMD Instinct MI250X datasheet (two GCDs: 128 GB HBM2e, 3.2768 TB/s, 383 TFLOPS FP16 matrix, "
              "47.9 FP32 vector); one GCD is half of each https://www.amd.com/system/files/documents/"
              "amd-instinct-mi250x-datasheet.pdf")

# Interconnects: per-direction bytes/s one GPU puts on its links.
_NVLINK3 = dict(interconnect="nvlink", link_bandwidth=300 * GB)  # A100: 600 GB/s total, 12 links
_NVLINK4 = dict(interconnect="nvlink", link_bandwidth=450 * GB)  # H100/H200 SXM: 900 GB/s total, 18 links
_NVL_BRIDGE = dict(interconnect="nvlink", link_bandwidth=300 * GB)  # H100 NVL pair bridge: 600 GB/s
_PCIE4 = dict(interconnect="pcie", link_bandwidth=32 * GB)
_PCIE5 = dict(interconnect="pcie", link_bandwidth=64 * GB)
_XGMI = dict(interconnect="infinity-fabric", link_bandwidth=448 * GB)  # MI300X: 7 links x 64 GB/s per direction

CATALOG: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        # AD102: 165.2 dense FP16/BF16 w/ FP32 accumulate (330.3 w/ FP16 accumulate), 82.6 FP32;
        # FP8 330.3 w/ FP32 accumulate, INT8 660.6 dense.
        Hardware("rtx4090", 24 * GiB, 1008 * GB, _tensor_peaks(165.2, 82.6, 330.3, 660.6), _ADA_WP,
                 "GeForce RTX 4090, 24 GB GDDR6X", **_PCIE4),
        # GA102: 71 dense FP16/BF16 w/ FP32 accumulate (142 w/ FP16 accumulate), 35.6 FP32, INT8 284.
        Hardware("rtx3090", 24 * GiB, 936 * GB, _tensor_peaks(71.0, 35.6, None, 284.0), _GA102_WP,
                 "GeForce RTX 3090, 24 GB GDDR6X", **_PCIE4),
        Hardware("rtx3090ti", 24 * GiB, 1008 * GB, _tensor_peaks(79.8, 40.0, None, 319.2), _3090TI,
                 "GeForce RTX 3090 Ti, 24 GB GDDR6X", **_PCIE4),
        # AD104 datacenter part: 242 FP16/BF16 *with sparsity* -> 121 dense; 30.3 FP32; FP8/INT8 242.5 dense.
        Hardware("l4", 24 * GiB, 300 * GB, _tensor_peaks(121.0, 30.3, 242.5, 242.5), _L4_DS,
                 "L4, 24 GB GDDR6, 72 W", **_PCIE4),
        # GA102 datacenter part: 125 FP16/BF16 dense (250 sparse), 31.2 FP32, INT8 250.
        Hardware("a10", 24 * GiB, 600 * GB, _tensor_peaks(125.0, 31.2, None, 250.0), _A10_DS,
                 "A10, 24 GB GDDR6, 150 W", **_PCIE4),
        Hardware("a10g", 24 * GiB, 600 * GB, _tensor_peaks(125.0, 31.2, None, 250.0), _A10G,
                 "A10G (AWS G5), 24 GB GDDR6", **_PCIE4),
        # AD102 datacenter part: 362.05 FP16/BF16 dense (733 sparse), 91.6 FP32, FP8/INT8 733 dense.
        Hardware("l40s", 48 * GiB, 864 * GB, _tensor_peaks(362.05, 91.6, 733.0, 733.0), _L40S_DS,
                 "L40S, 48 GB GDDR6", **_PCIE4),
        # GA100: 312 dense FP16/BF16 (624 sparse), 19.5 FP32, INT8 624; 40GB HBM2 at 1,555 GB/s.
        Hardware("a100-40gb", 40 * GiB, 1555 * GB, _tensor_peaks(312.0, 19.5, None, 624.0), _A100_DS,
                 "A100 40GB SXM, HBM2", **_NVLINK3),
        # Same compute; 80GB HBM2e at 2,039 GB/s (SXM; the PCIe card is 1,935 GB/s).
        Hardware("a100-80gb", 80 * GiB, 2039 * GB, _tensor_peaks(312.0, 19.5, None, 624.0), _A100_DS,
                 "A100 80GB SXM, HBM2e", **_NVLINK3),
        Hardware("a100-40gb-pcie", 40 * GiB, 1555 * GB, _tensor_peaks(312.0, 19.5, None, 624.0), _A100_DS,
                 "A100 40GB PCIe, HBM2", **_PCIE4),
        Hardware("a100-80gb-pcie", 80 * GiB, 1935 * GB, _tensor_peaks(312.0, 19.5, None, 624.0), _A100_DS,
                 "A100 80GB PCIe, HBM2e", **_PCIE4),
        # GH100 SXM5: 989.4 dense FP16/BF16 (1978.9 sparse), 66.9 FP32, FP8/INT8 1978.9 dense; HBM3 at 3.35 TB/s.
        Hardware("h100-sxm", 80 * GiB, 3350 * GB, _tensor_peaks(989.4, 66.9, 1978.9, 1978.9), _H100_WP,
                 "H100 SXM5 80GB, HBM3", **_NVLINK4),
        # H100 PCIe: 756 FP16/BF16 dense (1,513 sparse), 51.2 FP32, FP8/INT8 1,513 dense; 80GB HBM2e at 2.0 TB/s.
        Hardware("h100-pcie", 80 * GiB, 2000 * GB, _tensor_peaks(756.0, 51.2, 1513.0, 1513.0), _H100_DS,
                 "H100 PCIe 80GB, HBM2e", **_PCIE5),
        # H100 NVL: 835.5 FP16/BF16 dense (1,671 sparse), 60 FP32, FP8/INT8 1,670.5 dense; 94GB HBM3 at 3.9 TB/s.
        Hardware("h100-nvl", 94 * GiB, 3900 * GB, _tensor_peaks(835.5, 60.0, 1670.5, 1670.5), _H100_DS,
                 "H100 NVL 94GB, HBM3 (NVLink bridge between pairs)", **_NVL_BRIDGE),
        # Same GH100 compute as the H100 SXM5; the memory is what changed.
        Hardware("h200", 141 * GiB, 4800 * GB, _tensor_peaks(989.4, 66.9, 1978.9, 1978.9), _H200_DS,
                 "H200 SXM 141GB, HBM3e", **_NVLINK4),
        Hardware("mi300x", 192 * GiB, 5300 * GB, _tensor_peaks(1307.4, 163.4, 2614.9, 2614.9), _MI300X_DS,
                 "AMD Instinct MI300X 192GB, HBM3", **_XGMI),
        Hardware("mi250x-gcd", 64 * GiB, 1638.4 * GB, _tensor_peaks(191.5, 23.95, None, 191.5), _MI250X_DS,
                 "one GCD of an AMD Instinct MI250X (the unit a process sees), 64 GB HBM2e", **_XGMI),
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

