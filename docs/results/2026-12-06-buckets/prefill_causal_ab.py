import torch, time, random, statistics
from tokenloom import LLM, SamplingParams
import tokenloom.model.attention as A
real = A._causal_from_zero
llm = LLM(model="/tmp/tokenloom-bench-quant/qwen2.5-0.5b", dtype="bfloat16", max_num_batched_tokens=2048, enable_prefix_caching=False)
sp = SamplingParams(max_tokens=1, temperature=0)
rng = random.Random(0)
def run(n, L):
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(L)]} for _ in range(n)]
    t0 = time.perf_counter(); out = llm.generate(prompts, sampling_params=sp, use_tqdm=False); return time.perf_counter() - t0, out
for n, L in ((8, 256), (1, 2048), (2, 1000)):
    run(n, L)
    T = {"mask": [], "causal": []}
    for r in range(9):
        for name in ("mask", "causal"):
            A._causal_from_zero = (lambda m, k: False) if name == "mask" else real
            T[name].append(run(n, L)[0])
    A._causal_from_zero = real
    print(n, "x", L, {k: f"median {statistics.median(v)*1e3:.0f} min {min(v)*1e3:.0f} ms" for k, v in T.items()}, flush=True)
