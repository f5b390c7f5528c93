"""Mixture-of-experts decode on the CPU: a Qwen3-MoE-shaped model against a dense model with
the same active parameters, and the step cost against the experts a step touches.

    python scripts/bench_moe.py [--moe DIR] [--dense DIR] [--dtype bfloat16] [--batches 1,2,4,8,16]
                                [--context 64] [--rounds 5] [--steps 6] [--quantization int8]
                                [--threads N] [--json FILE]

Without --moe / --dense, random-weight checkpoints of the presets `qwen3-moe-bench` (128
experts, 8 per token, hidden 1024, 6 layers) and `qwen3-dense-bench` (the same attention,
its MLP as wide as 8 experts) are written once under /tmp (`tokenloom make-model`).  For each
batch size both engines are loaded with `batch` requests of a `context`-token prompt
prefilled; then rounds alternate between them, each timing `steps` decode steps
(`eng.step()`: scheduling, model, sampling), so a noisy neighbour slows both alike.  Every
sparse layer of the MoE engine records how many experts each step ran (`MoEStep.record`).
Printed: per batch size, the median step time of each, their ratio, the experts touched per
sparse layer (measured, and E(1 - (1 - k/E)^B) under uniform routing) and the MoE step's
time per expert touched (docs/models.md, "Mixture of experts").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.model.moe import MoEStep


def model_dir(arg: str | None, preset: str, dtype: str) -> Path:
    if arg:
        return Path(arg)
    from tokenloom.model.tools.make_model import make_model

    out = Path(f"/tmp/tokenloom-bench-moe/{preset}-{dtype}")
    if not (out / "config.json").exists():
        make_model(preset, out, dtype=dtype)
    return out


def prefilled(path: Path, batch: int, context: int, total_steps: int, **kw) -> LLM:
    """An engine with `batch` requests of `context` prompt tokens each, all past prefill."""
    llm = LLM(str(path), max_model_len=context + total_steps + 16, max_num_seqs=batch,
              num_kv_blocks=batch * ((context + total_steps + 16) // 16 + 1) + 8, **kw)
    eng = llm.llm_engine
    for i in range(batch):
        ids = [5 + (i * 7 + j * 13) % 4000 for j in range(context)]
        eng.add_request(f"r{i}", {"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=total_steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()
    return llm


def time_steps(llm: LLM, steps: int) -> float:
    eng = llm.llm_engine
    t = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def moe_steps(llm: LLM) -> list[MoEStep]:
    return [s.mlp for s in llm.llm_engine.runner.model.steps if isinstance(s.mlp, MoEStep)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe")
    ap.add_argument("--dense")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="int8 | int4 | int4-g128 (both models)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (EngineArgs.num_threads)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    moe_path = model_dir(args.moe, "qwen3-moe-bench", args.dtype)
    dense_path = model_dir(args.dense, "qwen3-dense-bench", args.dtype)
    cfg = json.loads((moe_path / "config.json").read_text())
    e = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg["num_experts_per_tok"]
    kw = dict(dtype=args.dtype, quantization=args.quantization, num_threads=args.threads)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        total = args.rounds * args.steps + 2
        moe, dense = prefilled(moe_path, b, args.context, total, **kw), prefilled(dense_path, b, args.context, total, **kw)
        layers = moe_steps(moe)
        for s in layers:
            s.record = []
        times: dict[str, list[float]] = {"moe": [], "dense": []}
        for _ in range(args.rounds):
            times["moe"].append(time_steps(moe, args.steps))
            times["dense"].append(time_steps(dense, args.steps))
        touched = statistics.mean(n for s in layers for n in s.record)
        t_moe, t_dense = statistics.median(times["moe"]), statistics.median(times["dense"])
        rows.append(dict(batch=b, moe_step_ms=t_moe * 1e3, dense_step_ms=t_dense * 1e3, ratio=t_moe / t_dense,
                         experts_touched=touched, experts_uniform=e * (1 - (1 - k / e) ** b),
                         moe_rounds_ms=[t * 1e3 for t in times["moe"]],
                         dense_rounds_ms=[t * 1e3 for t in times["dense"]]))
        print(f"batch {b:3d}: MoE {t_moe * 1e3:7.2f} ms  dense {t_dense * 1e3:7.2f} ms  ratio {t_moe / t_dense:5.2f}x  "
              f"experts/layer {touched:6.1f} (uniform {rows[-1]['experts_uniform']:6.1f})", flush=True)
        del moe, dense
    base = rows[0]
    print(f"\n{moe_path.name} vs {dense_path.name} ({args.dtype}{', ' + args.quantization if args.quantization else ''}),"
          f" context ~{args.context}, {torch.get_num_threads()} threads, median of {args.rounds} alternating rounds"
          f" of {args.steps} decode steps:")
    print("| batch | experts touched / layer (uniform model) | MoE step ms | dense step ms | MoE / dense "
          "| MoE step vs batch 1 | experts vs batch 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['experts_touched']:.1f} ({r['experts_uniform']:.1f}) | {r['moe_step_ms']:.2f} | "
              f"{r['dense_step_ms']:.2f} | {r['ratio']:.2f}x | {r['moe_step_ms'] / base['moe_step_ms']:.2f}x | "
              f"{r['experts_touched'] / base['experts_touched']:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(moe=str(moe_path), dense=str(dense_path), dtype=args.dtype,
                                                   threads=torch.get_num_threads(),
                                                   quantization=args.quantization, context=args.context,
                                                   rounds=args.rounds, steps=args.steps, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
