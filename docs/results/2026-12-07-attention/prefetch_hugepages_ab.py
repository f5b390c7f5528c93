import statistics, subprocess, sys, time, torch
from pathlib import Path
sys.path.insert(0, "/tmp/attnv")
from build import variant
from tokenloom.kernels import cpu, build
cpu.avx512_enabled(); cpu.bf16_enabled()
# current source with the prefetch cut back to one block ahead into L1 (as before)
NEW = """  prefetch_block<_MM_HINT_T0>(k_cache, v_cache, table, b0, 1, ctx, bs, token_stride, row_bytes);
  prefetch_block<_MM_HINT_T1>(k_cache, v_cache, table, b0, 2, ctx, bs, token_stride, row_bytes);
  prefetch_block<_MM_HINT_T2>(k_cache, v_cache, table, b0, 4, ctx, bs, token_stride, row_bytes);"""
ONE = """  prefetch_block<_MM_HINT_T0>(k_cache, v_cache, table, b0, 1, ctx, bs, token_stride, row_bytes);"""
ops = {"bf16_pf1": variant("pf1", [(NEW, ONE)]), "bf16_pf124": torch.ops.tokenloom_bf16.paged_decode_attention,
       "avx512_pf124": torch.ops.tokenloom_avx512.paged_decode_attention}
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
L = int(sys.argv[1]) if len(sys.argv) > 1 else 96
for D, Hk, G, N, ctx in ((64, 2, 7, 1, 3072), (64, 2, 7, 16, 1024), (64, 2, 7, 1, 512)):
    nb = ctx // 16 + 1
    from tokenloom.kernels import hugepages
    def hp(shape):
        x = hugepages.zeros(shape, torch.bfloat16, torch.device("cpu")); x.copy_(torch.randn(shape, generator=g)); return x
    caches = [(hp((N * nb + 50, 16, Hk, D)), hp((N * nb + 50, 16, Hk, D))) for _ in range(L)]
    print("cache MB", sum(k.numel() * 4 for k, v in caches) / 1e6)
    q = torch.randn(N, Hk * G, D, generator=g).bfloat16()
    bt = torch.randperm(N * nb + 50, generator=g)[:N * nb].view(N, nb).long()
    cl = torch.full((N,), ctx).long()
    res = {k: [] for k in ops}
    for r in range(9):
        items = list(ops.items()) if r % 2 == 0 else list(ops.items())[::-1]
        for k, op in items:
            t = time.perf_counter()
            for kc, vc in caches: op(q, kc, vc, bt, cl, 0.125)
            res[k].append((time.perf_counter() - t) / L * 1e6)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"N={N} ctx={ctx}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + " us", flush=True)
