"""In-process A/B of the quantized GEMM at many rows: the build of commit 3fa68d4 (its
cpu_gemm_quant.cpp with TOKENLOOM_QNS renamed tokenloom_q512v_old, beside that commit's
panel_linear.h and quant_vnni.h in /tmp/exp/ab/) against the current one, bf16 alongside.
Run from the repository: python docs/results/2026-12-05T09-quant/ab_two_builds.py 16,32,64 5"""
import statistics, sys, time, torch
from tokenloom.kernels import cpu as ck
from tokenloom.model.quantization import PanelQuantized, parse_scheme
avx512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi"]
assert ck._build("abold", ["/tmp/exp/ab/cpu_gemm_quant_old.cpp"], avx512)
old = torch.ops.tokenloom_q512v_old
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 24 + [(151936, 896)]
ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in shapes]
packed = [(ck.pack_for(w), w.shape[0], w.shape[1]) for w in ws]
bop = ck.linear_op(packed[0][0])
quant = {s: [PanelQuantized(w, parse_scheme(s)) for w in ws] for s in ("int8", "int4")}
del ws
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for m in [int(v) for v in sys.argv[1].split(",")]:
    xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (896, 4864)}
    fns = {"bf16": lambda: [bop(xs[k], p, n, None) for p, n, k in packed]}
    for s, mats in quant.items():
        fns[s] = lambda mats=mats: [q.matmul(xs[q.in_features], None) for q in mats]
        if s == "int8":
            fns[s + "-old"] = lambda mats=mats: [old.linear_int8(xs[q.in_features], q.qweight, q.scales, q.out_features, None) for q in mats]
        else:
            fns[s + "-old"] = lambda mats=mats: [old.linear_int4(xs[q.in_features], q.qweight, q.scales, q.out_features, q.scheme.group, None) for q in mats]
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter(); fn(); times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{m} rows, the step's 97 GEMMs, median of {rounds} alternating rounds (one process):")
    for k, t in med.items():
        print(f"  {k:9s} {t * 1e3:8.1f} ms  {med['bf16'] / t:5.2f}x vs bf16")
