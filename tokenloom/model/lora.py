"""LoRA adapters run beside the base model: many adapters, one batch.

An adapter adds a low-rank delta to a linear: y = W x + B (A x), with A [r, in] and
B [out, r] (r is small, 8..64; the scaling lora_alpha / r is folded into B at load).
Serving many adapters at once means each row of a step may use another adapter, or none.
The runner orders a step's rows by adapter once per step (runner/model_runner.py), so
each adapter's rows form one run, a *segment*; every wrapped linear then runs its base
matmul over all rows and, per segment, a shrink (x_seg A^T: [n, r]) and an expand
(t B^T, added to the segment's rows of the output).  Rows on the base model cost nothing.

Weights sit in `max_loras` slots allocated once (`LoRASlots`): per linear, every slot's A
stacked as [max_loras, n_sub * R, in] and B transposed as [max_loras, R, out], R =
--max-lora-rank (a smaller rank is zero-padded; each of B^T's rank rows is contiguous along
the output, the way an expand streams it).  Our q/k/v and gate/up projections are fused, so an
adapter's q_proj, k_proj and v_proj are *sub-adapters* of the one qkv linear: their A's
are stacked (one shrink for all three) and each B writes its own slice of the output:

    qkv output columns:  [ q: heads*d        | k: kv_heads*d | v: kv_heads*d ]
    shrink t = x A^T:    [ t_q: R | t_k: R | t_v: R ]
    expand:              y[:, q] += t_q B_q^T;  y[:, k] += t_k B_k^T;  y[:, v] += t_v B_v^T

A module the adapter does not target keeps zeros in its slot: its delta is zero.  (Phi-3
stores q/k/v and gate/up fused already, and peft adapts them as such: one sub-adapter each.)  The
shrink/expand run as PyTorch matmuls, or on CPUs where our kernels build as one C++ call
per linear (kernels/cpu_lora.cpp: every segment, shrink and expand in one pass).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.model.layers import Linear
from tokenloom.model.llama import ModelArgs

# peft's module name -> (the linear of ours it adapts, its sub-adapter index there)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
# Phi-3's checkpoints (and so peft's adapters of it) hold q/k/v and gate/up already fused:
# one sub-adapter each, over the whole output
FUSED_TARGETS: dict[str, tuple[str, int]] = {
    "qkv_proj": ("qkv", 0), "o_proj": ("o", 0), "gate_up_proj": ("gate_up", 0), "down_proj": ("down", 0),
}
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
LINEARS = ("qkv", "o", "gate_up", "down")  # each layer's linears a wrapper sees (model/llama.py `bind`)


def targets_for(a: ModelArgs) -> dict[str, tuple[str, int]]:
    """The peft modules an adapter of model `a` may adapt, and where each lands."""
    return FUSED_TARGETS if a.architecture in FUSED_ARCHITECTURES else TARGETS


@dataclass(frozen=True)
class LinearShape:
    """One linear's input width and the output columns each sub-adapter writes."""

    in_features: int
    subs: tuple[tuple[int, int], ...]

    @property
    def out_features(self) -> int:
        return self.subs[-1][1]


def linear_shapes(a: ModelArgs) -> dict[str, LinearShape]:
    """Each wrapped linear's shape for model `a` (the fused layouts of model/llama.py)."""
    q, kv, i, h = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size, a.hidden_size
    if a.architecture in FUSED_ARCHITECTURES:
        return {"qkv": LinearShape(h, ((0, q + 2 * kv),)), "o": LinearShape(q, ((0, h),)),
                "gate_up": LinearShape(h, ((0, 2 * i),)), "down": LinearShape(i, ((0, h),))}
    return {
        "qkv": LinearShape(h, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))),
        "o": LinearShape(q, ((0, h),)),
        "gate_up": LinearShape(h, ((0, i), (i, 2 * i))),
        "down": LinearShape(i, ((0, h),)),
    }


def module_shape(a: ModelArgs, module: str) -> tuple[int, int]:
    """(in, out) of peft's target `module` (q_proj, ..., down_proj) in model `a`."""
    linear, sub = targets_for(a)[module]
    shape = linear_shapes(a)[linear]
    lo, hi = shape.subs[sub]
    return shape.in_features, hi - lo


