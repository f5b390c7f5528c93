"""llama.cpp built natively from a source tree, two ways, for scripts/bench_llamacpp.py --native.

* `noamx`: the features /proc/cpuinfo lists, AMX off (bench_llamacpp.cmake_args).
* `amx`: GGML_NATIVE=ON (-march=native: AMX tile/int8/bf16 where the CPU has them), built
  only where tokenloom's AMX probe (tokenloom/kernels/amx_probe.py, a child process running
  tile multiplies) says the tiles are usable.  gcc before 13 declares `_tile_loadconfig` as
  reading 8 bytes, so it drops the stores that fill ggml's tile configuration on the stack and
  the first tile load traps; with such a gcc the configuration is moved to static storage in
  the build's copy of the source (`patch_tile_config`) before compiling.

Each build gets llama-bench (batch 1: `-p 0 -n N`, tokens/s of one sequence),
llama-batched-bench (batch 16: `-npl 16`, the aggregate decode rate of 16 sequences) and
llama-quantize (Q8_0 / Q4_0 from the F32 GGUF).  Builds are cached in WORK/build-NAME.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

_TARGETS = ["llama-bench", "llama-batched-bench", "llama-quantize"]
_COMMON = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF"]
_STACK_CONFIG = re.compile(r"^(\s*)alignas\(64\) tile_config_t tc = \{\};", re.MULTILINE)


def gcc_needs_tile_fix() -> bool:
    """Whether the C++ compiler is gcc older than 13 (the 8-byte `_tile_loadconfig` declaration)."""
    try:
        banner = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True).stdout
        major = subprocess.run(["c++", "-dumpversion"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    if "Free Software Foundation" not in banner or "clang" in banner.lower():
        return False
    return int(major.strip().split(".")[0]) < 13


def patch_tile_config(src: Path) -> bool:
    """Keep ggml's AMX tile configuration in static (thread-local) storage; True if patched."""
    f = src / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    if not f.exists():
        return False
    text = f.read_text()
    new, n = _STACK_CONFIG.subn(r"\1alignas(64) static thread_local tile_config_t tc; tc = tile_config_t{};", text)
    if n:
        f.write_text(new)
    return n > 0 or "static thread_local tile_config_t tc" in text


def build(source: Path, work: Path, name: str, cmake_flags: list[str], fix_tiles: bool) -> Path:
    """Build `name` from a copy of `source` (patched where asked); the folder of its binaries."""
    tree = work / f"src-{name}"
    if not tree.exists():
        # Earlier build folders at the top and .git are left behind; cmake/build-info.cmake is not a build.
        shutil.copytree(source, tree, ignore=lambda d, names: [n for n in names if n == ".git" or (
            Path(d) == source and n.startswith("build") and (Path(d) / n).is_dir())])
    patched = patch_tile_config(tree) if fix_tiles else False
    out = work / f"build-{name}"
    bins = out / "bin"
    if all((bins / t).exists() for t in _TARGETS):
        return bins
    print(f"building llama.cpp {name} ({' '.join(cmake_flags)}; tile-config fix: {patched}); minutes", flush=True)
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), "-G", "Ninja", *_COMMON, *cmake_flags], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", *_TARGETS], check=True)
    return bins


def quantize(bins: Path, f32: Path, out: Path, ftype: str, pure: bool = False) -> None:
    """llama-quantize f32 -> out as `ftype`; `pure`: every tensor in that type (no mixed-bits rules)."""
    if not out.exists():
        subprocess.run([str(bins / "llama-quantize"), *(["--pure"] if pure else []), str(f32), str(out), ftype],
                       check=True, capture_output=True)


def batch1_ms(bins: Path, gguf: Path, threads: int, tokens: int, flash: bool) -> float:
    """llama-bench's mean time per generated token of one sequence, in ms."""
    r = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
                        "-fa", "1" if flash else "0", "-r", "1", "-o", "json"], capture_output=True, text=True,
                       check=True)
    rows = json.loads(r.stdout)
    return 1e3 / rows[0]["avg_ts"]


def batch_ms(bins: Path, gguf: Path, threads: int, batch: int, context: int, tokens: int, flash: bool) -> float:
    """llama-batched-bench's time per decode step of `batch` sequences (each past a `context`
    prompt), in ms: batch / its aggregate generation rate."""
    r = subprocess.run([str(bins / "llama-batched-bench"), "-m", str(gguf), "-c", str(batch * (context + tokens) + 64),
                        "-npp", str(context), "-ntg", str(tokens), "-npl", str(batch), "-t", str(threads),
                        "-fa", "on" if flash else "off", "--output-format", "jsonl"],
                       capture_output=True, text=True, check=True)
    row = next(json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{"))
    return batch * 1e3 / row["speed_tg"]
