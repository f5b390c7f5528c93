"""Our CPU kernels (AVX2 + FMA; AVX-512 where present), built on first use: the decode GEMM and paged decode attention.

A decode step is one pass over every weight matrix plus, per request, one pass over its
KV history (the seed: each step reads the whole model, and each new token attends to the
whole cache).  On a CPU the step time is the time these streams take, and PyTorch's
stock kernels stream them poorly at decode's shapes:

* `cpu_gemm.cpp`: y = x W^T with W packed in 16-column panels (`pack`), fp32 or bf16
  weights.  Used where it was measured to beat oneDNN: x86 CPUs with AVX2 + FMA but
  without AVX-512 (see `preferred`; model/weights/packed_linear.py has the figures).
* `cpu_gemm_avx512.cpp`: the same GEMM for fp32 weights on CPUs with AVX-512, in 32-column
  panels (`pack(w, WIDE)`: one sequential stream per thread), with a micro-kernel shaped
  for 512-bit FMAs; a separate extension built with AVX-512 flags.  It beats oneDNN at
  decode's row counts and loses ~5-10% at prefill's.
* `cpu_gemm_bf16.cpp`: the same GEMM for bf16 weights on CPUs with AVX512-BF16, in the
  layout its dot-product instruction reads (`pack_pairs`); also its own extension.
  Used for bf16 on those CPUs, where it streams faster than oneDNN's bf16 GEMV.  Where the
  CPU's bf16 dot product runs far below its float32 FMA rate, the same panels are widened to
  float32 in registers and multiplied by FMAs instead (`bf16_dot`, measured once).
* `cpu_fused.cpp`: the decoder layer's element-wise ops as one op and one pass each, for
  float32 and bfloat16 (the `cpu` ops backend, model/ops.py): RMSNorm (with the residual add before it, or
  not), rotary embedding (also straight from the qkv output into the KV cache), SiLU(gate)
  * up; the greedy argmax over the vocabulary (`argmax_rows`); and `stream_read`, a plain
  parallel read of a buffer, the rate specs/microbench.py reports as the memory roof.
* `cpu_gemm_quant.cpp`: the same GEMM for int8 / int4 weights (model/weights/quantization.py), in
  32-column panels (`pack_int8`, `pack_int4`), widened to float32 as they stream, or multiplied
  by VNNI integer dot products for decode rows (`quant_vnni.h`); built three ways, AVX-512 with
  VNNI + VBMI, AVX-512, AVX2 (`quant_ops`).
* `cpu_sampling.cpp`: the sampler's top-k and top-p filters without sorting the vocabulary
  (`top_k_mask`, `top_p_mask`): two rounds of bucketing each value's bits find the line; and
  logprobs' top n and rank in one pass over a row (`logprob_rows`).
* `cpu_attention.cpp`: decode attention reading the paged KV cache in place, instead of
  gathering it into a dense copy for SDPA.  Used on any CPU where the kernels build; the
  AVX-512 extension compiles the same source again with its 512-bit loop (`attention_op`);
  for bf16 caches on CPUs with usable AMX, `cpu_attention_amx.cpp` (kernels/amx.py
  `decode_attention_op`) runs its two products as tile multiplies.
* `cpu_fused_avx512.cpp`: `cpu_fused.cpp`'s SiLU(gate) * up on sixteen lanes, in the AVX-512
  extension (model/ops.py takes it where that extension runs).

`simd_avx2.h` and `simd_avx512.h` hold vector helpers several of them share, `panel_linear.h` what the three GEMM
ops share besides their kernels (input flattening, output, bias), `gemm_driver.h` the loops every
GEMM runs its micro-kernels in (row tiles packed in parallel, weight panels split over threads):
a new GEMM kernel plugs its micro-kernel into those.  `kernels/build.py` compiles
and caches each extension (once per distinct build of its sources, flags and torch; anything
that fails -- no compiler, not x86 -- leaves PyTorch's kernels in charge), `kernels/cpu_probe.py`
reads the CPU's flags that decide which extensions are built; this module wraps the ops.
`TOKENLOOM_CPU_GEMM=own|onednn` overrides the GEMM choice (tests force each),
`TOKENLOOM_BF16_DOT=dpbf16|fma` the bf16 GEMM's way of multiplying,
`TOKENLOOM_CPU_ATTENTION=0` turns the attention kernel off (`=avx2`: its AVX2 build even on
AVX-512 CPUs, `=avx512`: not the AMX one), `TOKENLOOM_CPU_FUSED=0` the fused element-wise ops.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from tokenloom.kernels import hugepages
from tokenloom.kernels.build import _build
from tokenloom.kernels.cpu_probe import cpu_flags as _cpu_flags  # the name tests and callers use

NR = 16  # panel width of the AVX2 kernel; must match cpu_gemm.cpp
WIDE = 32  # panel width of the AVX-512 fp32 and bf16 kernels; must match cpu_gemm_avx512.cpp, cpu_gemm_bf16.cpp


def _register_fake_linear(op: str) -> None:
    """Shapes for torch.compile, which traces through the ops without running them."""

    @torch.library.register_fake(op)
    def _(x, weight_packed, n, bias):
        return x.new_empty((*x.shape[:-1], n))


def _register_fake_attention(op: str) -> None:
    @torch.library.register_fake(op)
    def _(q, k_cache, v_cache, block_tables, context_lens, scale):
        return torch.empty_like(q)


@functools.cache
def load() -> bool:
    """Compile and load the AVX2 kernels once per process; False if they cannot run here."""
    if not {"avx2", "fma"} <= _cpu_flags():
        return False
    sources = ["cpu_gemm.cpp", "cpu_attention.cpp", "cpu_fused.cpp", "cpu_sampling.cpp"]
    if not _build("tokenloom_cpu_kernels", sources, ["-mavx2", "-mfma"]):
        return False
    _register_fake_linear("tokenloom_cpu::linear")
    _register_fake_attention("tokenloom_cpu::paged_decode_attention")

    @torch.library.register_fake("tokenloom_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("tokenloom_cpu::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("tokenloom_cpu::silu_and_mul")
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.register_fake("tokenloom_cpu::rope")
    def _(q, k, positions, cos, sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("tokenloom_cpu::rope_write_kv")
    def _(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
        return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[3]))

    @torch.library.register_fake("tokenloom_cpu::argmax_rows")
    def _(x):
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @torch.library.register_fake("tokenloom_cpu::stream_read")
    def _(x):
        return x.new_empty((), dtype=torch.long)

    return True


@functools.cache
def graph_enabled() -> bool:
    """Compile and load the op-list replayer (`cpu_graph.cpp`, runner/cpu_graphs.py) once per
    process; False if it cannot build here (`TOKENLOOM_CPU_GRAPHS=0` turns it off)."""
    if os.environ.get("TOKENLOOM_CPU_GRAPHS", "1") == "0":
        return False
    return _build("tokenloom_cpu_graph", ["cpu_graph.cpp"], [])


def graph_op_list():
    """An empty op list to record into (`graph_enabled` must be True)."""
    return torch.classes.tokenloom_graph.OpList()


@functools.cache
def avx512_enabled() -> bool:
    """Compile and load the AVX-512 fp32 GEMM, decode attention and SwiGLU once per process;
    False if they cannot run here."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags():
        return False
    if not _build("tokenloom_cpu_avx512_kernels", ["cpu_gemm_avx512.cpp", "cpu_attention.cpp", "cpu_fused_avx512.cpp"],
                  ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]):
        return False
    _register_fake_linear("tokenloom_avx512::linear")
    _register_fake_attention("tokenloom_avx512::paged_decode_attention")

    @torch.library.register_fake("tokenloom_avx512::silu_and_mul")
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    return True


