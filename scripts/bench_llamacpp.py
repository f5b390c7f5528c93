"""Decode step: llama.cpp (F32, BF16, Q8_0, Q4_0) against tokenloom (fp32, bf16, int8, int4), or
one GGUF file in both engines.

    python scripts/bench_llamacpp.py [--model DIR] [--context 128] [--rounds 5] [--steps 8]
                                     [--threads 2] [--work DIR] [--json OUT.json]
                                     [--llama-variants F32,BF16,Q8_0,Q4_0] [--ours fp32,bf16,int8,int4]
    python scripts/bench_llamacpp.py --same-gguf [Q4_0 | FILE.gguf] [--batch-sizes 1,16] [--pure] ...

Not part of CI and not imported by the tests. What it does, each step skipped when already done:

1. Installs llama.cpp's Python bindings if `import llama_cpp` fails: `pip install --target
   WORK/site llama-cpp-python` from its source distribution, which compiles llama.cpp with
   cmake (takes several minutes on two cores); CMAKE_ARGS names this CPU's features one by one,
   AMX off (`cmake_args`).  WORK/site, not the running environment, receives it (and the
   converter's sentencepiece), and goes on sys.path.
2. Converts the checkpoint to GGUF with llama.cpp's own converter (`convert_hf_to_gguf.py` from
   the bindings' source distribution, `vendor/llama.cpp`, fetched with `pip download`): F32 and
   BF16 directly, Q8_0 and Q4_0 with llama.cpp's quantizer (`llama_cpp.llama_model_quantize`,
   default settings unless --pure, from the F32 file). A checkpoint whose tokenizer the converter does not
   know (the random-weight `make-model` checkpoints have tokenloom's own BPE) is given the
   `qwen2` pre-tokenizer name; the benchmark feeds token ids, so that name changes nothing timed.
3. Loads every variant of both engines at once, prefills the same `context`-token prompt in
   each, then alternates rounds between them: in each round every variant decodes `steps`
   tokens greedily at batch 1 and its median per-token time is kept. llama.cpp's time is the
   `llama_decode` of one token (`Llama.eval`, prompt evaluation excluded); tokenloom's is a whole
   engine step (`eng.step()`: scheduling, model, sampling), as in scripts/bench_quant.py.
   Printed: the median over rounds per variant, side by side, and the ratios at equal bits;
   written to `--json`.

--native SRC builds llama.cpp's own binaries from the source tree SRC twice (scripts/llamacpp_native.py):
without AMX, and natively with AMX where tokenloom's AMX probe finds the tiles usable, with the
tile-configuration fix gcc < 13 needs (on a CPU without AMX the native build is still made, named
`native`: -march=native is llama.cpp's best build there); it times batch 1 (llama-bench) and batch 16
(llama-batched-bench, --batch-sizes), flash attention on and off (the faster kept), against
tokenloom at the same batch sizes, rounds alternating, and reports both builds (`--ours gguf-Q4_0`:
tokenloom loading the very GGUF file llama.cpp runs as Q4_0, issue 32's comparison); then each
step against this machine's read roof (its weights' bytes -- ours as loaded, llama.cpp's GGUF
file -- over a parallel read's rate, measured after the rounds) and its FLOP rate.

Without --model a random-weight Qwen2.5-0.5B-shaped checkpoint is made once (bf16,
`make-model`, as bench_quant.py does).

--same-gguf: one GGUF file, decoded by both engines -- tokenloom loading it itself
(model/weights/formats/gguf.py: Q4_0 and Q8_0 blocks kept in our int4 / grouped-int8 kernels;
activations and KV cache in bfloat16, `--gguf-dtype`), llama.cpp through its C API
(`llama_decode` of one batch holding one new token of each of B sequences, as continuous
batching feeds it; `LlamaBatchDecoder`).  The file is the checkpoint quantized by llama.cpp's
quantizer to the type named (default Q4_0: every matrix Q4_0 except the tied embedding /
output matrix, which llama.cpp keeps at more bits, Q8_0 where its rows are not whole 256-weight
super-blocks; `--pure`: that one Q4_0 too), or a .gguf path.  For each batch size
(--batch-sizes), both engines prefill B prompts of `context` tokens, then rounds alternate
between them; per round each decodes `steps` steps and keeps its median step.  Printed: the
median over rounds, tokens/s (B / step) and the ratio llama.cpp time / ours (above 1:
tokenloom faster).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quant  # noqa: E402  (scripts/bench_quant.py: checkpoint, prefilled engines, step timing)

_COMMON_CMAKE = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"
# /proc/cpuinfo flag -> ggml's cmake option, for an x86 build of what this CPU has.
_X86_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
                 "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
                 "avx512_bf16": "AVX512_BF16"}
OURS_TO_BITS = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0",  # equal bits per weight (about)
                "gguf-Q8_0": "Q8_0", "gguf-Q4_0": "Q4_0", "gguf-Q4_K_M": "Q4_K_M"}  # --native: the file llama.cpp runs


def cmake_args() -> str:
    """CMAKE_ARGS for a build tuned to this CPU.

    On x86 Linux the features /proc/cpuinfo lists are named one by one, with AMX always off:
    a VM may report AMX without letting processes use its tile registers, and the
    GGML_NATIVE=ON build (-march=native) then dies with an invalid opcode at its first
    `tilezero` (seen on the development VM with Q4_0/Q8_0 weights). Elsewhere: GGML_NATIVE=ON.
    """
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return f"-DGGML_NATIVE=ON {_COMMON_CMAKE}"
    on = " ".join(f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _X86_FEATURES.items())
    return f"-DGGML_NATIVE=OFF {on} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF {_COMMON_CMAKE}"


def site_dir(work: Path) -> Path:
    """Where the bindings and the converter's extra packages are installed: WORK/site (on
    sys.path from here on), never the running environment."""
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


def ensure_bindings(work: Path) -> None:
    """Import llama_cpp, building it from source with pip (into `site_dir`) first if it is missing."""
    site = site_dir(work)
    try:
        import llama_cpp  # noqa: F401
        return
    except ImportError as e:
        if e.name == "diskcache":  # built by an earlier run of this script that installed no dependencies
            subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(site), "--no-deps", "diskcache"],
                           check=True)
            import llama_cpp  # noqa: F401
            return
    env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS") or cmake_args(),
               CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2)))
    print(f"building llama-cpp-python from source (CMAKE_ARGS={env['CMAKE_ARGS']!r}); this takes minutes", flush=True)
    # --no-deps: its numpy and jinja2 are the environment's; diskcache, pure Python, goes beside it
    subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(site), "--no-deps", "--no-binary",
                    "llama-cpp-python", "llama-cpp-python==0.3.36", "diskcache"], env=env, check=True)
    import llama_cpp  # noqa: F401


def ensure_converter_deps(work: Path) -> None:
    """The converter imports sentencepiece (even for BPE tokenizers) and reads safetensors."""
    missing = [m for m in ("sentencepiece", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(site_dir(work)), *missing], check=True)


def llama_cpp_source(work: Path) -> Path:
    """vendor/llama.cpp of the installed bindings' own source distribution (converter and gguf-py)."""
    import llama_cpp

    version = llama_cpp.__version__
    root = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    sdist_dir = work / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(sdist_dir)], check=True)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and not m.name.startswith(prefix + "ggml/")
                   and m.name.count("/") >= 3 and (m.name == prefix + "convert_hf_to_gguf.py"
                                                   or m.name.split("/")[3] in ("gguf-py", "conversion"))]
        tar.extractall(work, members=members, filter="data")
    return root


