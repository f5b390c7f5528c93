"""Microbenchmarks: this machine's own roofline numbers (the `local` hardware).

The seed's decode-step arithmetic needs two rates -- how fast memory streams bytes and
how fast matmuls do FLOPs -- plus how long the framework takes just to *launch* the
step's many small ops.  Datasheets give the first two for GPUs; for the machine we are
actually on we measure all three:

* `measure_bandwidth()`   bytes read / time of one parallel read of a buffer several times
                          the last-level cache (our `stream_read` kernel on CPU, read the way
                          the decode GEMMs read their weights).  A decode step only *reads* its
                          weights, once per step, so this is the rate a memory-bound step can
                          hope for.  On GPUs it stays the copy below.
* `measure_copy_bandwidth()` large tensor copy, (bytes read + bytes written) / time -- the
                          STREAM "copy" convention; recorded for information.  Writes cost a
                          CPU more than reads (each written line is first read in, then
                          evicted), so on CPUs copy understates what a read-only stream gets.
* `measure_matmul_flops()` square matmul, 2*n^3 / time, sized up until one call takes long
                          enough to time reliably.
* `measure_step_overhead()` wall time of a sequence of trivial (1-element) torch ops.  In
                          eager PyTorch every op costs a fixed dispatch/launch time no matter
                          how small, so a step of k ops can never be faster than k times this.
                          `measure_op_overhead()` is the same divided by k; the cost model
                          multiplies it by the model's op count (`ModelSpec.eager_ops_per_step`).
                          Python-side engine work (scheduling, detokenizing) is *not* in it:
                          that is left to be read off measured engine steps.

Every figure is the median of several timed repeats after a warm-up.  `measure_local()`
bundles them and caches the result as JSON in `$TOKENLOOM_CACHE` (default
`~/.cache/tokenloom`), keyed by CPU/GPU model + torch threads + torch version, because
re-measuring on every `tokenloom estimate --hardware local` would cost seconds and add noise.
`bench roofline` uses these same functions; they take a `device` so they work on CUDA too.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from tokenloom.specs.host import cpu_model_name

MiB = 2**20
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CACHE_FILE = "microbench.json"
_CACHE_VERSION = 3  # bump when a measurement's method changes so old caches are ignored


# ---------------------------------------------------------------- timing helpers
def _sync(device: torch.device) -> None:
    # CUDA calls return before the work is done; without a sync we would time the launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    # Median, not min or mean: other processes share these cores, and one unlucky repeat
    # should neither win nor drag the figure.
    return statistics.median(times)


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


# ---------------------------------------------------------------- the measurements
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache, in bytes, from sysfs (cpu0's cache indexes); None if unreadable."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def default_buffer_bytes(device: str = "cpu") -> int:
    """The bandwidth tests' buffer: 1 GiB on GPU; on CPU max(1 GiB, 4 x the last-level cache),
    so DRAM, not the cache, is measured (this VM's L3 is 300 MB), but at most 1/8 of memory
    (the copy holds two such buffers)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return 1024 * MiB
    size = max(1024 * MiB, 4 * (last_level_cache_bytes() or 0))
    return min(size, _memory_bytes(device) // 8)


def _filled_buffer(n: int, dev: torch.device) -> torch.Tensor:
    """n float32 ones, on CPU in 2 MiB pages as the engine keeps its weights (kernels/hugepages.py):
    in 4 KiB pages a stream pays a TLB miss every 4 KiB, which the engine's weights do not.  Filled,
    not just allocated: untouched pages all map the one zero page, which stays in cache."""
    from tokenloom.kernels import hugepages

    return hugepages.empty(n, torch.float32, dev).fill_(1.0)


def measure_bandwidth(nbytes: int | None = None, repeats: int = 5, device: str = "cpu") -> float:
    """Memory read bandwidth in bytes/s: nbytes / (time of one read of an nbytes buffer).

    On CPU the read is our `stream_read` kernel (kernels/cpu_fused.cpp): every thread reads
    one contiguous run with 256-bit loads and prefetches ahead, as the one-row GEMMs stream
    weights, and adds the bytes up so the reads cannot be optimized away.  Where it cannot
    run, torch.mv over the buffer as a matrix (also read-only, and what a decode GEMV does).
    The default buffer (`default_buffer_bytes`, in 2 MiB pages) dwarfs the last-level cache.
    On GPU this is the copy rate (`measure_copy_bandwidth`), as before.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return measure_copy_bandwidth(nbytes, repeats, device)
    from tokenloom.kernels import cpu as cpu_kernels

    n = max(1, (nbytes if nbytes is not None else default_buffer_bytes(device)) // 4)
    buf = _filled_buffer(n, dev)
    if cpu_kernels.stream_read(buf[:1]) is not None:
        t = _median_time(lambda: cpu_kernels.stream_read(buf), dev, repeats)
        return n * 4 / t
    cols = min(n, 1024)
    mat = buf[: n // cols * cols].view(-1, cols)
    vec = torch.ones(cols, dtype=torch.float32, device=dev)
    t = _median_time(lambda: torch.mv(mat, vec), dev, repeats)
    return mat.numel() * 4 / t


def measure_copy_bandwidth(nbytes: int | None = None, repeats: int = 5, device: str = "cpu") -> float:
    """Copy bandwidth in bytes/s: 2 * nbytes / (time of one `dst.copy_(src)`).

    The STREAM "copy" convention: write-allocate traffic is not counted, so this is the rate
    software sees, not the bus maximum.  Buffers of `default_buffer_bytes` unless given.
    """
    dev = torch.device(device)
    n = max(1, (nbytes if nbytes is not None else default_buffer_bytes(device)) // 4)
    src = _filled_buffer(n, dev)
    dst = _filled_buffer(n, dev)
    t = _median_time(lambda: dst.copy_(src), dev, repeats)
    return 2 * n * 4 / t


def measure_matmul_flops(
    dtype: str | torch.dtype = "float32",
    repeats: int = 3,
    device: str = "cpu",
    n: int | None = None,
    min_time_s: float = 0.02,
    max_n: int | None = None,
) -> float:
    """Achieved dense matmul FLOP/s for `dtype`: 2*n^3 / time of an n x n @ n x n matmul.

    Without an explicit `n` the size doubles from 256 until one call takes `min_time_s`
    (or reaches `max_n`: 2048 on CPU, 8192 on GPU), so slow dtypes (bf16 on a CPU
    without native support) still finish quickly and fast ones are timed well above
    launch noise.
    """
    dev = torch.device(device)
    dt = _as_dtype(dtype)
    if max_n is None:
        max_n = 8192 if dev.type == "cuda" else 2048

    def make(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(size, size, generator=g).to(device=dev, dtype=dt)
        b = torch.randn(size, size, generator=g).to(device=dev, dtype=dt)
        return a, b

    if n is None:
        n = 256
        while True:
            a, b = make(n)
            t = _median_time(lambda: torch.matmul(a, b), dev, repeats=1)
            if t >= min_time_s or n >= max_n:
                break
            n *= 2
    a, b = make(n)
    t = _median_time(lambda: torch.matmul(a, b), dev, repeats)
    best = 2.0 * n**3 / t
    # The engine multiplies through oneDNN-packed weights or our own kernel where it can
    # (model/weights/packed_linear.py), either much faster than torch.matmul on some CPUs: the
    # machine's peak is the best of them.
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.packed_linear import PackedLinear, PanelLinear, packing_supported

    fast = []
    if packing_supported(dev, dt):
        fast.append(PackedLinear)
    if cpu_kernels.preferred(dev, dt):
        fast.append(PanelLinear)
    for make in fast:
        lin = make(b.t().contiguous(), None)
        t = _median_time(lambda: lin(a), dev, repeats)
        best = max(best, 2.0 * n**3 / t)
    return best


def measure_step_overhead(num_ops: int = 1000, repeats: int = 5, device: str = "cpu") -> float:
    """Seconds to dispatch a sequence of `num_ops` trivial ops (in-place add on 1 element).

    The data is one number, so the time is all fixed cost: Python -> ATen dispatch ->
    kernel (launch, on GPU).  This is the floor an eager-mode step of `num_ops` ops
    pays before moving a single weight.
    """
    dev = torch.device(device)
    x = torch.zeros(1, device=dev)

    def seq() -> None:
        for _ in range(num_ops):
            x.add_(1.0)

    return _median_time(seq, dev, repeats)


def measure_op_overhead(num_ops: int = 1000, repeats: int = 5, device: str = "cpu") -> float:
    """Seconds per dispatched trivial op (`measure_step_overhead(num_ops) / num_ops`)."""
    return measure_step_overhead(num_ops, repeats, device) / num_ops


# ---------------------------------------------------------------- cache + bundle
def cache_dir() -> Path:
    """`$TOKENLOOM_CACHE` if set, else `~/.cache/tokenloom`."""
    base = os.environ.get("TOKENLOOM_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "tokenloom"


def device_model(device: str = "cpu") -> str:
    """Human name of the processor that runs `device` (CPU model name or CUDA device name)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_model_name()


def cache_key(device: str = "cpu") -> str:
    """What the measurements depend on: processor, torch thread count, torch version."""
    return f"{device_model(device)}|device={torch.device(device).type}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _memory_bytes(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency, but the figure is not worth a crash
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == _CACHE_VERSION else {}


def measure_local(refresh: bool = False, device: str = "cpu") -> dict:
    """All local roofline figures as a dict, measured once per cache key and then cached.

    Keys: key, device_name, torch_threads, torch_version, measured_at, memory_bytes,
    mem_bandwidth (read, B/s: the roof), copy_bandwidth (copy, B/s: for information),
    matmul_flops {dtype: FLOP/s}, op_overhead_s.
    """
    key = cache_key(device)
    path = cache_dir() / _CACHE_FILE
    cache = _read_cache(path)
    entries = cache.get("entries", {})
    if not refresh and key in entries:
        return entries[key]
    record = {
        "key": key,
        "device_name": device_model(device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "memory_bytes": _memory_bytes(device),
        "mem_bandwidth": measure_bandwidth(device=device),
        "copy_bandwidth": measure_copy_bandwidth(device=device),
        "matmul_flops": {name: measure_matmul_flops(name, device=device) for name in _DTYPES},
        "op_overhead_s": measure_op_overhead(device=device),
    }
    entries[key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    # Write-then-rename so a concurrent reader never sees half a file.
    tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return record