@functools.cache
def bf16_enabled() -> bool:
    """Compile and load the AVX512-BF16 GEMM once per process; False if it cannot run here."""
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags():
        return False
    if not _build("tokenloom_cpu_bf16_kernels", ["cpu_gemm_bf16.cpp"],
                  ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]):
        return False
    _register_fake_linear("tokenloom_bf16::linear")
    _register_fake_linear("tokenloom_bf16::linear_fma")
    return True


# The float32-FMA way is taken when it multiplies-adds at least this much faster than vdpbf16ps.
BF16_FMA_MARGIN = 1.25


@functools.cache
def bf16_dot() -> str:
    """How the bf16 GEMM multiplies its panels in this process: "dpbf16" (AVX512-BF16's dot
    product) or "fma" (the weights widened to float32 in registers, float32 FMAs), for every
    row count alike.  `TOKENLOOM_BF16_DOT=dpbf16|fma` forces one; otherwise both are timed
    once on one core (`tokenloom_bf16::dot_rates`, a few milliseconds) and "fma" is chosen
    where it is `BF16_FMA_MARGIN` faster: on CPUs whose dot product runs far below their FMA
    rate (docs/performance.md, "bf16 on CPUs with a slow dot product")."""
    forced = os.environ.get("TOKENLOOM_BF16_DOT", "auto")
    if forced in ("dpbf16", "fma"):
        return forced
    dp, fma = torch.ops.tokenloom_bf16.dot_rates().tolist()
    return "fma" if fma >= BF16_FMA_MARGIN * dp else "dpbf16"


