"""CUDA graphs for decode-only steps: one replay instead of hundreds of kernel launches.

A decode step of a small model is a few hundred small kernels; launched one by one from
Python, the host is the bottleneck (the GPU waits for the next launch).  A CUDA graph
records the whole forward once per batch size and replays it with one call.  A graph
replays fixed addresses and fixed shapes, so:

- inputs live in persistent device buffers, refilled before each replay with one
  host-to-device copy from a pinned staging buffer:

      staging (int64): | ids[M] | positions[M] | slots[M] | lengths[M] | block tables [M, W] |
                         M = the largest captured batch, W = blocks of a max_model_len request

- a batch of n requests replays the graph of the smallest captured size b >= n; rows n..b
  are padding: token 0, slot -1 (the KV write skips it) and length 0 (attention reads
  nothing and writes zeros), so padding never touches the cache or the real rows;
- capture sizes are 1, 2, 4, 8 and then every 8 up to max_num_seqs (at most 256),
  largest first, all into one shared memory pool; a larger batch runs eagerly;
- nothing in the captured forward may synchronise with the host (no `.item()`, no
  data-dependent shapes): the attention backend must be `triton`.

On a CPU (tests) the same padded forward runs eagerly, so the padding logic is tested
without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tokenloom.model.attention import AttentionBackend

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... : every size up to the first that holds max_num_seqs (<= 256)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for s in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(s)
        if s >= top:
            break
    return sizes


class DecodeGraphs:
    """The decode forward (model + logits) over persistent, padded input buffers; captured
    as one CUDA graph per batch size on a GPU, run eagerly elsewhere."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, sizes: Sequence[int], max_blocks: int, device: torch.device):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = sorted(sizes)
        self.device = device
        m, w = self.sizes[-1], max_blocks
        self.max_size, self.width = m, w
        cuda = device.type == "cuda"
        self._host = torch.zeros(4 * m + m * w, dtype=torch.int64, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=device) if cuda else self._host
        d = self._dev
        self.ids, self.positions, self.slots, self.lens = d[:m], d[m:2 * m], d[2 * m:3 * m], d[3 * m:4 * m]
        self.tables = d[4 * m:].view(m, w)
        self._copied = torch.cuda.Event() if cuda else None
        self._logits = (torch.empty((m, model.args.vocab_size), dtype=torch.float32, device=device)
                        if cuda else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def describe(self) -> str:
        """The graphs in words, for the start-up summary."""
        return (f"CUDA graphs for decode batches {self.sizes[0]}..{self.sizes[-1]} ({len(self.graphs)} captured in "
                f"{self.capture_seconds:.1f} s, {self.graph_memory_bytes / 2**20:.0f} MiB)")

    def size_for(self, n: int) -> int | None:
        """The smallest captured size that holds n rows, or None (run eagerly)."""
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def forward(self, b: int) -> torch.Tensor:
        """Logits [b, vocab] of the first b buffer rows: what a graph records."""
        meta = self.backend.decode_metadata(self.slots[:b], self.tables[:b], self.lens[:b])
        hidden = self.model(self.ids[:b], self.positions[:b], self.kv_caches, meta)
        # In the head's dtype: a greedy step's argmax reads them so (runner/sampler.py), and
        # the float32 buffer below converts them as it copies.
        logits = self.model.compute_logits(hidden, float32=False)
        if self._logits is None:
            return logits
        # Every graph's output in one buffer: each size's logits would otherwise stay
        # allocated in the pool, one [b, vocab] float32 tensor per captured size.
        out = self._logits[:b]
        out.copy_(logits)
        return out

    def load(self, b: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             block_ids: Sequence[Sequence[int]], lens: Sequence[int] | None = None) -> None:
        """Fill rows 0..n-1 with a step's decodes and rows n..b-1 with padding, in one copy.
        `lens`: the tokens each row attends to, its own included; positions + 1 when not given,
        which holds unless a position carries a rotary table's offset (LongRoPE's long rows,
        model/layers.py `RotaryEmbedding`)."""
        n, m, w = len(ids), self.max_size, self.width
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the staging buffer
        h = self._host_np
        h[0:n] = ids
        h[n:b] = 0
        h[m:m + n] = positions
        h[m + n:m + b] = 0
        h[2 * m:2 * m + n] = slots
        h[2 * m + n:2 * m + b] = -1  # padding writes nothing
        h[3 * m:3 * m + n] = [p + 1 for p in positions] if lens is None else lens
        h[3 * m + n:3 * m + b] = 0  # padding attends to nothing
        tables = h[4 * m:4 * m + b * w].reshape(b, w)
        for i, row in enumerate(block_ids):
            tables[i, :len(row)] = row
        if self._dev is not self._host:
            end = 4 * m + b * w
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            self._copied.record()

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_ids: Sequence[Sequence[int]], device_ids: torch.Tensor | None = None,
            lens: Sequence[int] | None = None) -> torch.Tensor:
        """Logits [n, vocab] of n decodes (n <= the largest size): a graph replay where one
        was captured, the same padded forward eagerly otherwise.  `device_ids`: the ids as a
        tensor on the device (async scheduling: the previous step's sampled tokens), copied
        into the graph's input after the host's staging copy, in stream order.  `lens`: as
        `load`'s."""
        n = len(ids)
        b = self.size_for(n)
        assert b is not None, f"{n} decodes exceed the largest captured size {self.max_size}"
        self.load(b, ids, positions, slots, block_ids, lens)
        if device_ids is not None:
            self.ids[:n].copy_(device_ids)
        g = self.graphs.get(b)
        if g is None:
            return self.forward(b)[:n]
        g.replay()
        return self.outputs[b][:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, into one memory pool.  Each size runs
        once before its capture (Triton compiles, cuBLAS picks its kernels) over rows of
        length 1 whose K/V writes are skipped, so the cache is untouched."""
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for b in reversed(self.sizes):
            self.load(b, [0] * b, [0] * b, [-1] * b, [[0]] * b)
            self.forward(b)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self.forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d CUDA graphs for decode batches of %d..%d in %.1f s, %.0f MiB",
                 len(self.graphs), self.sizes[0], self.sizes[-1], self.capture_seconds,
                 self.graph_memory_bytes / 2**20)
