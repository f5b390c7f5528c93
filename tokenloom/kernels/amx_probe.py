"""Whether this machine runs AMX tile instructions: tried once, in a child process, and cached.

/proc/cpuinfo listing amx_tile does not mean a process may use the tiles: a VM may report the
flags without letting the guest enable the tile state, and the first tile instruction then
traps (SIGILL) and takes the process down.  So the verdict comes from running tiles: a child
Python process builds our AMX extension (kernels/cpu_gemm_amx.cpp), asks for tile permission
and runs one int8 and one bf16 tile multiply on known values (`tokenloom_amx::probe`).  Only a
child that exits cleanly with every check passed says yes; a crash, a refusal or a wrong
answer says no, and the caller goes on with the AVX-512 kernels.

The verdict is stored in the kernel cache (kernels/build.py `cache_root`), keyed by the CPU
model and the kernel source, so the child runs once per machine and kernel version.
`TOKENLOOM_AMX=0` turns AMX off without probing; `TOKENLOOM_AMX_PROBE_FAIL=1` makes the child
die as a trapping CPU would (for tests of that path).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tokenloom.kernels.build import cache_root
from tokenloom.kernels.cpu_probe import cpu_flags

SOURCE = Path(__file__).with_name("cpu_gemm_amx.cpp")
FLAGS = {"amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}

_CHILD = """
import os, signal, sys
if os.environ.get("TOKENLOOM_AMX_PROBE_FAIL") == "1":
    os.kill(os.getpid(), signal.SIGILL)
from tokenloom.kernels import amx
if not amx.build():
    sys.exit(3)
import torch
print("probe", *torch.ops.tokenloom_amx.probe().tolist())
"""


def cpu_model() -> str:
    """The CPU's model name (first 'model name' line of /proc/cpuinfo), '' where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def verdict_path() -> Path:
    """The cached verdict's file: one per CPU model and kernel source."""
    h = hashlib.sha256(cpu_model().encode() + b"\0" + SOURCE.read_bytes()).hexdigest()[:16]
    return cache_root() / f"amx_probe_{h}.json"


def run_probe(timeout: float = 900.0) -> tuple[bool, str]:
    """Run the child and judge it: (usable, why).  Never raises for a child that crashed."""
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"probe did not run: {e}"
    if r.returncode != 0:
        tail = (r.stderr or "").strip().splitlines()[-1:] or [""]
        return False, f"probe child exited with {r.returncode} {tail[0]}".strip()
    words = next((ln.split() for ln in r.stdout.splitlines() if ln.startswith("probe ")), [])
    if words[1:] != ["1", "1", "1"]:
        return False, f"probe answered {words[1:]} (permission, int8, bf16)"
    return True, "tile permission granted; int8 and bf16 tile multiplies correct"


def amx_usable() -> bool:
    """Whether our AMX kernels may run in this process (see the module doc)."""
    if os.environ.get("TOKENLOOM_AMX", "auto") == "0" or not FLAGS <= cpu_flags():
        return False
    return _verdict(os.environ.get("TOKENLOOM_AMX_PROBE_FAIL") == "1")


@functools.cache
def _verdict(forced_failure: bool) -> bool:
    """The probe's verdict, from the cache or a child run once per process."""
    path = verdict_path()
    if not forced_failure:
        try:
            return bool(json.loads(path.read_text())["usable"])
        except (OSError, ValueError, KeyError):
            pass
    usable, why = run_probe()
    if not forced_failure:  # a forced failure is not this machine's verdict
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"usable": usable, "why": why, "cpu": cpu_model()}))
    return usable
