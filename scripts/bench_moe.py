"""Mixture-of-experts decode on the CPU: a Qwen3-MoE-shaped model against a dense model with
the same active parameters, and the cost of its sparse layers against the experts a step touches.

    python scripts/bench_moe.py [--moe DIR] [--dense DIR] [--dtype bfloat16] [--quantization int8]
                                [--batches 1,16] [--block-batches 1,2,4,8,16] [--context 64]
                                [--rounds 5] [--steps 6] [--threads N] [--json FILE]

Without --moe / --dense, random-weight checkpoints of the presets `qwen3-moe-bench` (128
experts, 8 per token, hidden 1024, 6 layers) and `qwen3-dense-bench` (the same attention,
its MLP as wide as 8 experts) are written once under /tmp (`tokenloom make-model`).

1. Whole decode steps (`--batches`): for each batch size both engines are loaded with `batch`
   requests of a `context`-token prompt prefilled; rounds alternate between them, each timing
   `steps` decode steps (`eng.step()`: scheduling, model, sampling), so a noisy neighbour
   slows both alike.  Printed: the median step of each and MoE / dense.
2. The MLPs alone (`--block-batches`): every layer's bound MLP of each model (`LayerStep.mlp`:
   the MoE blocks, the dense SwiGLUs) on `batch` rows of random hidden states, every batch
   size and both models timed in the same alternating rounds -- so the step cost of the
   sparse layers can be set against the experts they ran (`MoEStep.record`; the uniform
   model E(1 - (1 - k/E)^B) beside it), which whole steps measured minutes apart on a shared
   machine cannot show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quant import prefilled, time_steps  # noqa: E402  (engines past prefill; a median decode step)
from tokenloom import LLM  # noqa: E402
from tokenloom.model.moe import MoEStep  # noqa: E402


def model_dir(arg: str | None, preset: str, dtype: str) -> Path:
    if arg:
        return Path(arg)
    from tokenloom.model.tools.make_model import make_model

    out = Path(f"/tmp/tokenloom-bench-moe/{preset}-{dtype}")
    if not (out / "config.json").exists():
        make_model(preset, out, dtype=dtype)
    return out


def moe_steps(llm: LLM) -> list[MoEStep]:
    return [s.mlp for s in llm.llm_engine.runner.model.steps if isinstance(s.mlp, MoEStep)]


def bench_steps(moe_path: Path, dense_path: Path, batches: list[int], args, kw: dict) -> list[dict]:
    rows = []
    for b in batches:
        total = args.rounds * args.steps + 2
        moe = prefilled(moe_path, b, args.context, total, **kw)
        dense = prefilled(dense_path, b, args.context, total, **kw)
        times: dict[str, list[float]] = {"moe": [], "dense": []}
        for _ in range(args.rounds):
            times["moe"].append(time_steps(moe, args.steps))
            times["dense"].append(time_steps(dense, args.steps))
        t_moe, t_dense = statistics.median(times["moe"]), statistics.median(times["dense"])
        rows.append(dict(batch=b, moe_step_ms=t_moe * 1e3, dense_step_ms=t_dense * 1e3, ratio=t_moe / t_dense,
                         moe_rounds_ms=[t * 1e3 for t in times["moe"]],
                         dense_rounds_ms=[t * 1e3 for t in times["dense"]]))
        print(f"steps, batch {b:3d}: MoE {t_moe * 1e3:7.2f} ms  dense {t_dense * 1e3:7.2f} ms  "
              f"ratio {t_moe / t_dense:5.2f}x", flush=True)
        del moe, dense
    return rows


def bench_blocks(moe_path: Path, dense_path: Path, batches: list[int], args, kw: dict, e: int, k: int) -> list[dict]:
    """Every layer's MLP of each model on `batch` rows, all batch sizes in the same rounds."""
    engines = {"moe": LLM(str(moe_path), max_model_len=128, num_kv_blocks=16, **kw),
               "dense": LLM(str(dense_path), max_model_len=128, num_kv_blocks=16, **kw)}
    mlps = {name: [s.mlp for s in llm.llm_engine.runner.model.steps] for name, llm in engines.items()}
    dtype = engines["moe"].llm_engine.loaded.dtype
    hidden = engines["moe"].llm_engine.loaded.args.hidden_size
    g = torch.Generator().manual_seed(0)
    hs = {b: torch.randn(b, hidden, generator=g).to(dtype) for b in batches}
    moe_layers = [m for m in mlps["moe"] if isinstance(m, MoEStep)]
    times = {(name, b): [] for name in mlps for b in batches}
    touched: dict[int, list[int]] = {b: [] for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            for name, layers in mlps.items():
                for m in moe_layers:
                    m.record = [] if name == "moe" else None
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    for m in layers:
                        m(hs[b])
                times[name, b].append((time.perf_counter() - t0) / args.steps)
                if name == "moe":
                    touched[b] += [n for m in moe_layers for n in m.record]
    rows = []
    for b in batches:
        t_moe, t_dense = (statistics.median(times[n, b]) for n in ("moe", "dense"))
        rows.append(dict(batch=b, moe_mlps_ms=t_moe * 1e3, dense_mlps_ms=t_dense * 1e3, moe_layers=len(moe_layers),
                         experts_touched=statistics.mean(touched[b]), experts_uniform=e * (1 - (1 - k / e) ** b)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe")
    ap.add_argument("--dense")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="int8 | int4 | int4-g128 (both models)")
    ap.add_argument("--batches", default="1,16", help="whole decode steps at these batch sizes ('' to skip)")
    ap.add_argument("--block-batches", default="1,2,4,8,16", help="the MLPs alone at these row counts")
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
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    steps = bench_steps(moe_path, dense_path, ints(args.batches), args, kw)
    blocks = bench_blocks(moe_path, dense_path, ints(args.block_batches), args, kw, e, k)
    what = f"{args.dtype}{', ' + args.quantization if args.quantization else ''}, {torch.get_num_threads()} threads"
    print(f"\n{moe_path.name} vs {dense_path.name} ({what}), median of {args.rounds} alternating rounds:")
    print(f"\nwhole decode steps ({args.steps} a round, context ~{args.context}):")
    print("| batch | MoE step ms | dense step ms | MoE / dense |")
    print("|---|---|---|---|")
    for r in steps:
        print(f"| {r['batch']} | {r['moe_step_ms']:.2f} | {r['dense_step_ms']:.2f} | {r['ratio']:.2f}x |")
    print("\nthe MLPs of all layers alone, every row count in the same rounds:")
    print("| rows | experts touched / layer (uniform model) | MoE MLPs ms | dense MLPs ms | MoE / dense "
          "| MoE vs 1 row | experts vs 1 row | MoE ms per expert touched |")
    print("|---|---|---|---|---|---|---|---|")
    b0 = blocks[0] if blocks else None
    for r in blocks:
        per = r["moe_mlps_ms"] / (r["experts_touched"] * r["moe_layers"])
        print(f"| {r['batch']} | {r['experts_touched']:.1f} ({r['experts_uniform']:.1f}) | {r['moe_mlps_ms']:.2f} | "
              f"{r['dense_mlps_ms']:.2f} | {r['moe_mlps_ms'] / r['dense_mlps_ms']:.2f}x | "
              f"{r['moe_mlps_ms'] / b0['moe_mlps_ms']:.2f}x | {r['experts_touched'] / b0['experts_touched']:.2f}x | "
              f"{per:.3f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(moe=str(moe_path), dense=str(dense_path), dtype=args.dtype,
                                                   threads=torch.get_num_threads(), quantization=args.quantization,
                                                   context=args.context, rounds=args.rounds, steps=args.steps,
                                                   whole_steps=steps, mlps=blocks), indent=2) + "\n")


if __name__ == "__main__":
    main()