# Runs the converter in a child process so that its vendored gguf package stays out of this one.
# Tokenizers it has no hash for get the "qwen2" pre-tokenizer name instead of an error.
_CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as conv
from conversion import base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        print("converter: unknown BPE pre-tokenizer, writing 'qwen2'", flush=True)
        return "qwen2"
base.TextModel.get_vocab_base_pre = _pre
# Without a tokenizer.model the converter falls back to the BPE vocabulary only on
# FileNotFoundError, after importing sentencepiece: say the file is missing first.
_sp = base.TextModel._set_vocab_sentencepiece
def _sp_or_missing(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return _sp(self, *a, **k)
base.TextModel._set_vocab_sentencepiece = _sp_or_missing
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
conv.main()
"""


def convert(model: Path, src: Path, out: Path, outtype: str, site: Path | None = None) -> None:
    """llama.cpp's converter on `model`; `site`: where `ensure_converter_deps` put its packages."""
    paths = (str(site) if site else None, os.environ.get("PYTHONPATH"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(model), "--outfile", str(out),
                    "--outtype", outtype], check=True, env=env)


def quantize(inp: Path, out: Path, ftype_name: str, threads: int, pure: bool) -> None:
    """llama.cpp's quantizer. By default it keeps some tensors at more bits (for Q4_0 the
    output / tied embedding matrix as Q6_K, or Q8_0 where a row is not a multiple of 256);
    `pure` stores every matrix in `ftype_name`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.pure = pure
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {inp} -> {ftype_name} failed with {rc}")


def gguf_files(model: Path, work: Path, variants: list[str], threads: int, pure: bool) -> dict[str, Path]:
    """GGUF file per llama.cpp variant, converted once per checkpoint directory."""
    src = llama_cpp_source(work)
    ensure_converter_deps(work)
    out_dir = work / "gguf" / model.resolve().name
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {v: out_dir / f"model-{v}{'-pure' if pure and v not in ('F32', 'BF16') else ''}.gguf" for v in variants}
    f32 = out_dir / "model-F32.gguf"
    for v in variants:
        if files[v].exists():
            continue
        if v in ("F32", "BF16"):
            convert(model, src, files[v], v.lower(), site_dir(work))
        else:  # quantized by llama.cpp's own quantizer, from full precision
            if not f32.exists():
                convert(model, src, f32, "f32", site_dir(work))
            quantize(f32, files[v], v, threads, pure)
        print(f"wrote {files[v]} ({files[v].stat().st_size / 1e6:.0f} MB)", flush=True)
    return files


class LlamaDecoder:
    """One llama.cpp model with a prefilled prompt, decoding greedily one token per call."""

    def __init__(self, path: Path, prompt: list[int], n_ctx: int, threads: int) -> None:
        import numpy as np
        from llama_cpp import Llama

        self._np = np
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.llm.eval(prompt)  # prompt evaluation: not timed
        self.next = self._argmax()
        self.decode_one()  # first decode warms up

    def _argmax(self) -> int:
        return int(self._np.argmax(self.llm.scores[self.llm.n_tokens - 1]))

    def decode_one(self) -> float:
        t0 = time.perf_counter()
        self.llm.eval([self.next])
        dt = time.perf_counter() - t0
        self.next = self._argmax()
        return dt

    def time_steps(self, steps: int) -> float:
        return statistics.median(self.decode_one() for _ in range(steps))


_QUIET = []


def _quiet_log():
    """A llama.cpp log callback that drops every line (kept alive here: C holds only its pointer)."""
    import llama_cpp as L

    if not _QUIET:
        _QUIET.append(L.llama_log_callback(lambda level, text, user_data: None))
    return _QUIET[0]


class LlamaBatchDecoder:
    """One llama.cpp context decoding `batch` sequences greedily, through the C API: each step is
    one `llama_decode` of a batch holding the next token of every sequence (the step timed), then
    each sequence's argmax (not timed).  Prompts are prefilled one sequence per call, untimed."""

    def __init__(self, path: Path, prompts: list[list[int]], n_ctx_seq: int, threads: int) -> None:
        import llama_cpp as L
        import numpy as np

        self.L, self._np, self.n = L, np, len(prompts)
        L.llama_log_set(_quiet_log(), ctypes.c_void_p(0))  # as Llama(verbose=False): no load chatter
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx_seq * self.n
        cp.n_batch = cp.n_ubatch = max(512, max(map(len, prompts)))
        cp.n_seq_max = self.n
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(cp.n_batch, 0, self.n)
        self.pos = [0] * self.n
        self.next = [0] * self.n
        for i, p in enumerate(prompts):
            self._fill([(i, t, j == len(p) - 1) for j, t in enumerate(p)])
            self._decode()
            self.next[i] = self._argmax(len(p) - 1)
        self.decode_one()  # the first batched step warms up

    def _fill(self, items: list[tuple[int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(items)
        for k, (seq, tok, logits) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, self.pos[seq], 1, logits
            b.seq_id[k][0] = seq
            self.pos[seq] += 1

    def _decode(self) -> None:
        rc = self.L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, k: int) -> int:
        logits = self._np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, k), shape=(self.vocab,))
        return int(logits.argmax())

    def decode_one(self) -> float:
        self._fill([(i, self.next[i], True) for i in range(self.n)])
        t0 = time.perf_counter()
        self._decode()
        dt = time.perf_counter() - t0
        self.next = [self._argmax(i) for i in range(self.n)]
        return dt

    def time_steps(self, steps: int) -> float:
        return statistics.median(self.decode_one() for _ in range(steps))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def same_gguf(path: Path, batches: list[int], context: int, rounds: int, steps: int, threads: int,
              dtype: str) -> dict:
    """One GGUF file in both engines, batch by batch, rounds alternating (see the module doc)."""
    import torch

    torch.set_num_threads(threads)
    total = rounds * steps + 8
    out: dict = {"gguf": str(path), "gguf_mb": path.stat().st_size / 1e6, "context": context, "rounds": rounds,
                 "steps": steps, "threads": threads, "tokenloom_dtype": dtype, "batches": {}}
    for b in batches:
        prompts = [[5 + (i * 7 + j * 13) % 3000 for j in range(context)] for i in range(b)]  # bench_quant.prefilled's
        theirs = LlamaBatchDecoder(path, prompts, context + total + 16, threads)
        ours = bench_quant.prefilled(path, b, context, total, dtype=dtype)
        times: dict[str, list[float]] = {"llama.cpp": [], "tokenloom": []}
        for r in range(rounds):
            time.sleep(0.05)
            times["llama.cpp"].append(theirs.time_steps(steps))
            time.sleep(0.05)
            times["tokenloom"].append(bench_quant.time_steps(ours, steps))
            print(f"batch {b} round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()),
                  flush=True)
        theirs.close()
        del ours
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out["batches"][str(b)] = {"median_ms": med, "rounds_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
                                  "tokens_per_s": {k: b / (v / 1e3) for k, v in med.items()},
                                  "llama_over_tokenloom": med["llama.cpp"] / med["tokenloom"]}
    return out


def print_same_gguf(res: dict) -> None:
    print(f"\n{res['gguf']} ({res['gguf_mb']:.0f} MB), context ~{res['context']}, {res['threads']} threads, "
          f"median decode step over {res['rounds']} alternating rounds of {res['steps']} steps")
    print("| batch | llama.cpp ms (tok/s) | tokenloom ms (tok/s) | llama.cpp / tokenloom |\n|---|---|---|---|")
    for b, r in res["batches"].items():
        m, tps = r["median_ms"], r["tokens_per_s"]
        print(f"| {b} | {m['llama.cpp']:.1f} ({tps['llama.cpp']:.0f}) | {m['tokenloom']:.1f} ({tps['tokenloom']:.0f}) "
              f"| {r['llama_over_tokenloom']:.2f}x |")
    print("(ratio > 1: tokenloom's step is faster)")


def run(model: Path, work: Path, llama_variants: list[str], ours: list[str], context: int, rounds: int,
        steps: int, threads: int, pure: bool = False) -> dict:
    import torch

    torch.set_num_threads(threads)
    files = gguf_files(model, work, llama_variants, threads, pure)
    prompt = [5 + (j * 13) % 3000 for j in range(context)]  # bench_quant.prefilled's first request
    total = rounds * steps + 8
    engines: dict[str, object] = {}
    for v in llama_variants:
        engines[f"llama.cpp {v}"] = LlamaDecoder(files[v], prompt, context + total + 16, threads)
    for v in ours:
        engines[f"tokenloom {v}"] = bench_quant.prefilled(model, 1, context, total, **bench_quant.VARIANTS[v])
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        for name, eng in engines.items():
            time.sleep(0.05)  # let the previous engine's worker threads stop spinning
            t = eng.time_steps(steps) if isinstance(eng, LlamaDecoder) else bench_quant.time_steps(eng, steps)
            times[name].append(t)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": str(model), "pure": pure, "context": context, "rounds": rounds, "steps": steps, "threads": threads,
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "rounds_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
            "gguf_mb": {v: files[v].stat().st_size / 1e6 for v in llama_variants}}


