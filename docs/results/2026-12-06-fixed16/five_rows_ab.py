import sys, os, torch, time, statistics
sys.path.insert(0, "/work/main/scripts")
from pathlib import Path
from bench_quant import prefilled, VARIANTS
batches = [int(b) for b in sys.argv[1].split(",")]; variants = sys.argv[2].split(",")
rounds = int(os.environ.get("ROUNDS", "14"))
for b in batches:
    E = {}
    for v in variants:
        llm = prefilled(Path("/tmp/tokenloom-bench-quant/qwen2.5-0.5b"), b, 128, 40, **VARIANTS[v])
        eng = llm.llm_engine
        for _ in range(3): eng.step()
        E[v] = (llm, eng.runner.graphs.lists[b])
    T = {(v, m): [] for v in variants for m in ("0", "1")}
    with torch.inference_mode():
        for r in range(rounds):
            for v in variants:
                for m in (("0", "1") if r % 2 == 0 else ("1", "0")):
                    os.environ["TL_R6"] = m
                    ops = E[v][1]; ops.run()
                    t0 = time.perf_counter(); ops.run(); ops.run(); T[(v, m)].append((time.perf_counter() - t0) / 2 * 1e3)
    print(f"batch {b}: " + "  ".join(f"{v} {statistics.median(T[(v,'0')]):.2f} -> {statistics.median(T[(v,'1')]):.2f} ms" for v in variants), flush=True)
    del E
