"""How many ops does one decode step's forward dispatch?  On a GPU each is (at least) one
kernel launch, and a small model's step there is bound by launching them (README, "On a
GPU": ~1,000 launches, ~14 ms per step on an H200).  Counted on any device, here with
PyTorch's generic path (our CPU kernels off), which is what `--device cuda` runs:

    TOKENLOOM_CPU_GEMM=onednn TOKENLOOM_CPU_FUSED=0 TOKENLOOM_CPU_ATTENTION=0 \\
        python scripts/count_step_ops.py --model DIR [--batch-size 8] [--dtype float32]

Counts every op that reaches the kernel level (a TorchDispatchMode sees ops after
autograd and composite decompositions) during the model's forward of one decode step,
leaving out views and no-op conversions, which launch nothing.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenloom import LLM, SamplingParams


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and no-op conversions launch nothing.  `aten.to` is declared as possibly
        # aliasing its input (it returns x itself when nothing changes), so ask what it did.
        if func.overloadpacket is torch.ops.aten.to:
            launches = out is not args[0]
        else:
            launches = not func.is_view
        if launches:
            self.ops[str(func.overloadpacket)] += 1
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    llm = LLM(a.model, dtype=a.dtype, max_model_len=256, num_kv_blocks=a.batch_size * 16 + 16)
    eng = llm.llm_engine
    for i in range(a.batch_size):
        eng.add_request(str(i), {"prompt_token_ids": [5 + i + j for j in range(16)]},
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()  # the prefills; the next step is decode only
    runner = eng.runner
    counter = _Count()
    forward = runner._forward

    def counted(*args, **kwargs):
        with counter:
            return forward(*args, **kwargs)

    runner._forward = counted
    eng.step()
    runner._forward = forward
    layers = len(runner.model.layers)
    total = sum(counter.ops.values())
    print(f"decode step at batch {a.batch_size}, {a.dtype}: {total} ops in the forward "
          f"({total / layers:.1f} per layer over {layers} layers)")
    for name, n in counter.ops.most_common(a.top):
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
