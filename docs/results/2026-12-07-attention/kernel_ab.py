"""Previous source (HEAD's cpu_attention.cpp, AVX-512 build) vs the new AVX-512 and AVX512-BF16 builds, 24 layers' caches out of cache."""
import statistics, subprocess, sys, time, torch
from pathlib import Path
from tokenloom.kernels import cpu, build
cpu.avx512_enabled(); cpu.bf16_enabled()
K = Path(cpu.__file__).parent
d = Path("/tmp/attnv/old"); d.mkdir(exist_ok=True)
old = subprocess.run(["git", "-C", "/work/main", "show", "9963980:tokenloom/kernels/cpu_attention.cpp"], capture_output=True, text=True).stdout
(d / "cpu_attention.cpp").write_text(old.replace("tokenloom_avx512", "tokenloom_oldattn").replace("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY"))
for f in ("simd_avx2.h", "simd_avx512.h"): (d / f).write_text((K / f).read_text())
assert build._build("tokenloom_attn_old", [d / "cpu_attention.cpp"], ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"])
ops = {"old": torch.ops.tokenloom_oldattn.paged_decode_attention, "avx512": torch.ops.tokenloom_avx512.paged_decode_attention,
       "bf16": torch.ops.tokenloom_bf16.paged_decode_attention}
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
L = 24
out = {}
for D, Hk, G in ((64, 2, 7), (128, 8, 4)):
    for N, ctx in ((1, 128), (1, 512), (1, 3072), (16, 128), (16, 1024)):
        nb = ctx // 16 + 1
        caches = [(torch.randn(N * nb + 50, 16, Hk, D, generator=g).bfloat16(), torch.randn(N * nb + 50, 16, Hk, D, generator=g).bfloat16()) for _ in range(L)]
        q = torch.randn(N, Hk * G, D, generator=g).bfloat16()
        bt = torch.randperm(N * nb + 50, generator=g)[:N * nb].view(N, nb).long()
        cl = torch.full((N,), ctx).long()
        ref = ops["old"](q, *caches[0], bt, cl, D ** -0.5).float()
        res = {k: [] for k in ops}
        for r in range(7):
            for k, op in ops.items():
                assert torch.allclose(op(q, *caches[0], bt, cl, D ** -0.5).float(), ref, atol=1e-2)
                t = time.perf_counter()
                for kc, vc in caches: op(q, kc, vc, bt, cl, D ** -0.5)
                res[k].append((time.perf_counter() - t) / L * 1e6)
        med = {k: statistics.median(v) for k, v in res.items()}
        out[f"D{D} Hk{Hk} G{G} N{N} ctx{ctx}"] = med
        print(f"D={D} Hk={Hk} G={G} N={N} ctx={ctx}: old {med['old']:.1f}, avx512 {med['avx512']:.1f} ({med['old']/med['avx512']:.2f}x), bf16 {med['bf16']:.1f} us ({med['old']/med['bf16']:.2f}x)", flush=True)
import json; json.dump(out, open(sys.argv[1], "w"), indent=1)
