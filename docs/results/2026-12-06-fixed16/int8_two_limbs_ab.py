import sys, os, torch, time, statistics
sys.path.insert(0, "/work/main/scripts")
from pathlib import Path
from bench_quant import prefilled, VARIANTS
batches = [int(b) for b in sys.argv[1].split(",")]
rounds = int(os.environ.get("ROUNDS", "16"))
for b in batches:
    llm = prefilled(Path("/tmp/tokenloom-bench-quant/qwen2.5-0.5b"), b, 128, 40, **VARIANTS["int8"])
    eng = llm.llm_engine
    for _ in range(3): eng.step()
    ops = eng.runner.graphs.lists[b]
    T = {"0": [], "1": []}
    with torch.inference_mode():
        for r in range(rounds):
            for m in (("0", "1") if r % 2 == 0 else ("1", "0")):
                os.environ["TL_I8L2"] = m
                ops.run()
                t0 = time.perf_counter(); ops.run(); ops.run(); T[m].append((time.perf_counter() - t0) / 2 * 1e3)
    print(f"batch {b}: int8 three limbs {statistics.median(T['0']):.2f} -> two {statistics.median(T['1']):.2f} ms", flush=True)
    del llm, eng, ops
