import statistics, time, torch
from tokenloom.kernels import cpu, hugepages
cpu.avx512_enabled()
g = torch.Generator().manual_seed(0)
D, Hk, G, N, ctx, L = 64, 2, 7, 1, 3072, 96
nb = ctx // 16 + 1
def hp(shape):
    x = hugepages.zeros(shape, torch.bfloat16, torch.device("cpu")); x.copy_(torch.randn(shape, generator=g)); return x
caches = [(hp((nb + 50, 16, Hk, D)), hp((nb + 50, 16, Hk, D))) for _ in range(L)]
q = torch.randn(N, Hk * G, D, generator=g).bfloat16()
bt = torch.randperm(nb + 50, generator=g)[:nb].view(1, nb).long()
bt_seq = torch.arange(nb).view(1, nb).long()
cl = torch.full((N,), ctx).long()
op = torch.ops.tokenloom_avx512.paged_decode_attention
for th in (2, 1, 2, 1):
    torch.set_num_threads(th)
    for name, table in (("scattered", bt), ("sequential", bt_seq)):
        ts = []
        for r in range(5):
            t = time.perf_counter()
            for kc, vc in caches: op(q, kc, vc, table, cl, 0.125)
            ts.append((time.perf_counter() - t) / L * 1e6)
        print(f"threads {th} {name}: {statistics.median(ts):.1f} us a call")
