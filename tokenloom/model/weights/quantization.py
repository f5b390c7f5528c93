"""Weight-only quantization at load time: int8 per output channel, int4 in groups along K.

A decode step at small batch reads every weight once and does little else with it (the seed:
each step reads the whole model), so its time is the bytes of weights it streams.  Storing
8 or 4 bits per weight instead of 16 cuts those bytes; activations stay in the model's dtype
and every product is computed in float32 from the dequantized weight:

* int8 (`--quantization int8`): q = round(w / s) in -127..127, one float32 scale per output
  row, s = max|w_row| / 127.  8 bits + 32 bits per row.
* int4 (`int4`: groups of 32 along K; `int4-g128`: 128): per group, the value of largest
  magnitude m maps to -8 exactly, s = -m / 8 (rounded to bfloat16 first), q = clamp(round(w / s),
  -8, 7): the full 16 levels are used, the extreme is exact.  4 bits + 16 bits per group
  (4.5 bits per weight at G = 32, 4.125 at G = 128).  K is padded to a multiple of G with zeros.

Two ways to multiply, chosen once at load (model/weights/loader.py):

* `PanelQuantized`: our CPU kernel (kernels/cpu_gemm_quant.cpp), weights in its 32-column
  panels, widened to float32 in registers as they stream, or, for decode rows on CPUs with
  AVX512-VNNI, multiplied as bytes by a three-byte split of each activation that keeps it to
  2^-20 of its block's largest (two bytes, 2^-13, for bf16 activations:
  kernels/quant_vnni.h).
* `TorchQuantized`: anywhere else (GPUs, CPUs without AVX2, `--linear-backend torch`): the
  weight is dequantized with PyTorch ops and multiplied by `F.linear`; correct, not fast.

A tied embedding / LM head is quantized once and shared: the head streams it, the embedding
lookup dequantizes only the rows it gathers (`QuantEmbedding`).  Figures: docs/quantization.md.

Weights that arrive already quantized (a GGUF file's Q4_0 / Q8_0 blocks: model/weights/formats/)
enter through `from_quantized` with their own integers and scales, which are never rounded again:
int4 in groups of 32 with float16 scales, and int8 in groups of 32 with float16 scales (an int8
`QuantScheme` with a group), both run by the same kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.weights.quant_schemes import SCHEMES, QuantScheme, parse_scheme  # noqa: F401 (re-exported)


# ---------------------------------------------------------------- quantize / dequantize


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, K], float32 scales [N]); w ~= q * s[:, None]."""
    w = w.detach().float()
    s = w.abs().amax(dim=1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.clamp(torch.round(w / s[:, None]), -127, 127).to(torch.int8)
    return q, s


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, Kp] in -8..7, bfloat16 scales [N, Kp / group]), Kp = K rounded up to
    the group; w ~= (q * s repeated over each group)[:, :K]."""
    w = w.detach().float()
    n, k = w.shape
    kp = -(-k // group) * group
    if kp != k:
        w = F.pad(w, (0, kp - k))
    g = w.view(n, kp // group, group)
    extreme = g.gather(2, g.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # signed value of largest |w|
    s = (extreme / -8).to(torch.bfloat16)
    sf = s.float()
    sf = torch.where(sf != 0, sf, torch.ones_like(sf))
    q = torch.clamp(torch.round(g / sf[..., None]), -8, 7).to(torch.int8).view(n, kp)
    return q, s


def dequantize_int8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from int8 q [N, K] and scales: one per row [N], or one per group [N, K / G]."""
    if s.dim() == 2:
        n, k = q.shape
        return (q.float().view(n, s.shape[1], -1) * s.float()[..., None]).view(n, k)
    return q.float() * s.float()[:, None]


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [N, k] from q [N, Kp] and scales [N, Kp / G]."""
    n, kp = q.shape
    g = kp // s.shape[1]
    return (q.float().view(n, kp // g, g) * s.float()[..., None]).view(n, kp)[:, :k]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 values [N, Kp] (Kp even) -> uint8 [N, Kp / 2]: k = 2j in the low nibble, 2j + 1 high."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    lo = (b & 15).to(torch.int8) - 8
    hi = (b >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=2).view(b.shape[0], -1)


# ---------------------------------------------------------------- quantized matrices


class QuantizedMatrix(nn.Module):
    """A quantized [N, K] weight: multiply by it, gather rows of it, or dequantize it whole."""

    out_features: int
    in_features: int
    scheme: QuantScheme

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def matmul_function(self, bias: torch.Tensor | None):
        """x -> matmul(x, bias) as a plain function (model/layers.py `bound_linear`)."""
        return functools.partial(self.matmul, bias=bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` of the dequantized matrix."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=self._device()))

    def _device(self) -> torch.device:
        return next(self.buffers()).device


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own quantization of a float weight: (q, scales) as `QuantizedMatrix.from_quantized` takes them."""
    if scheme.bits == 8:
        if scheme.group:
            raise ValueError(f"{scheme.name}: grouped int8 is read from a checkpoint, not computed at load")
        return quantize_int8(weight)
    return quantize_int4(weight, scheme.group)


