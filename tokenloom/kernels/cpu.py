"""Our CPU kernels (AVX2 + FMA), built on first use: the decode GEMM and paged decode attention.

A decode step is one pass over every weight matrix plus, per request, one pass over its
KV history (the seed: each step reads the whole model, and each new token attends to the
whole cache).  On a CPU the step time is the time these streams take, and PyTorch's
stock kernels stream them poorly at decode's shapes:

* `cpu_gemm.cpp`: y = x W^T with W packed in 16-column panels (`pack`), fp32 or bf16
  weights.  Used where it was measured to beat oneDNN: x86 CPUs with AVX2 + FMA but
  without AVX-512 (see `preferred`; model/packed_linear.py has the figures).
* `cpu_gemm_bf16.cpp`: the same GEMM for bf16 weights on CPUs with AVX512-BF16, in the
  layout its dot-product instruction reads (`pack_pairs`); a separate extension built with
  AVX-512 flags.  Used for bf16 on those CPUs, where it streams faster than oneDNN's bf16
  GEMV (packed_linear.py has the figures).
* `cpu_attention.cpp`: decode attention reading the paged KV cache in place, instead of
  gathering it into a dense copy for SDPA.  Used on any CPU where the kernels build.

They are compiled with the C++ toolchain PyTorch uses for extensions (cached under
~/.cache/torch_extensions; ~30-60 s once).  Anything that fails (no compiler, not x86)
leaves PyTorch's kernels in charge.  `TOKENLOOM_CPU_GEMM=own|onednn` overrides the GEMM
choice (tests force each), `TOKENLOOM_CPU_ATTENTION=0` turns the attention kernel off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NR = 16  # panel width; must match cpu_gemm.cpp
_SOURCES = [Path(__file__).with_name(f) for f in ("cpu_gemm.cpp", "cpu_attention.cpp")]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def load() -> bool:
    """Compile and load the extension once per process; False if it cannot run here."""
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return False
    try:
        from torch.utils.cpp_extension import load as load_ext

        load_ext(
            name="tokenloom_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no toolchain, no ninja, compile error: keep the stock kernels
        log.warning("tokenloom CPU kernels unavailable (%s); using PyTorch's kernels", e)
        return False

    # Shapes for torch.compile, which traces through the ops without running them.
    @torch.library.register_fake("tokenloom_cpu::linear")
    def _(x, weight_packed, n, bias):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("tokenloom_cpu::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, context_lens, scale):
        return torch.empty_like(q)

    return True


@functools.cache
def bf16_enabled() -> bool:
    """Compile and load the AVX512-BF16 GEMM once per process; False if it cannot run here."""
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags():
        return False
    try:
        from torch.utils.cpp_extension import load as load_ext

        load_ext(
            name="tokenloom_cpu_bf16_kernels",
            sources=[str(Path(__file__).with_name("cpu_gemm_bf16.cpp"))],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:
        log.warning("tokenloom AVX512-BF16 GEMM unavailable (%s); using oneDNN for bf16", e)
        return False

    @torch.library.register_fake("tokenloom_bf16::linear")
    def _(x, weight_packed, n, bias):
        return x.new_empty((*x.shape[:-1], n))

    return True


def preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on `device` in `dtype` should run our kernel (see module doc)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    choice = os.environ.get("TOKENLOOM_CPU_GEMM", "auto")
    if choice == "onednn":
        return False
    if choice == "auto" and "avx512f" in _cpu_flags():
        # oneDNN's AVX-512 fp32 kernels stream as fast as ours there; its bf16 GEMV does not.
        return dtype == torch.bfloat16 and bf16_enabled() and load()
    return load()


def tied_head_in_panels() -> bool:
    """Whether a tied lm_head on the oneDNN path is stored in our GEMM's panels (see
    `CausalLM.prepack`); TOKENLOOM_CPU_GEMM=onednn keeps every matmul in oneDNN."""
    return os.environ.get("TOKENLOOM_CPU_GEMM", "auto") != "onednn" and load()


def attention_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode attention over this cache can run our kernel."""
    return (q.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and attention_enabled())


@functools.cache
def attention_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_ATTENTION", "1") != "0" and load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16], zero-padded: each panel of 16 outputs one stream."""
    n, k = weight.shape
    w = weight.detach()
    full, rest = divmod(n, NR)
    out = w.new_empty((full + (rest > 0), k, NR))  # one copy: no padded temporary of the whole matrix
    out[:full].copy_(w[: full * NR].view(full, NR, k).transpose(1, 2))
    if rest:
        out[full].zero_()
        out[full, :, :rest].copy_(w[full * NR :].t())
    return out


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N/16), ceil(K/2), 16, 2], zero-padded: out[p, j, c, t] = W[16p + c, 2j + t],
    so each k-pair of a panel is the 64-byte vector `cpu_gemm_bf16.cpp` multiplies at once."""
    n, k = weight.shape
    p, k2 = -(-n // NR), -(-k // 2)
    w = weight.detach()
    if (p * NR, k2 * 2) != (n, k):  # ragged shapes only: a padded temporary
        padded = w.new_zeros((p * NR, k2 * 2))
        padded[:n, :k] = w
        w = padded
    return w.view(p, NR, k2, 2).transpose(1, 2).contiguous()


def pack_for(weight: torch.Tensor) -> torch.Tensor:
    """The packed layout our GEMM for this weight's dtype on this CPU reads."""
    return pack_pairs(weight) if weight.dtype == torch.bfloat16 and bf16_enabled() else pack(weight)


def linear_op(packed: torch.Tensor):
    """The op that multiplies by `packed` (its layout says which kernel made it)."""
    return torch.ops.tokenloom_bf16.linear if packed.dim() == 4 else torch.ops.tokenloom_cpu.linear


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    out = torch.zeros(-(-n // NR) * NR, dtype=torch.float32)
    out[:n] = bias.detach().float()
    return out


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the original [N, k] matrix, read from either packed layout (embedding
    lookup on a tied vocab matrix that is stored only once, packed for the lm_head)."""
    if packed.dim() == 4:  # pairs: [P, K2, 16, 2] -> K2 * 2 values per row, an odd k's pad dropped
        return packed[ids // NR, :, ids % NR, :].reshape(*ids.shape, -1)[..., :k]
    return packed[ids // NR, :, ids % NR]