@dataclass
class LoRAAdapter:
    """One adapter's weights as our linears take them (model/weights/peft_lora.py reads them
    from peft's files): per layer, per peft module, A [r, in] and B [out, r] with the
    scaling already in B.  Held on the CPU; a slot gets a copy while the adapter runs."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)

    @property
    def modules(self) -> list[str]:
        """The peft modules it adapts (in any layer)."""
        return sorted({m for layer in self.layers for m in layer})


class LoRARows:
    """Which rows of this step run which slot: `segments` of (start, end, slot), rows
    start..end-1 on that slot's adapter, in row order; set by the runner before each
    forward (empty: every row on the base model).  `table`: the same as an int64 tensor
    [n, 3] for the C++ kernel."""

    __slots__ = ("segments", "table")

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.table: torch.Tensor | None = None

    def set(self, segments: list[tuple[int, int, int]]) -> None:
        self.segments = segments
        self.table = torch.tensor(segments, dtype=torch.int64) if segments else None


class LoRASlots:
    """`max_loras` adapters' weights on the device, allocated once, and which adapter holds
    which slot: adapters enter as steps need them and leave least recently used first."""

    def __init__(self, a: ModelArgs, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.shapes, self.targets = linear_shapes(a), targets_for(a)
        self.num_layers = a.num_layers
        # per layer, per linear: A [max_loras, n_sub * R, in], B^T [max_loras, R, out]
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {name: (torch.zeros(max_loras, len(s.subs) * max_rank, s.in_features, dtype=dtype, device=device),
                    torch.zeros(max_loras, max_rank, s.out_features, dtype=dtype, device=device))
             for name, s in self.shapes.items()}
            for _ in range(a.num_layers)]
        self.resident: OrderedDict[int, tuple[LoRAAdapter, int]] = OrderedDict()  # id -> (adapter, slot), LRU first
        self.free = list(range(max_loras))
        self.num_loads = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.weights for ab in layer.values() for t in ab)

    def assign(self, adapters: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Slots for the adapters a step runs (id -> adapter), loading those not resident
        into free slots or ones whose adapter this step does not use.  An id whose resident
        adapter is another object (unloaded, then loaded again from a new path) reloads."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step uses {len(adapters)} LoRA adapters, more than --max-loras {self.max_loras}")
        out: dict[int, int] = {}
        for lid, adapter in adapters.items():
            held = self.resident.get(lid)
            if held is not None and held[0] is adapter:
                self.resident.move_to_end(lid)
                out[lid] = held[1]
        for lid, adapter in adapters.items():
            if lid in out:
                continue
            if lid in self.resident:
                slot = self.resident.pop(lid)[1]
            elif self.free:
                slot = self.free.pop()
            else:  # the least recently used adapter this step does not run
                victim = next(v for v in self.resident if v not in adapters)
                slot = self.resident.pop(victim)[1]
            self._load(slot, adapter)
            self.resident[lid] = (adapter, slot)
            out[lid] = slot
        return out

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank {self.max_rank}")
        r, big = adapter.rank, self.max_rank
        for layer, mods in zip(self.weights, adapter.layers):
            for name, (a_all, b_all) in layer.items():
                a_all[slot].zero_()
                b_all[slot].zero_()
            for module, (a, b) in mods.items():
                linear, sub = self.targets[module]
                a_all, b_all = layer[linear]
                lo, hi = self.shapes[linear].subs[sub]
                a_all[slot, sub * big: sub * big + r].copy_(a)
                b_all[slot, :r, lo:hi].copy_(b.t())
        self.num_loads += 1


ApplyFn = Callable[..., None]  # (y, x, a, bt, subs, rank, rows) -> None: y += the rows' deltas


def apply_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                subs: tuple[tuple[int, int], ...], rank: int, rows: LoRARows) -> None:
    """Each segment's delta added to `y` with PyTorch matmuls: one shrink over all
    sub-adapters, one expand per sub-adapter (into its columns)."""
    for s, e, slot in rows.segments:
        t = torch.mm(x[s:e], a[slot].t())  # [n, n_sub * R]
        if len(subs) == 1:
            y[s:e].addmm_(t, bt[slot])
            continue
        bs = bt[slot]
        for i, (lo, hi) in enumerate(subs):
            y[s:e, lo:hi].addmm_(t[:, i * rank:(i + 1) * rank], bs[:, lo:hi])


def apply_for(name: str | None, device: torch.device, dtype: torch.dtype) -> ApplyFn:
    """The shrink/expand the backend plan named (`BackendPlan.lora`): "cpu" for our C++ op
    (kernels/cpu.py `lora_op`), else PyTorch's matmuls."""
    if name == "cpu":
        from tokenloom.kernels import cpu as cpu_kernels

        op = cpu_kernels.lora_op(device, dtype)
        if op is None:
            raise ValueError("the LoRA backend 'cpu' needs our CPU kernels built, on a CPU, in float32 or bfloat16")

        def apply_cpu(y, x, a, bt, subs, rank, rows) -> None:
            if y.stride(1) != 1 or y.dtype != x.dtype:  # an output the kernel does not take: PyTorch's
                apply_torch(y, x, a, bt, subs, rank, rows)
            else:
                op(y, x, a, bt, subs, rank, rows)

        return apply_cpu
    return apply_torch


class LoRALinear:
    """A layer's bound linear (model/layers.py `bound_linear`) plus, for the rows of the
    step's segments, their adapters' deltas.  With no segment it is the base linear and
    one attribute test."""

    __slots__ = ("base", "a", "bt", "subs", "rank", "rows", "apply")

    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, bt: torch.Tensor,
                 subs: tuple[tuple[int, int], ...], rank: int, rows: LoRARows, apply: ApplyFn):
        self.base, self.a, self.bt, self.subs, self.rank, self.rows, self.apply = base, a, bt, subs, rank, rows, apply

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.rows.segments:
            self.apply(y, x, self.a, self.bt, self.subs, self.rank, self.rows)
        return y


def lora_wrapper(slots: LoRASlots, rows: LoRARows,
                 apply: ApplyFn = apply_torch) -> Callable[[int, str, Linear], Linear]:
    """What `CausalLM.bind(..., wrap=)` takes: layer i's linear `name`, bound as the plan
    chose, becomes a `LoRALinear` over the slots' weights for it."""

    def wrap(layer: int, name: str, base: Linear) -> Linear:
        a, bt = slots.weights[layer][name]
        return LoRALinear(base, a, bt, slots.shapes[name].subs, slots.max_rank, rows, apply)

    return wrap