class TorchQuantized(QuantizedMatrix):
    """The generic path: int8 [N, K] or nibbles [N, Kp / 2], dequantized by PyTorch ops each call."""

    def __init__(self, weight: torch.Tensor, scheme: QuantScheme):
        super().__init__()
        q, s = quantize(weight, scheme)
        self._store(q.to(weight.device), s.to(weight.device), scheme, weight.shape[1])

    @classmethod
    def from_quantized(cls, q: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, in_features: int) -> "TorchQuantized":
        """An already quantized matrix (a checkpoint's, model/weights/formats/): q and s as
        `quantize_int8` / `quantize_int4` return them -- or, for an int8 scheme with a group (GGUF's
        Q8_0), scales [N, K / G] -- kept as they are; group scales in any float dtype."""
        m = cls.__new__(cls)
        QuantizedMatrix.__init__(m)
        m._store(q, s, scheme, in_features)
        return m

    def _store(self, q: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, in_features: int) -> None:
        self.out_features, self.in_features = q.shape[0], in_features
        self.scheme = scheme
        self.register_buffer("qweight", q if scheme.bits == 8 else pack_nibbles(q), persistent=False)
        self.register_buffer("scales", s, persistent=False)

    def _dequant(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if self.scheme.bits == 8:
            return dequantize_int8(q, s)
        return dequantize_int4(unpack_nibbles(q), s, self.in_features)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self._dequant(self.qweight, self.scales)
        if x.device.type != "cpu":  # GPUs: the product in the activations' dtype (tensor cores)
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        # CPUs: float32 products of the float32 dequantized weight, as our kernel computes them
        return F.linear(x.float(), w, bias).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._dequant(self.qweight[flat], self.scales[flat]).view(*ids.shape, self.in_features)


class PanelQuantized(QuantizedMatrix):
    """Our CPU kernel's layout (kernels/cpu.py `pack_int8` / `pack_int4` / `pack_group_scales`)."""

    def __init__(self, weight: torch.Tensor, scheme: QuantScheme):
        super().__init__()
        q, s = quantize(weight, scheme)
        self._store(q, s, scheme, weight.shape[1])

    @classmethod
    def from_quantized(cls, q: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, in_features: int,
                       offsets: torch.Tensor | None = None) -> "PanelQuantized":
        """An already quantized matrix (a checkpoint's, model/weights/formats/): as
        `TorchQuantized.from_quantized`, group scales in bfloat16 or float16 (float32 for int4: what
        the kernel takes).  int4 `offsets` [N, Kp / G] float32 (GGUF's Q4_K mins): each weight is
        (q - 8) s + o of its group, the kernel adding o times each group's sum of x."""
        m = cls.__new__(cls)
        QuantizedMatrix.__init__(m)
        m._store(q, s, scheme, in_features)
        if offsets is not None:
            from tokenloom.kernels import cpu as cpu_kernels

            assert scheme.bits == 4 and offsets.shape == s.shape, (scheme, offsets.shape, s.shape)
            m.register_buffer("offsets", cpu_kernels.pack_group_scales(offsets.float()), persistent=False)
            m._op = cpu_kernels.quant_ops().linear_int4  # our kernel alone: the AMX kernel takes no offsets
        return m

    @classmethod
    def from_int4_blocks(cls, blocks: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> "PanelQuantized":
        """int4 with group-32 scales s [N, K / 32], the integers given as blocks of 32 nibbles
        (kernels/cpu.py `pack_int4_blocks`: GGUF's Q4_0 layout), packed from the bytes directly."""
        from tokenloom.kernels import amx as amx_kernels
        from tokenloom.kernels import cpu as cpu_kernels

        assert scheme.bits == 4 and scheme.group == 32, scheme
        m = cls.__new__(cls)
        QuantizedMatrix.__init__(m)
        m.out_features, m.in_features, m.scheme = blocks.shape[0], blocks.shape[1] * 32, scheme
        m._op = amx_kernels.with_amx("int4", cpu_kernels.quant_ops().linear_int4)  # float16 scales: AMX reads them
        m.register_buffer("qweight", cpu_kernels.pack_int4_blocks(blocks), persistent=False)
        m.register_buffer("scales", cpu_kernels.pack_group_scales(s), persistent=False)
        return m

    def _store(self, q: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, in_features: int) -> None:
        from tokenloom.kernels import amx as amx_kernels
        from tokenloom.kernels import cpu as cpu_kernels

        self.out_features, self.in_features = q.shape[0], in_features
        self.scheme = scheme
        ops = cpu_kernels.quant_ops()
        assert ops is not None, "our quantized CPU kernel is not available here"
        if scheme.bits == 8 and not scheme.group:
            packed, s = cpu_kernels.pack_int8(q, s, quads=cpu_kernels.int8_quads())
            self._op = amx_kernels.with_amx("int8", ops.linear_int8)
        elif scheme.bits == 8:  # groups (GGUF's Q8_0): our kernel alone, no AMX kernel reads them
            packed, _ = cpu_kernels.pack_int8(q, torch.zeros(q.shape[0]), quads=cpu_kernels.int8_quads())
            s = cpu_kernels.pack_group_scales(s)
            self._op = ops.linear_int8_group
        else:
            packed, s = cpu_kernels.pack_int4(q, s)
            amx_ok = scheme.group % 32 == 0 and s.dtype in (torch.bfloat16, torch.float16)
            self._op = amx_kernels.with_amx("int4", ops.linear_int4) if amx_ok else ops.linear_int4
        self.register_buffer("qweight", packed, persistent=False)
        self.register_buffer("scales", s, persistent=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul_function(bias)(x)

    def matmul_function(self, bias: torch.Tensor | None):
        op, q, s, n, g = self._op, self.qweight, self.scales, self.out_features, self.scheme.group
        if self.scheme.bits == 8 and not g:
            return lambda x: op(x, q, s, n, bias)
        o = getattr(self, "offsets", None)  # a buffer only where the matrix has them
        if o is not None:
            return lambda x: op(x, q, s, n, g, bias, o)
        return lambda x: op(x, q, s, n, g, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.qweight.shape[2] * (2 if self.scheme.bits == 4 else 1)  # 32 columns a panel
        p, c = ids // w, ids % w
        if self.scheme.bits == 8:
            q = self.qweight[p, :, c]  # [..., K] k-major, or [..., K / 4, 4] in k-quads
            q = q.reshape(*ids.shape, -1)[..., : self.in_features].float()
            if not self.scheme.group:
                return q * self.scales[ids].float()[..., None]
            s = self.scales[p, :, c].float()  # [..., K / G]
            return (q.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)
        b = self.qweight[p, :, c % (w // 2)]  # [..., Kp]
        nib = torch.where((c >= w // 2)[..., None], b >> 4, b & 15).to(torch.int8) - 8
        s = self.scales[p, :, c].float()  # [..., Kp / G]
        w = nib.float().unflatten(-1, (s.shape[-1], -1)) * s[..., None]
        if getattr(self, "offsets", None) is not None:
            w = w + self.offsets[p, :, c][..., None]
        return w.flatten(-2)[..., : self.in_features]


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantized (a `QuantizedMatrix`, possibly shared with an embedding)."""

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, pad_bias_to: int | None = None):
        super().__init__()
        self.matrix = matrix
        self.out_features, self.in_features = matrix.out_features, matrix.in_features
        if bias is not None:
            bias = bias.detach().float()
            if pad_bias_to is not None:
                bias = F.pad(bias, (0, pad_bias_to - bias.numel()))
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matrix.matmul(x, self.bias)

    def as_function(self):
        """forward as a plain function of x (model/layers.py `bound_linear`): no module dispatch per call."""
        return self.matrix.matmul_function(self.bias)


class QuantEmbedding(nn.Module):
    """Embedding lookup from a quantized vocab matrix shared with a tied LM head."""

    def __init__(self, matrix: QuantizedMatrix, dtype: torch.dtype):
        super().__init__()
        self.matrix, self.dtype = matrix, dtype
        self.num_embeddings, self.embedding_dim = matrix.out_features, matrix.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids).to(self.dtype)


def kernels_available(device: torch.device) -> bool:
    """Whether our quantized CPU kernel runs here (an x86 CPU with AVX2 + FMA and a compiler)."""
    if device.type != "cpu":
        return False
    from tokenloom.kernels import cpu as cpu_kernels

    return cpu_kernels.quant_ops() is not None


def quantize_model(model: nn.Module, scheme: QuantScheme, panels: bool) -> int:
    """Replace every nn.Linear of `model` (a CausalLM) by a QuantLinear, one at a time (each
    full-precision weight freed as soon as its quantized copy exists), and a tied embedding /
    LM head by one shared quantized matrix.  `panels`: our CPU kernel, else the PyTorch path.
    A linear marked `keep_precision` (a mixture-of-experts router, model/moe.py) stays in the
    model's dtype, in our GEMM's panels with `panels`.  Returns how many matrices were quantized."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.packed_linear import PanelLinear

    make = PanelQuantized if panels else TorchQuantized
    pad = None
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if getattr(old, "keep_precision", False):
            if panels and cpu_kernels.load():
                setattr(parent, attr, PanelLinear(old.weight, old.bias))
            kept += 1
            continue
        matrix = make(old.weight, scheme)
        if panels:
            pad = matrix.qweight.shape[0] * 32
        setattr(parent, attr, QuantLinear(matrix, old.bias, pad))
        del old, matrix
    n = len(names) - kept
    if getattr(model, "lm_head", 0) is None:  # tied: one quantized copy for the lookup and the head
        emb = model.embed_tokens
        matrix = make(emb.weight, scheme)
        model.embed_tokens = QuantEmbedding(matrix, emb.weight.dtype)
        model.lm_head = QuantLinear(matrix, None)
        del emb
        n += 1
    return n
