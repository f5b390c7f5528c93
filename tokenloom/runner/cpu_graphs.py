"""CPU graphs for decode-only steps: the forward's op list recorded once per batch size and
replayed from C++ (kernels/cpu_graph.cpp), the CPU's counterpart of runner/cuda_graphs.py.

A batch-1 decode step of a small model on a CPU is a stream of weights and a few hundred
op calls around it.  Called from Python, each op costs microseconds of interpreter,
argument parsing and dispatch before its kernel starts: together a tenth of the step
(docs/performance.md, "CPU graphs").  The forward does the same ops every step of a batch
size; only the data changes.  So, as with CUDA graphs:

- the inputs live in the persistent buffers of `DecodeGraphs` (ids, positions, slots,
  lengths, block tables), refilled before each replay; the recorded ops read them in place;
- the second decode step of each batch size (the first runs plainly, so that nothing done
  once on first use is recorded) runs eagerly under `Recorder`, a dispatch mode
  that sees every op the forward calls (ours and PyTorch's), its arguments and its
  outputs; the op list it hands to C++ is replayed by every later step of that size;
- no padding: every batch size up to the largest gets its own list (a list is a few hundred
  small records; recording one costs one step), so a step computes no padded rows;
- a forward that reads data on the host (an op returning a Python number, or one whose
  output's shape depends on values) cannot be replayed: that size then runs eagerly, and
  the reason is logged once.  `.tolist()` and `.numpy()` read a tensor without the
  dispatcher, so no dispatch mode sees them: the backend plan (model/backends.py) turns CPU
  graphs off where the forward is known to read the host or vary (mixtures of experts pick
  experts with `.tolist()`, LoRA steps carry per-step adapter rows, tensor-parallel steps
  communicate).

Replays give the same results bit for bit as the eager forward: the same kernels run on
the same arguments in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenloom.model.attention import AttentionBackend
from tokenloom.runner.cuda_graphs import MAX_CAPTURE_SIZE, DecodeGraphs

log = logging.getLogger(__name__)

# Ops whose outputs depend on the data in a way a replay would not redo: shapes decided by
# values, or values read on the host.
_DATA_DEPENDENT = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::nonzero_static",
                   "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive", "aten::repeat_interleave")


class NotReplayable(Exception):
    """The forward did something a recorded op list cannot repeat."""


class Recorder(TorchDispatchMode):
    """Runs every op as it comes and records it: which op, its arguments (tensors an earlier
    recorded op produced become slots), and the slots its tensor outputs fill."""

    def __init__(self) -> None:
        super().__init__()
        self.slot_of: dict[int, int] = {}  # id(tensor) -> slot
        self.alive: list[torch.Tensor] = []  # every recorded output, so no id is reused while recording
        self.ops: list[tuple] = []  # (name, overload, args, patches, outputs)
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.problem is None:
            try:
                self._record(func, args, kwargs, out)
            except NotReplayable as e:
                self.problem = str(e)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        schema = func._schema
        if schema.name in _DATA_DEPENDENT:
            raise NotReplayable(f"{schema.name} reads data on the host")
        full = []
        for i, a in enumerate(schema.arguments):
            if i < len(args):
                v = args[i]
            elif a.name in kwargs:
                v = kwargs[a.name]
            else:
                v = a.default_value if a.has_default_value() else None
            full.append(list(v) if isinstance(v, tuple) else v)
        if schema.name == "aten::index" and any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                                                for t in full[1]):
            raise NotReplayable("a boolean mask index: its output's shape depends on the values")
        patches = []
        for i, v in enumerate(full):
            if isinstance(v, torch.Tensor):
                if id(v) in self.slot_of:
                    patches.append((i, -1, self.slot_of[id(v)]))
            elif isinstance(v, list):
                patches += [(i, j, self.slot_of[id(e)]) for j, e in enumerate(v)
                            if isinstance(e, torch.Tensor) and id(e) in self.slot_of]
        outputs = []
        for r in out if isinstance(out, (tuple, list)) else (out,):
            for t in r if isinstance(r, (tuple, list)) else (r,):
                if isinstance(t, torch.Tensor):
                    outputs.append(self._new_slot(t))
                elif t is None:
                    outputs.append(-1)
                else:
                    raise NotReplayable(f"{schema.name} returned a {type(t).__name__} to the host")
        self.ops.append((schema.name, schema.overload_name, full, patches, outputs))

    def _new_slot(self, t: torch.Tensor) -> int:
        slot = len(self.alive)
        self.alive.append(t)
        self.slot_of[id(t)] = slot
        return slot

    def op_list(self, result: torch.Tensor):
        """The recorded ops as the C++ op list, `result` its output; each slot released after
        its last reader."""
        from tokenloom.kernels.cpu import graph_op_list

        if self.problem is not None:
            raise NotReplayable(self.problem)
        if id(result) not in self.slot_of:
            raise NotReplayable("the forward's result is not an op's output")
        keep = self.slot_of[id(result)]
        last = {}  # slot -> the last op reading it (or making it, if none reads it)
        for i, (_, _, _, patches, outputs) in enumerate(self.ops):
            for s in outputs:
                if s >= 0:
                    last[s] = i
            for _, _, s in patches:
                last[s] = i
        release: list[list[int]] = [[] for _ in self.ops]
        for s, i in last.items():
            if s != keep:
                release[i].append(s)
        ops = graph_op_list()
        for (name, overload, full, patches, outputs), rel in zip(self.ops, release):
            try:
                ops.add(name, overload, full, [p[0] for p in patches], [p[1] for p in patches],
                        [p[2] for p in patches], outputs, rel)
            except RuntimeError as e:  # an argument the op list cannot hold
                raise NotReplayable(f"{name}: {e}") from e
        ops.set_result(keep)
        return ops


class CpuDecodeGraphs(DecodeGraphs):
    """The decode forward (model + logits) over `DecodeGraphs`' persistent buffers, recorded
    once per batch size (its second step) and replayed as a C++ op list after; every size up to
    `max_num_seqs` (at most 256) exactly, no padding."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, max_num_seqs: int, max_blocks: int, device: torch.device):
        super().__init__(model, kv_caches, backend, range(1, min(max_num_seqs, MAX_CAPTURE_SIZE) + 1), max_blocks,
                         device)
        self.lists: dict[int, object] = {}  # batch size -> its op list (kernels/cpu_graph.cpp)
        self.eager: dict[int, str] = {}  # batch sizes whose forward could not be recorded, and why
        self.seen: set[int] = set()  # batch sizes that ran a step

    def capture(self) -> None:
        """Nothing ahead: each size is recorded by its second step."""

    def describe(self) -> str:
        return f"CPU graphs for decode batches 1..{self.max_size}, each recorded by its second step"

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_ids: Sequence[Sequence[int]], device_ids: torch.Tensor | None = None,
            lens: Sequence[int] | None = None) -> torch.Tensor:
        n = len(ids)
        assert 0 < n <= self.max_size, f"{n} decodes exceed the largest size {self.max_size}"
        self.load(n, ids, positions, slots, block_ids, lens)
        if device_ids is not None:
            self.ids[:n].copy_(device_ids)
        ops = self.lists.get(n)
        if ops is not None:
            return ops.run()
        if n in self.eager or n not in self.seen:
            # a size's first step runs plainly: anything done once on first use (a lazy
            # initialisation that calls ops) is not recorded into every later step
            self.seen.add(n)
            return self.forward(n)
        recorder = Recorder()
        with recorder:
            logits = self.forward(n)
        try:
            self.lists[n] = recorder.op_list(logits)
        except NotReplayable as e:
            self.eager[n] = str(e)
            log.warning("decode steps of %d rows run eagerly: their forward cannot be replayed (%s)", n, e)
        return logits
