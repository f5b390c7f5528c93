"""What serving LoRA adapters costs: a decode batch spread over several adapters against the
same batch on the base model, in one engine, in one run.

    python scripts/bench_lora.py              # Qwen2.5-0.5B shape, bf16, batch 16, 4 adapters, rank 16
    python scripts/bench_lora.py --backends cpu torch --rounds 8 --num-threads 1   # C++ and PyTorch side by side
    python scripts/bench_lora.py --model /path/to/hf-dir --out docs/results/lora/run.json

The base model is a random-weight copy of the preset's shape (`tokenloom make-model`), the
adapters random peft-format directories (adapter_config.json + adapter_model.safetensors,
every projection of every layer adapted, rank --rank): costs depend on shapes, not values.
One engine per LoRA backend is loaded once, with --enable-lora and --max-loras = --adapters;
each round runs, in alternating order, the same --batch prompts (fresh random token ids
every round, so the prefix cache never helps) on the base model, and spread round-robin
over the adapters.  The figures are the median, over rounds, of the median model time of the
round's decode steps that ran the whole batch (StepEvent.forward_time: forward pass +
logits, no scheduling or sampling), the ratio adapters / base of those, and the median of the
round-by-round ratios (the two cases of a round run back to back); tokens/s of the whole
generate call (scheduling, sampling and the runner's per-step adapter bookkeeping included)
beside it.  A run of the base workload on an engine without --enable-lora is the reference
for "enabled but unused".  First, one linear's deltas alone, C++ against PyTorch, per linear
shape of a layer (`time_deltas`).  On a shared machine pass --num-threads 1: a parallel
region waits for its slowest thread, and a descheduled one turns the timings into noise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.model.tools.make_model import make_model
from tokenloom.model.tools.presets import get_preset

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-family config."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(out: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A random rank-`rank` LoRA adapter on every projection, in peft's file format."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for block, mods in MODULES.items():
            for m in mods:
                fan_in, fan_out = shapes[m]
                key = f"base_model.model.model.layers.{layer}.{block}.{m}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).contiguous()
                tensors[f"{key}.lora_B.weight"] = (0.01 * torch.randn(fan_out, rank, generator=g)).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [m for mods in MODULES.values() for m in mods], "use_rslora": False, "use_dora": False,
        "task_type": "CAUSAL_LM"}))
    return out


def timed_round(llm: LLM, prompts: list[list[int]], loras, tokens: int) -> dict:
    """One batch to completion; the model time of each decode step that ran all of it."""
    events = []
    llm.llm_engine.add_observer(events.append)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    llm.llm_engine.remove_observer(events.append)
    steps = [e.forward_time for e in events
             if len(e.entries) == len(prompts) and all(x.phase == "decode" for x in e.entries)]
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return {"decode_step_s": statistics.median(steps), "decode_steps": len(steps),
            "tokens_per_s": len(prompts) * tokens / wall}


def time_deltas(cfg: dict, dtype: torch.dtype, batch: int, adapters: int, rank: int, calls: int = 200) -> dict:
    """Microseconds per call (median and minimum) of one linear's LoRA deltas alone (no base
    matmul), our C++ op against PyTorch's matmuls, for each of a layer's four linears: `batch` rows in `adapters`
    equal segments, the slot layout model/lora.py allocates."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.hf_config import model_args_fields
    from tokenloom.model.llama import ModelArgs
    from tokenloom.model.lora import LoRARows, apply_torch, linear_shapes
    from tokenloom.model.registry import resolve_architecture

    a = ModelArgs(**model_args_fields(cfg, resolve_architecture(cfg)))
    fns = {"torch": apply_torch}
    if cpu_kernels.lora_op(torch.device("cpu"), dtype) is not None:
        fns["cpu"] = cpu_kernels.apply_lora
    rows = LoRARows()
    per = batch // adapters
    rows.set([(k * per, (k + 1) * per if k < adapters - 1 else batch, k) for k in range(adapters)])
    out: dict[str, dict[str, float]] = {}
    for name, shape in linear_shapes(a).items():
        A = torch.randn(adapters, len(shape.subs) * rank, shape.in_features).to(dtype) / shape.in_features ** 0.5
        bt = (0.01 * torch.randn(adapters, rank, shape.out_features)).to(dtype)
        x = torch.randn(batch, shape.in_features).to(dtype)
        y = torch.zeros(batch, shape.out_features, dtype=dtype)
        for fn_name, fn in fns.items():
            times = []
            for i in range(calls + 20):
                t0 = time.perf_counter()
                fn(y, x, A, bt, shape.subs, rank, rows)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            # the minimum as well: on a shared machine most calls of a few microseconds are preempted
            out.setdefault(name, {})[fn_name] = {"median_us": 1e6 * statistics.median(times),
                                                 "min_us": 1e6 * min(times)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: a random-weight --preset)")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["auto"], choices=["auto", "cpu", "torch"],
                    help="LoRA backends to time (cpu: our C++ op; torch: PyTorch's matmuls; auto: the plan's choice)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tokenloom-bench-lora-"))
    model = args.model or str(make_model(args.preset, work / "model", dtype=args.dtype))
    cfg = json.loads((Path(model) / "config.json").read_text())
    adapters = [LoRARequest(f"adapter-{k}", k + 1, str(write_adapter(work / f"adapter-{k}", cfg, args.rank, k)))
                for k in range(args.adapters)]
    common = dict(dtype=args.dtype, max_num_seqs=args.batch, max_model_len=args.prompt_len + args.tokens + 8,
                  num_threads=args.num_threads, seed=0)
    engines: dict[str, LLM] = {"no-lora": LLM(model, **common)}
    for backend in args.backends:
        os.environ["TOKENLOOM_CPU_LORA"] = "0" if backend == "torch" else "1"
        llm = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
        got = llm.llm_engine.backends.lora
        if backend != "auto" and got != backend:
            print(f"the {backend} LoRA backend cannot run here (the plan chose {got}); skipped", file=sys.stderr)
            continue
        engines[f"lora-{got}"] = llm
        print(llm.llm_engine.summary(), file=sys.stderr)
    os.environ.pop("TOKENLOOM_CPU_LORA", None)

    micro = time_deltas(cfg, getattr(torch, args.dtype), args.batch, args.adapters, args.rank)
    for name, t in micro.items():
        print(f"one {name} linear's deltas, {args.batch} rows on {args.adapters} adapters: "
              + ", ".join(f"{k} {v['median_us']:.1f} us (min {v['min_us']:.1f})" for k, v in t.items()),
              file=sys.stderr)

    vocab = cfg["vocab_size"]
    spread = [adapters[i % len(adapters)] for i in range(args.batch)]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
        rng = random.Random(r)
        prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        cases = [(name, llm, kind) for name, llm in engines.items()
                 for kind in (("base",) if name == "no-lora" else ("base", "adapters"))]
        if r % 2:
            cases.reverse()
        for name, llm, kind in cases:
            res = timed_round(llm, prompts, spread if kind == "adapters" else None, args.tokens)
            print(f"round {r} {name}/{kind}: decode step {1e3 * res['decode_step_s']:.1f} ms", file=sys.stderr)
            if r:
                runs.setdefault(f"{name}/{kind}", []).append(res)

    summary = {k: {"decode_step_ms": 1e3 * statistics.median(x["decode_step_s"] for x in v),
                   "tokens_per_s": statistics.median(x["tokens_per_s"] for x in v)} for k, v in runs.items()}
    # adapters / base of each round (the two run back to back, in either order): the ratio least
    # moved by a machine whose load drifts over minutes
    for name in engines:
        if name != "no-lora":
            pairs = [a["decode_step_s"] / b["decode_step_s"]
                     for a, b in zip(runs[f"{name}/adapters"], runs[f"{name}/base"])]
            summary[f"{name}/adapters"]["paired_ratio_median"] = statistics.median(pairs)
            summary[f"{name}/adapters"]["paired_ratios"] = pairs
    ref = summary["no-lora/base"]["decode_step_ms"]
    for k, v in summary.items():
        base = summary.get(k.split("/")[0] + "/base", summary["no-lora/base"])["decode_step_ms"]
        v["vs_no_lora"] = v["decode_step_ms"] / ref
        v["vs_same_engine_base"] = v["decode_step_ms"] / base
    report = {"model": args.model or f"{args.preset} (random weights)", "dtype": args.dtype, "batch": args.batch,
              "adapters": args.adapters, "rank": args.rank, "prompt_len": args.prompt_len, "tokens": args.tokens,
              "rounds": args.rounds, "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
              "summary": summary, "deltas_us_per_linear": micro, "runs": runs}
    print(f"{'engine / batch':28s} {'decode step ms':>15s} {'tok/s':>8s} {'vs base, same engine':>21s} "
          f"{'vs no --enable-lora':>20s}")
    for k, v in summary.items():
        print(f"{k:28s} {v['decode_step_ms']:15.2f} {v['tokens_per_s']:8.1f} {v['vs_same_engine_base']:21.3f} "
              f"{v['vs_no_lora']:20.3f}")
    for k, v in summary.items():
        if "paired_ratios" in v:
            print(f"{k}: adapters / base, round by round: median {v['paired_ratio_median']:.3f} "
                  f"({', '.join(f'{r:.3f}' for r in v['paired_ratios'])})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