def run_native(model: Path, work: Path, source: Path, builds: list[str], llama_variants: list[str], ours: list[str],
               batches: list[int], context: int, rounds: int, steps: int, threads: int, pure: bool = False) -> dict:
    """--native: llama.cpp's own binaries from `source`, built each way in `builds` (llamacpp_native.py),
    against tokenloom at each batch size; rounds alternate between every engine.  llama.cpp's
    flash attention is timed on and off in the first round and the faster kept per variant."""
    import torch

    import llamacpp_native as nat

    torch.set_num_threads(threads)
    flags = {"noamx": ["-DGGML_NATIVE=OFF", *cmake_args().split()[1:]], "amx": ["-DGGML_NATIVE=ON"],
             "native": ["-DGGML_NATIVE=ON"]}
    from tokenloom.kernels import amx_probe
    from tokenloom.kernels.cpu_probe import cpu_flags

    bins = {}
    for b in builds:
        if b == "amx" and "amx_tile" not in cpu_flags():
            # No tiles at all (AMD, older Intel): -march=native is safe and is llama.cpp's best build here.
            print("no AMX on this CPU: building llama.cpp natively (-march=native) as 'native'", flush=True)
            b = "native"
        elif b == "amx" and not amx_probe.amx_usable():
            print("skipping the AMX build: tokenloom's probe found no usable AMX here", flush=True)
            continue
        bins[b] = nat.build(source, work, b, [f for f in flags[b] if "GGML_AMX" not in f or b == "noamx"],
                            fix_tiles=b == "amx" and nat.gcc_needs_tile_fix())
    out_dir = work / "gguf" / model.resolve().name
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {v: out_dir / f"model-{v}{'-pure' if pure and v not in ('F32', 'BF16') else ''}.gguf"
             for v in llama_variants}
    for v in llama_variants:
        if not files[v].exists():
            if v in ("F32", "BF16"):
                convert(model, source, files[v], v.lower())
            else:
                if not (out_dir / "model-F32.gguf").exists():
                    convert(model, source, out_dir / "model-F32.gguf", "f32")
                nat.quantize(next(iter(bins.values())), out_dir / "model-F32.gguf", files[v], v, pure)
    med: dict[str, float] = {}
    times_all: dict[str, list[float]] = {}
    flash: dict[str, bool] = {}
    weight_bytes: dict[str, int] = {f"llama.cpp {v}": files[v].stat().st_size for v in llama_variants}
    for batch in batches:
        total = rounds * steps + 8
        engines = {f"tokenloom {v} b{batch}": ours_engine(v, model, files, batch, context, total) for v in ours}
        for v in ours:  # what one step streams: the weights as stored (a tied embedding once, as the LM head)
            weight_bytes[f"tokenloom {v}"] = engines[f"tokenloom {v} b{batch}"].llm_engine.loaded.weight_bytes
        times: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(rounds):
            for name, eng in engines.items():
                times[name].append(bench_quant.time_steps(eng, steps) * 1e3)
            for b, bdir in bins.items():
                for v in llama_variants:
                    key = f"llama.cpp {b} {v} b{batch}"
                    def one(fa: bool) -> float:
                        if batch == 1:
                            return nat.batch1_ms(bdir, files[v], threads, steps * 4, fa)
                        return nat.batch_ms(bdir, files[v], threads, batch, context, steps * 4, fa)
                    if key not in flash:
                        on, off = one(True), one(False)
                        flash[key] = on < off
                        times.setdefault(key, []).append(min(on, off))
                    else:
                        times.setdefault(key, []).append(one(flash[key]))
            print(f"batch {batch} round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in times.items()),
                  flush=True)
        del engines
        med.update({k: statistics.median(v) for k, v in times.items()})
        times_all.update(times)
    from tokenloom.specs import microbench

    read_gbs = statistics.median(microbench.measure_bandwidth() for _ in range(3)) / 1e9
    from tokenloom.specs.model_spec import ModelSpec

    # for the FLOPs of a step: 2 per weight per token (a tied embedding once, as the LM head)
    params = ModelSpec.from_config(json.loads((model / "config.json").read_text())).active_params
    return {"model": str(model), "native": builds, "pure": pure, "context": context, "rounds": rounds,
            "steps": steps, "threads": threads, "batches": batches, "median_ms": med, "flash_attention": flash,
            "rounds_ms": times_all, "cpu": _cpu_name(), "weight_bytes": weight_bytes,
            "read_roof_gb_s": read_gbs, "params": params}


