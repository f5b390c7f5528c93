"""Where does one decode step's time go?  Profile N decode steps at batch B.

    python scripts/profile_step.py --model DIR --batch-size 32 [--steps 3] [--context 64] [--dtype bfloat16]
                                   [--quantization int4]

Groups the torch profiler's self-CPU time into matmuls, attention (KV write, block
gather, SDPA or our paged kernel), other model ops (norms, rotary, activation, embedding), and the engine
outside the model (scheduling, input preparation, sampling, detokenizing) from the
step events.  Used for the before/after profile in the README.
"""

from __future__ import annotations

import argparse
import statistics

from torch.profiler import ProfilerActivity, profile

from tokenloom import LLM, SamplingParams

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::matmul", "aten::bmm",
               "tokenloom_cpu::linear", "tokenloom_avx512::linear", "tokenloom_bf16::linear", "tokenloom_bf16::linear_fma",
               *(f"{ns}::linear_{b}" for ns in ("tokenloom_q512v", "tokenloom_q512", "tokenloom_q256") for b in ("int8", "int4"))),
    "attention": ("aten::index", "aten::index_copy_", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_efficient_attention",
                  "aten::_scaled_dot_product_flash_attention", "tokenloom_cpu::paged_decode_attention",
                  "tokenloom_avx512::paged_decode_attention"),
}


def step_once(eng) -> None:
    try:
        eng.step(finished_only=True)
    except TypeError:  # older engines (the "before" profile) have no finished_only
        eng.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="int8, int4 or int4-g128 (docs/quantization.md)")
    ap.add_argument("--top", type=int, default=10, help="ops to list")
    a = ap.parse_args()
    events = []
    llm = LLM(a.model, dtype=a.dtype, quantization=a.quantization, max_model_len=1024, num_kv_blocks=(a.batch_size * 512) // 16 + 64,
              observers=[events.append])
    eng = llm.llm_engine
    for i in range(a.batch_size):
        ids = [5 + (i * 7 + j) % 3000 for j in range(a.context)]
        eng.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while not (events and len(events[-1].entries) == a.batch_size and all(e.phase == "decode" for e in events[-1].entries)):
        step_once(eng)
    step_once(eng)
    events.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step_once(eng)
    step = statistics.mean(e.duration for e in events)
    model = statistics.mean(e.forward_time for e in events)
    totals = {"matmul": 0.0, "attention": 0.0, "other model ops": 0.0}
    for ev in prof.key_averages():
        t = ev.self_cpu_time_total / 1e6 / a.steps
        for g, names in GROUPS.items():
            if ev.key in names:
                totals[g] += t
                break
        else:
            if ev.key.startswith(("aten::", "mkldnn::", "tokenloom_cpu::")):
                totals["other model ops"] += t
    # the profiler's op times include some engine-side tensor work; scale them to the model time
    scale = model / max(sum(totals.values()), 1e-9)
    print(f"decode step at batch {a.batch_size}, context ~{a.context}: {step * 1e3:.1f} ms "
          f"(model {model * 1e3:.1f} ms, engine outside the model {(step - model) * 1e3:.2f} ms)")
    for g, t in totals.items():
        print(f"  {g:16s} {t * scale * 1e3:8.1f} ms  {100 * t * scale / step:5.1f}%")
    print(f"  {'engine overhead':16s} {(step - model) * 1e3:8.2f} ms  {100 * (step - model) / step:5.1f}%")
    print("top ops by self CPU time per step (unscaled):")
    for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:a.top]:
        print(f"  {ev.key:48s} {ev.self_cpu_time_total / 1e3 / a.steps:8.2f} ms  x{ev.count // a.steps}")


if __name__ == "__main__":
    main()
