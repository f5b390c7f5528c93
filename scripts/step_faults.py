"""Page faults and kernel time per decode step: what kernels/glibc_heap.py is for.

    TOKENLOOM_GLIBC_HEAP=0|1 python scripts/step_faults.py [--model DIR] [--batch-size 32]
        [--temperature 1.0] [--steps 10]

Runs `batch-size` requests to steady decode, then times `steps` decode steps and reports the
median step, and the process's kernel (system) CPU time and minor page faults per step, from
getrusage.  With TOKENLOOM_GLIBC_HEAP=0 glibc keeps its default heap behaviour, under which
the step's large temporaries (logits, activations) may be mapped and unmapped every step;
run the two settings alternately, several times (the README's figures are three pairs).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from tokenloom import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/m/qwen2.5-0.5b")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    eng = LLM(model=a.model, dtype="float32").llm_engine
    for i in range(a.batch_size):
        eng.add_request(f"r{i}", "hello world " * 40,
                        SamplingParams(max_tokens=a.steps + 100, ignore_eos=True, temperature=a.temperature))
    for _ in range(4):  # prefill and a few decodes
        eng.step()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    n = a.steps
    print(f"TOKENLOOM_GLIBC_HEAP={os.environ.get('TOKENLOOM_GLIBC_HEAP', '1')} batch {a.batch_size} "
          f"temperature {a.temperature}: step median {statistics.median(times) * 1e3:.1f} ms, "
          f"kernel time {(r1.ru_stime - r0.ru_stime) / n * 1e3:.1f} ms/step, "
          f"user time {(r1.ru_utime - r0.ru_utime) / n * 1e3:.1f} ms/step, "
          f"minor faults {(r1.ru_minflt - r0.ru_minflt) / n:.0f}/step")


if __name__ == "__main__":
    main()