def ours_engine(variant: str, model: Path, files: dict[str, Path], batch: int, context: int, total: int):
    """tokenloom's engine for one --ours variant of a --native run, prefilled: a `bench_quant.VARIANTS`
    name (the checkpoint, quantized by us), or `gguf-TYPE` -- the GGUF file llama.cpp runs as TYPE
    (in --llama-variants), loaded by tokenloom itself (bf16 activations and KV cache): the same
    bytes in both engines, which is issue 32's comparison against llama.cpp's best build."""
    if variant.startswith("gguf-"):
        kind = variant.removeprefix("gguf-")
        if kind not in files:
            raise SystemExit(f"--ours {variant} needs {kind} in --llama-variants (the file both engines load)")
        return bench_quant.prefilled(files[kind], batch, context, total, dtype="bfloat16")
    return bench_quant.prefilled(model, batch, context, total, **bench_quant.VARIANTS[variant])


def _cpu_name() -> str:
    """This CPU's model name and whether tokenloom's probe found usable AMX tiles."""
    from tokenloom.kernels import amx_probe

    from tokenloom.specs.host import cpu_identity

    ident = cpu_identity()
    fam, mod = ident.get("cpu family", ""), ident.get("model", "")
    return f"{amx_probe.cpu_model()} (family {fam} model {mod}; AMX usable: {amx_probe.amx_usable()})"


