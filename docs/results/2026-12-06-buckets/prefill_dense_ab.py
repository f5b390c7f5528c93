import torch, time, random, statistics
from tokenloom import LLM, SamplingParams
import tokenloom.model.attention as A
real = A.AttentionBackend.metadata
def sparse(self, *a, **k):
    m = real(self, *a, **k); m.prefill_dense = False; return m
llm = LLM(model="/tmp/tokenloom-bench-quant/qwen2.5-0.5b", dtype="bfloat16", max_num_batched_tokens=2048, enable_prefix_caching=False)
sp = SamplingParams(max_tokens=1, temperature=0)
rng = random.Random(0)
def run(n, L):
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(L)]} for _ in range(n)]
    t0 = time.perf_counter(); llm.generate(prompts, sampling_params=sp, use_tqdm=False); return time.perf_counter() - t0
for n, L in ((1, 2048), (8, 256)):
    run(n, L)
    T = {"gather": [], "view": []}
    for r in range(9):
        for name in T:
            A.AttentionBackend.metadata = sparse if name == "gather" else real
            T[name].append(run(n, L))
    A.AttentionBackend.metadata = real
    print(n, "x", L, {k: f"median {statistics.median(v)*1e3:.0f} min {min(v)*1e3:.0f} ms" for k, v in T.items()}, flush=True)
