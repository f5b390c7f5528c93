import sys, shutil
from pathlib import Path
import torch
from tokenloom.kernels import cpu, build
K = Path(cpu.__file__).parent
def variant(name, edits):
    d = Path(f"/tmp/attnv/{name}"); d.mkdir(parents=True, exist_ok=True)
    for f in ["cpu_attention.cpp", "simd_avx2.h", "simd_avx512.h"]:
        t = (K / f).read_text()
        if f == "cpu_attention.cpp":
            for a, b in edits:
                assert a in t, a; t = t.replace(a, b)
            t = t.replace("tokenloom_bf16", f"tokenloom_{name}").replace("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY")
        (d / f).write_text(t)
    assert build._build(f"tokenloom_attn_{name}", [d / "cpu_attention.cpp"], ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"])
    return getattr(torch.ops, f"tokenloom_{name}").paged_decode_attention