def print_native_table(res: dict) -> None:
    med = res["median_ms"]
    for batch in res["batches"]:
        print(f"\nbatch {batch}, context ~{res['context']}, {res['threads']} threads: median ms per decode step")
        builds = [b for b in ("noamx", "native", "amx") if any(k.startswith(f"llama.cpp {b} ") for k in med)]
        print("| tokenloom | ms | " + " | ".join(f"llama.cpp {b} | ms | ratio" for b in builds) + " |")
        for ours, theirs in OURS_TO_BITS.items():
            a = med.get(f"tokenloom {ours} b{batch}")
            cells = []
            for b in builds:
                t = med.get(f"llama.cpp {b} {theirs} b{batch}")
                cells.append(f"{theirs} | {t and f'{t:.1f}' or '-'} | {f'{t / a:.2f}x' if a and t else ''}")
            print(f"| {ours} | {a and f'{a:.1f}' or '-'} | " + " | ".join(cells) + " |")
    print("(ratio = llama.cpp / tokenloom: > 1, tokenloom's step is faster)")
    roof, params = res.get("read_roof_gb_s"), res.get("params")
    if not roof:
        return
    print(f"\nEach step against the read roof ({roof:.1f} GB/s, measured after the rounds: a parallel read "
          f"beyond the caches) and its arithmetic rate ({params / 1e6:.0f} M weights, 2 FLOPs each per token):")
    print("| engine, variant | weights | at the roof | " + " | ".join(f"batch {b}: step, share of roof, GFLOP/s"
                                                                for b in res["batches"]) + " |")
    for name, nbytes in res["weight_bytes"].items():
        roof_ms = nbytes / roof / 1e6
        cells = []
        for b in res["batches"]:
            engine, variant = name.split()
            keys = [f"{name} b{b}"] if engine == "tokenloom" else [f"llama.cpp {bld} {variant} b{b}"
                                                                    for bld in ("noamx", "native", "amx")]
            ms = min((med[k] for k in keys if k in med), default=None)  # llama.cpp: its faster build
            cells.append(f"{ms:.1f} ms, {roof_ms / ms:.0%}, {2 * params * b / ms / 1e6:.0f}" if ms else "-")
        print(f"| {name} | {nbytes / 1e6:.0f} MB | {roof_ms:.1f} ms | " + " | ".join(cells) + " |")


