"""How N data-parallel replicas split this machine: what each gets beyond the user's flags.

Policy only: it starts nothing.  `tokenloom serve --data-parallel-size N`
(`entrypoints/data_parallel.py`) starts its replicas with these placements, and the
simulator's validation (`sim/validate.py`) reads back the settings a measured replica ran
with, so both split the machine the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenloom.bundled import BUNDLED_MODEL_DIR
from tokenloom.config import CUDA_KV_SHARE_OF_FREE, default_kv_cache_bytes

logger = logging.getLogger("tokenloom.router")  # the name serve -dp's warnings have always carried

_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, ROCm's (torch.cuda on both)


@dataclass
class Placement:
    """What one replica gets beyond the user's flags: environment and extra flags."""

    env: dict[str, str]
    flags: list[str]


def placement(args: argparse.Namespace, n: int) -> list[Placement]:
    """Split the machine between `n` replicas.  CPU: `cores // n` threads each (unless
    --num-threads was given) and 1/n of the KV budget one engine would take.  CUDA: disjoint
    devices when there are enough; else they share one device and its free memory, 1/n each.
    A KV size the user gave (--kv-cache-memory, --num-kv-blocks) is left alone."""
    device = str(getattr(args, "device", "auto") or "auto")
    out = [Placement({}, []) for _ in range(n)]
    sized_by_user = args.kv_cache_memory is not None or args.num_kv_blocks is not None
    on_cuda = False
    # Without a GPU's device nodes there is no CUDA to find: spare the front a torch import.
    if device.startswith("cuda") or (device == "auto" and any(map(os.path.exists, _GPU_NODES))):
        import torch  # only to count devices (counting does not create a CUDA context)

        on_cuda = device.startswith("cuda") or torch.cuda.is_available()
    if not on_cuda:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = args.num_threads or max(1, cores // n)
        kv = [] if sized_by_user else ["--kv-cache-memory", str(default_kv_cache_bytes("cpu") // n)]
        for p in out:
            p.flags += ["--num-threads", str(threads), *kv]
        return out
    if args.num_threads:
        for p in out:
            p.flags += ["--num-threads", str(args.num_threads)]
    per = max(1, getattr(args, "tensor_parallel_size", 1) or 1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if device in ("auto", "cuda") and len(ids) >= n * per:
        for i, p in enumerate(out):
            p.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i * per:(i + 1) * per])
        return out
    logger.warning("%d replicas share %s (%d visible devices)", n, device, len(ids))
    if not sized_by_user:
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        share = int(_cuda_free_bytes(index) * CUDA_KV_SHARE_OF_FREE / n) - _weights_bytes(args.model)
        if share <= 0:
            raise RuntimeError(f"{n} replicas do not fit on {device}: give fewer, or --kv-cache-memory")
        for p in out:
            p.flags += ["--kv-cache-memory", str(share)]
    return out


def _cuda_free_bytes(index: int) -> int:
    """Free memory of CUDA device `index`, asked in a short-lived process so that the front
    holds no CUDA context (and its memory) for its whole life."""
    code = "import sys, torch; print(torch.cuda.mem_get_info(int(sys.argv[1]))[0])"
    done = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"cannot read the free memory of cuda:{index}: {done.stderr.strip()[-500:]}")
    return int(done.stdout.strip())


def _weights_bytes(model: str | None) -> int:
    """Size of a local model's weight files (0 for a hub id: not known before download)."""
    path = Path(model) if model else BUNDLED_MODEL_DIR
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
