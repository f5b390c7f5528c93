"""CPU fast path: linear layers with weights packed once, at load time.

Decode is matmul-bound on a CPU: every step multiplies a few activation rows by every
weight matrix.  PyTorch's default CPU GEMM (MKL) handles these skinny products poorly on
some processors, so weights are reordered once into oneDNN's blocked layout and every
step calls oneDNN directly (`PackedLinear`) -- on CPU, for float32 everywhere and bfloat16
where the CPU has native bf16 instructions (see `packing_supported`).  Where our own GEMMs
beat oneDNN at decode's row counts (AVX2-only CPUs; AVX-512 fp32; AVX512-BF16 bf16),
`PanelLinear` holds weights in their column panels (`cpu_kernels.pack_for`).  The loader
picks one, once (`--linear-backend`; `cpu_kernels.preferred`); anything else keeps
`nn.Linear`, so CUDA and other devices run the plain code path unchanged.

The measurements behind each choice: docs/performance.md, "Why each CPU kernel is chosen".
"""

from __future__ import annotations

import torch
from torch import nn

# Reorder hint: oneDNN picks a blocking for this many rows; 2 gives up little at any row count
# (the alternatives measured: docs/performance.md, "Why each CPU kernel is chosen").
_PACK_ROWS_HINT = 2


@torch.library.custom_op("tokenloom::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through oneDNN, W packed (or plain).  A registered op, so `torch.compile`
    calls it as one opaque kernel instead of lowering the private mkldnn op, whose
    lowering only accepts weights frozen into the graph as constants."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS_HINT)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run packed `dtype` linears here, checked by running one.

    float32 works on any x86 CPU.  bfloat16 needs native support (AVX512-BF16 or AMX): on
    such CPUs the packed GEMV streams ~1.3x faster than PyTorch's default bf16 path;
    elsewhere the plain nn.Linear path is kept."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:  # private ops: make sure this torch build has them and they compute the right thing
        # oneDNN also *emulates* bf16 on plain AVX-512, correctly but slowly: require the
        # native instructions, where packing was measured to pay.
        if dtype == torch.bfloat16 and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(8, 4, generator=g).to(dtype)
        x = torch.randn(3, 4, generator=g).to(dtype)
        ref = (x.float() @ w.float().t())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for weight in (_pack(w), w):  # packed, and the plain layout (tied lm_head)
            y = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            if y.dtype != dtype or not torch.allclose(y.float(), ref, atol=tol, rtol=tol):
                return False
        return True
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout.

    `pack=False` keeps a reference to the plain weight instead (oneDNN still runs the
    product, reading the row-major layout): for a weight that is shared with another use,
    such as tied embeddings, where a packed copy would cost a second copy of the matrix."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = _pack(weight) if pack else weight.detach()
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.weight, self.bias)
        # Eager: call oneDNN directly; the custom op's dispatch would add ~10 us per linear.
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def as_function(self):
        """forward as a plain function of x (model/layers.py `bound_linear`): no module dispatch per call."""
        op, weight, bias = torch.ops.mkldnn._linear_pointwise, self.weight, self.bias
        return lambda x: op(x, weight, bias, "none", [], "")


class PanelLinear(nn.Module):
    """y = x W^T + b through our kernel, W held in column panels: `cpu_kernels.pack_for`
    picks the AVX2 layout (16 columns), the AVX-512 one (32) or, for bf16 on AVX512-BF16
    CPUs, the k-pair layout (32 columns of k-pairs).

    Built from a plain weight, or from an already packed one (`packed=`, with its shape),
    which is how a tied lm_head shares the panels with the embedding lookup."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: torch.Tensor | None = None,
                 shape: tuple[int, int] | None = None):
        super().__init__()
        from tokenloom.kernels import amx as amx_kernels
        from tokenloom.kernels import cpu as cpu_kernels

        if packed is None:
            assert weight is not None
            self.out_features, self.in_features = weight.shape
            packed = cpu_kernels.pack_for(weight)
        else:
            assert shape is not None
            self.out_features, self.in_features = shape
        self._op = amx_kernels.linear_op(packed)  # chosen once (AMX: by rows, kernels/amx.py)
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("bias", cpu_kernels.pad_bias(bias, self.out_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight, self.out_features, self.bias)

    def as_function(self):
        """forward as a plain function of x (model/layers.py `bound_linear`): no module dispatch per call."""
        op, weight, n, bias = self._op, self.weight, self.out_features, self.bias
        return lambda x: op(x, weight, n, bias)


class PanelEmbedding(nn.Module):
    """Embedding lookup that reads rows out of a panel-packed vocab matrix: with tied
    embeddings the matrix is stored once, in the layout the lm_head streams."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("weight", packed, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from tokenloom.kernels.cpu import packed_rows

        return packed_rows(self.weight, ids, self.embedding_dim)


def prepack_linears(model: nn.Module, make=PackedLinear) -> int:
    """Replace every nn.Linear in `model` by `make(weight, bias)` (a PackedLinear or a
    PanelLinear); returns how many were packed.

    One layer at a time, keeping no reference to the replaced module, so each unpacked
    weight is freed as soon as its packed copy exists: peak memory stays near one copy
    of the weights instead of two."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, make(old.weight, old.bias))
        del old
    return len(names)
