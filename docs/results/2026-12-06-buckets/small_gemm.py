import torch, time, statistics
from tokenloom.kernels import cpu, amx
cpu.load(); cpu.bf16_enabled(); amx.build()
torch.manual_seed(0)
res = []
for (k, n) in ((896, 1152), (896, 896)):
    w = cpu.pack_pairs(torch.randn(n, k).bfloat16())
    for M in (2, 8, 24):
        x = torch.randn(M, k).bfloat16()
        f = lambda: torch.ops.tokenloom_amx.linear_bf16(x, w, n, None)
        for _ in range(50): f()
        T = []
        for _ in range(3000):
            t0 = time.perf_counter(); f(); T.append(time.perf_counter() - t0)
        res.append(f"{k}x{n}/{M}: min {min(T)*1e6:.1f} p10 {sorted(T)[300]*1e6:.1f} us")
print(" | ".join(res))