@functools.cache
def quant_ops():
    """The op namespace of our quantized GEMM for this CPU: the AVX-512 build with VNNI + VBMI
    (integer dot products for decode rows) where the CPU has them, else the plain AVX-512 build,
    else the AVX2 one (`TOKENLOOM_CPU_QUANT=avx512` or `=avx2` forces those); None where none
    builds or `TOKENLOOM_CPU_QUANT=0`."""
    choice = os.environ.get("TOKENLOOM_CPU_QUANT", "auto")
    flags = _cpu_flags()
    if choice == "0" or not {"avx2", "fma", "f16c"} <= flags:  # F16C: float16 group scales (GGUF)
        return None
    avx512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
    if choice == "auto" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"} <= flags:
        if _build("tokenloom_cpu_quant512v", ["cpu_gemm_quant.cpp"], [*avx512, "-mavx512vnni", "-mavx512vbmi"]):
            return _register_fake_quant("tokenloom_q512v")
    if choice in ("auto", "avx512") and {"avx512f", "avx512bw", "avx512vl"} <= flags:
        if _build("tokenloom_cpu_quant512", ["cpu_gemm_quant.cpp"], avx512):
            return _register_fake_quant("tokenloom_q512")
    if _build("tokenloom_cpu_quant256", ["cpu_gemm_quant.cpp"], ["-mavx2", "-mfma", "-mf16c"]):
        return _register_fake_quant("tokenloom_q256")
    return None


def _register_fake_quant(ns: str):
    @torch.library.register_fake(f"{ns}::linear_int8")
    def _(x, qweight, scales, n, bias):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake(f"{ns}::linear_int4")
    def _(x, qweight, scales, n, group, bias, offsets=None):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake(f"{ns}::linear_int8_group")
    def _(x, qweight, scales, n, group, bias):
        return x.new_empty((*x.shape[:-1], n))

    return getattr(torch.ops, ns)


def int8_quads() -> bool:
    """Whether the quantized kernel in use reads int8 panels in k-quads (the VNNI build: its
    integer dot products take four k of a column in one 32-bit lane)."""
    ops = quant_ops()
    return ops is not None and ops.name == "tokenloom_q512v"