def print_table(res: dict) -> None:
    med = res["median_ms"]
    print(f"\nbatch 1, context ~{res['context']}, {res['threads']} threads: median per-token decode over "
          f"{res['rounds']} alternating rounds of {res['steps']} tokens")
    print("| tokenloom | ms | llama.cpp | ms | llama.cpp / tokenloom |\n|---|---|---|---|---|")
    for ours, theirs in OURS_TO_BITS.items():
        a, b = med.get(f"tokenloom {ours}"), med.get(f"llama.cpp {theirs}")
        ratio = f"{b / a:.2f}x" if a and b else ""
        print(f"| {ours} | {a and f'{a:.1f}' or '-'} | {theirs} | {b and f'{b:.1f}' or '-'} | {ratio} |")
    print("(ratio > 1: tokenloom's step is faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format checkpoint directory (default: make-model qwen2.5-0.5b)")
    ap.add_argument("--work", default="/tmp/tokenloom-bench-llamacpp", help="sdist, converter and GGUF files")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-variants", default="F32,BF16,Q8_0,Q4_0")
    ap.add_argument("--ours", default="fp32,bf16,int8,int4")
    ap.add_argument("--pure", action="store_true", help="llama.cpp's quantizer keeps no tensor at more bits")
    ap.add_argument("--json", default=None, help="result file (default: WORK/result.json)")
    ap.add_argument("--same-gguf", default=None, metavar="TYPE|FILE",
                    help="one GGUF file in both engines: the checkpoint quantized to TYPE (e.g. Q4_0), or FILE.gguf")
    ap.add_argument("--gguf-dtype", default="bfloat16", help="with --same-gguf: tokenloom's --dtype")
    ap.add_argument("--native", default=None, metavar="LLAMA_CPP_SOURCE",
                    help="build llama.cpp's own binaries from this source tree (noamx and amx builds) "
                         "instead of the Python bindings; batch sizes from --batch-sizes")
    ap.add_argument("--builds", default="noamx,amx",
                    help="with --native: which builds (amx: -march=native; named 'native' on a CPU without AMX)")
    ap.add_argument("--batch-sizes", default="1,16", help="with --native or --same-gguf: decode batch sizes")
    a = ap.parse_args()
    if a.native:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        res = run_native(bench_quant.model_dir(a.model), work, Path(a.native), a.builds.split(","),
                         a.llama_variants.split(","), a.ours.split(","), [int(b) for b in a.batch_sizes.split(",")],
                         a.context, a.rounds, a.steps, a.threads, a.pure)
        print_native_table(res)
        out = Path(a.json) if a.json else work / "result-native.json"
        out.write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ensure_bindings(work)
    if a.same_gguf:
        if a.same_gguf.endswith(".gguf"):
            path = Path(a.same_gguf)
        else:
            path = gguf_files(bench_quant.model_dir(a.model), work, [a.same_gguf], a.threads, a.pure)[a.same_gguf]
        res = same_gguf(path, [int(b) for b in a.batch_sizes.split(",")], a.context, a.rounds, a.steps, a.threads,
                        a.gguf_dtype)
        print_same_gguf(res)
    else:
        res = run(bench_quant.model_dir(a.model), work, a.llama_variants.split(","), a.ours.split(","), a.context,
                  a.rounds, a.steps, a.threads, a.pure)
        print_table(res)
    out = Path(a.json) if a.json else work / "result.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