def pack_int8(q: torch.Tensor, scale: torch.Tensor, quads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N] -> (int8 panels, float32 [ceil(N/32) * 32]), the layout
    `cpu_gemm_quant.cpp` streams; padded columns scale by 0.  Panels are [ceil(N/32), K, 32]
    (`pack(q, WIDE)`), or with `quads` [ceil(N/32), ceil(K/4), 32, 4]: out[p, j, c, t] =
    q[32p + c, 4j + t], K padded with zeros to whole quads."""
    if quads:
        n, k = q.shape
        k4 = -(-k // 4) * 4
        rows = pack(torch.nn.functional.pad(q, (0, k4 - k)) if k4 != k else q, WIDE)  # [P, k4, 32]
        packed = hugepages.empty((rows.shape[0], k4 // 4, WIDE, 4), q.dtype, q.device)
        packed.copy_(rows.view(rows.shape[0], k4 // 4, 4, WIDE).transpose(2, 3))
    else:
        packed = pack(q, WIDE)
    s = torch.zeros(packed.shape[0] * WIDE, dtype=torch.float32)
    s[: scale.numel()] = scale.float()
    return packed, s


def pack_int4(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values q [N, Kp] (int8 in -8..7) and bf16, fp16 or fp32 scales [N, Kp/G] -> ([P, Kp, 16] uint8,
    byte c of panel p at k = (q[32p + c, k] + 8) | (q[32p + 16 + c, k] + 8) << 4; scales
    [P, Kp/G, 32] in their dtype: `pack_group_scales`), P = ceil(N/32).  Padded columns are 0
    with scale 0."""
    n, kp = q.shape
    p = -(-n // WIDE)
    u = torch.full((p * WIDE, kp), 8, dtype=torch.uint8)
    u[:n] = (q.to(torch.int16) + 8).to(torch.uint8)
    u = u.view(p, 2, WIDE // 2, kp)
    nib = (u[:, 0] | (u[:, 1] << 4)).transpose(1, 2)  # [P, Kp, 16]
    packed = hugepages.empty((p, kp, WIDE // 2), torch.uint8).copy_(nib)
    return packed, pack_group_scales(scale)


def pack_int4_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """int4 weights [N, K] given as blocks of 32 along K, uint8 [N, K/32, 16] -- byte j of a block
    holds element j in its low nibble and element j + 16 in its high one, each q + 8 (a GGUF Q4_0
    block without its scale) -> the panels `pack_int4` makes of the same values, [ceil(N/32), K, 16],
    by a few byte operations on the blocks (no int8 copy of the weights on the way; in numpy,
    whose byte operations on these strided views ran 20x faster than PyTorch's here)."""
    n, nb, _ = blocks.shape
    p = -(-n // WIDE)
    if p * WIDE != n:  # padded columns: q = 0 (0x88: both nibbles 8)
        blocks = torch.cat([blocks, blocks.new_full((p * WIDE - n, nb, 16), 0x88)])
    b = blocks.contiguous().numpy().reshape(p, 2, WIDE // 2, nb, 16)
    x, y = b[:, 0], b[:, 1]  # columns c and c + 16 of each panel: [P, 16 (c), nb, 16 (j)]
    out = hugepages.empty((p, nb * 32, WIDE // 2), torch.uint8)
    halves = out.numpy().reshape(p, nb, 2, 16, WIDE // 2)  # k = 32 block + 16 half + j; shares out's memory
    halves[:, :, 0] = ((x & 15) | ((y & 15) << 4)).transpose(0, 2, 3, 1)  # elements j: low nibbles
    halves[:, :, 1] = ((x >> 4) | (y & 0xF0)).transpose(0, 2, 3, 1)  # elements j + 16: high nibbles
    return out


def pack_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [N, Kp/G] (bfloat16 or float16, or float32 for the int4 kernel; kept as they
    are) -> [ceil(N/32), Kp/G, 32]: a panel's 32 columns of one group side by side, the layout
    the grouped kernels load."""
    n, groups = scale.shape
    p = -(-n // WIDE)
    as_int = torch.int32 if scale.element_size() == 4 else torch.int16
    bits = scale.contiguous().view(as_int).numpy()  # numpy has no bfloat16: move the bits
    out = np.zeros((p * WIDE, groups), dtype=bits.dtype)
    out[:n] = bits
    packed = np.ascontiguousarray(out.reshape(p, WIDE, groups).transpose(0, 2, 1))
    return torch.from_numpy(packed).view(scale.dtype)


def preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on `device` in `dtype` should run our kernel (see module doc)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    choice = os.environ.get("TOKENLOOM_CPU_GEMM", "auto")
    if choice == "onednn":
        return False
    if choice == "auto" and "avx512f" in _cpu_flags():
        # There only our AVX-512 kernels beat oneDNN (its AVX-512 kernels beat our AVX2 one).
        return load() and (avx512_enabled() if dtype == torch.float32 else bf16_enabled())
    return load()


def tied_head_in_panels() -> bool:
    """Whether a tied lm_head on the oneDNN path is stored in our GEMM's panels (see
    `CausalLM.prepack`); TOKENLOOM_CPU_GEMM=onednn keeps every matmul in oneDNN."""
    return os.environ.get("TOKENLOOM_CPU_GEMM", "auto") != "onednn" and load()


def decode_attention_op(device: torch.device, dtype: torch.dtype, head_dim: int):
    """Our paged decode attention for a KV cache of this device, dtype and head size, or
    None where it cannot run (then SDPA reads a gathered copy).  The model runner asks once,
    not every layer: under torch.compile these checks (a cached file read) would break the
    graph at every layer."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0 \
            and attention_enabled():
        return attention_op()
    return None


@functools.cache
def attention_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_ATTENTION", "1") != "0" and load()


def attention_op():
    """Our paged decode attention: the AVX-512 build where the CPU has it (512-bit loop for
    head sizes that are multiples of 16), else the AVX2 one (kernels/amx.py `attention_op`
    adds the tile build for bf16 caches)."""
    if os.environ.get("TOKENLOOM_CPU_ATTENTION") not in ("avx2",) and avx512_enabled():
        return torch.ops.tokenloom_avx512.paged_decode_attention
    return torch.ops.tokenloom_cpu.paged_decode_attention


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [rows, n] logits; our kernel for float32 or bfloat16 on CPU
    (PyTorch's scans each row one element at a time), PyTorch's anywhere else.  Same answers,
    ties and NaN included."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1] > 0
            and fused_enabled()):
        return torch.ops.tokenloom_cpu.argmax_rows(x)
    return x.argmax(dim=-1)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits[r, j] to -inf, in place, where bit j of int32 `bitmask[r]` is 0 (xgrammar's
    token-bitmask layout); returns `logits`.  Our kernel for contiguous float32 on CPU, which
    skips all-ones words; PyTorch's unpacking anywhere else."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and fused_enabled()):
        return torch.ops.tokenloom_cpu.mask_logits_(logits, bitmask.to(torch.int32))
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = bitmask.to(device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :logits.shape[1]]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def _sampling_kernel_applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0 and fused_enabled())


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """`logits` [rows, vocab] with each row's values below its k-th largest set to -inf, in
    place (k [rows]: 0 or >= vocab leaves a row as it is); ties at the line stay.  Our kernel
    (`cpu_sampling.cpp`, no sort) for contiguous float32 on CPU; None elsewhere."""
    if not _sampling_kernel_applies(logits):
        return None
    return torch.ops.tokenloom_cpu.top_k_mask_(logits, k)


def top_p_mask(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """`logits` [rows, vocab] with each row's tokens outside its nucleus (`top_p` [rows]; `probs`
    the rows' softmax) set to -inf, in place: a token stays when the probability before it, in
    descending order (equal ones by index), is < top_p.  Our kernel (`cpu_sampling.cpp`, no
    sort) for contiguous float32 on CPU; None elsewhere."""
    if not _sampling_kernel_applies(logits):
        return None
    return torch.ops.tokenloom_cpu.top_p_mask_(logits, probs.float(), top_p)


def logprob_rows(logits: torch.Tensor, targets: torch.Tensor, n: int):
    """For each row of float32 `logits` [rows, vocab]: the rank of logit `targets[r]` (1 + how
    many are larger) and the row's `n` largest logits, largest first (equal ones by index),
    with their indices: (ranks, ids [rows, n], values [rows, n]), in one pass per row (our
    kernel, `cpu_sampling.cpp`).  None where it does not apply (not CPU float32)."""
    if not _sampling_kernel_applies(logits):
        return None
    return torch.ops.tokenloom_cpu.logprob_rows(logits, targets, n)


def stream_read(x: torch.Tensor) -> torch.Tensor | None:
    """The sum of every byte of CPU tensor `x` as unsigned values (int64, 0-dim; equal to
    `x.view(torch.uint8).sum()`), computed by reading `x` once with our kernel's streaming
    loop (`cpu_fused.cpp`): what `specs.microbench.measure_bandwidth` times.  None where the
    kernels cannot run here."""
    if x.device.type != "cpu" or not load():
        return None
    return torch.ops.tokenloom_cpu.stream_read(x)


@functools.cache
def fused_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_FUSED", "1") != "0" and load()


def pack(weight: torch.Tensor, width: int = NR) -> torch.Tensor:
    """[N, K] -> [ceil(N/width), K, width], zero-padded: out[p, k, c] = W[width p + c, k].

    Each panel of `width` outputs is one sequential stream.  The AVX2 kernel reads 16-wide
    panels (one ymm pair per k); the AVX-512 one reads 32-wide panels (`WIDE`: two zmm per
    k, 128 contiguous bytes), so a thread streams one sequence, not two panels side by side."""
    n, k = weight.shape
    w = weight.detach()
    full, rest = divmod(n, width)
    # One copy (no padded temporary of the whole matrix), in 2 MiB pages (hugepages.py).
    out = hugepages.empty((full + (rest > 0), k, width), w.dtype, w.device)
    out[:full].copy_(w[: full * width].view(full, width, k).transpose(1, 2))
    if rest:
        out[full].zero_()
        out[full, :, :rest].copy_(w[full * width :].t())
    return out


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N/32), ceil(K/2), 32, 2], zero-padded: out[p, j, c, t] = W[32p + c, 2j + t],
    so each k-pair of a 16-column half is the 64-byte vector `cpu_gemm_bf16.cpp` multiplies at
    once, and each panel is one sequential stream, like `pack(w, WIDE)`."""
    n, k = weight.shape
    p, k2 = -(-n // WIDE), -(-k // 2)
    w = weight.detach()
    if (p * WIDE, k2 * 2) != (n, k):  # ragged shapes only: a padded temporary
        padded = w.new_zeros((p * WIDE, k2 * 2))
        padded[:n, :k] = w
        w = padded
    out = hugepages.empty((p, k2, WIDE, 2), w.dtype, w.device)
    return out.copy_(w.view(p, WIDE, k2, 2).transpose(1, 2))


def pack_for(weight: torch.Tensor) -> torch.Tensor:
    """The packed layout our GEMM for this weight's dtype on this CPU reads."""
    if weight.dtype == torch.bfloat16 and bf16_enabled():
        return pack_pairs(weight)
    return pack(weight, WIDE if weight.dtype == torch.float32 and avx512_enabled() else NR)


def linear_op(packed: torch.Tensor):
    """The op that multiplies by `packed`: its layout says which kernel it was packed for
    (k-pairs: the bf16 kernel; 32-column panels: the AVX-512 one; 16-column: the AVX2 one).
    kernels/amx.py `linear_op` adds the AMX kernel where it wins."""
    if packed.dim() == 4:
        return torch.ops.tokenloom_bf16.linear_fma if bf16_dot() == "fma" else torch.ops.tokenloom_bf16.linear
    if packed.shape[-1] == WIDE:
        return torch.ops.tokenloom_avx512.linear
    return torch.ops.tokenloom_cpu.linear


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    out = torch.zeros(-(-n // WIDE) * WIDE, dtype=torch.float32)  # covers either panel width
    out[:n] = bias.detach().float()
    return out


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the original [N, k] matrix, read from either packed layout (embedding
    lookup on a tied vocab matrix that is stored only once, packed for the lm_head)."""
    if packed.dim() == 4:  # pairs: [P, K2, 32, 2] -> K2 * 2 values per row, an odd k's pad dropped
        return packed[ids // WIDE, :, ids % WIDE, :].reshape(*ids.shape, -1)[..., :k]
    width = packed.shape[-1]
    return packed[ids // width, :, ids % width]




def lora_op(device: torch.device, dtype: torch.dtype):
    """Our batched LoRA shrink/expand (kernels/cpu_lora.cpp: one call per linear, every
    segment of a step), or None where it cannot run or TOKENLOOM_CPU_LORA=0 turns it off
    (then PyTorch's matmuls do it: model/lora.py `apply_torch`).  Read at each call: a
    benchmark times both in one process."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if os.environ.get("TOKENLOOM_CPU_LORA", "1") == "0" or not lora_loaded():
        return None
    return apply_lora


@functools.cache
def lora_loaded() -> bool:
    """Compile and load the LoRA kernel once per process (AVX2 + FMA)."""
    if not {"avx2", "fma"} <= _cpu_flags() or not _build("tokenloom_cpu_lora", ["cpu_lora.cpp"], ["-mavx2", "-mfma"]):
        return False

    @torch.library.register_fake("tokenloom_lora::lora_apply_")
    def _(y, x, a, bt, segments, subs, rank):
        return y

    return True


def apply_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               subs: tuple[tuple[int, int], ...], rank: int, rows) -> None:
    """model/lora.py's `ApplyFn` through our kernel: y += each segment's delta, in place."""
    if y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError("the LoRA kernel needs the base linear's output in rows of its input's dtype")
    torch.ops.tokenloom_lora.lora_apply_(y, x if x.stride(1) == 1 else x.contiguous(), a, bt, rows.table,
                                         [c for sub in subs for c in sub], rank)
