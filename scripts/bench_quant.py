"""Decode step time with quantized weights: fp32 vs bf16 vs int8 vs int4, side by side.

    python scripts/bench_quant.py [--model DIR] [--batch-sizes 1,32] [--context 128] [--rounds 5]
                                  [--steps 6] [--variants fp32,bf16,int8,int4] [--kernels] [--quality]
                                  [--no-speed]

Without --model, a random-weight checkpoint of the Qwen2.5-0.5B shape is written once
(`tokenloom make-model qwen2.5-0.5b`, bf16) under /tmp.  One engine per variant is loaded
(all at once), each with `batch` requests of a `context`-token prompt prefilled; then rounds
alternate between the engines, each timing `steps` decode steps (eng.step(), the whole step:
scheduling, model, sampling), so a noisy neighbour slows every variant of a round alike.
Printed: the median step time per variant and batch size, and the ratios to bf16 and fp32
measured in the same run (docs/quantization.md).  A variant named `NAME/modules` (e.g.
`--variants int4,int4/modules`) is NAME with its decode steps through the model's module tree
instead of as plain functions (model/layers.py `bound_linear`): the saving, in the same rounds;
`NAME/noamx` is NAME with the AMX kernels off (TOKENLOOM_AMX=0 while it loads, kernels/amx.py);
`NAME/eager` is NAME with --enforce-eager (no CPU graphs: every decode step's ops called from
Python, runner/cpu_graphs.py).

--kernels times the GEMMs of one step alone (our bf16 kernel vs the int8 / int4 kernels).
--quality adds the bundled model's held-out bits per byte (its whole validation split,
transformers' forward with each matmul weight replaced by its dequantized quantization) and
the log-prob agreement of engine runs with and without quantization on a checkpoint saved by
transformers' save_pretrained; `--logprobs-chunk 8` scores every prompt token in prefill chunks
of 8 rows, which take the decode rows' integer path on AVX512-VNNI CPUs (kernels/quant_vnni.h).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from tokenloom import LLM, SamplingParams

VARIANTS = {  # name -> LLM keywords
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="bfloat16", quantization="int8"),
    "int4": dict(dtype="bfloat16", quantization="int4"),
    "int4-g128": dict(dtype="bfloat16", quantization="int4-g128"),
}


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from tokenloom.model.tools.make_model import make_model

    out = Path("/tmp/tokenloom-bench-quant/qwen2.5-0.5b")
    if not (out / "config.json").exists():
        make_model("qwen2.5-0.5b", out, dtype="bfloat16")
    return out


def prefilled(path: Path, batch: int, context: int, total_steps: int, **kw):
    """An engine with `batch` requests of `context` prompt tokens each, all past prefill."""
    llm = LLM(str(path), max_model_len=context + total_steps + 16, max_num_seqs=batch,
              num_kv_blocks=batch * ((context + total_steps + 16) // 16 + 1) + 8, **kw)
    eng = llm.llm_engine
    for i in range(batch):
        ids = [5 + (i * 7 + j * 13) % 3000 for j in range(context)]
        eng.add_request(f"r{i}", {"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=total_steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()
    return llm


def time_steps(llm, steps: int) -> float:
    eng = llm.llm_engine
    t = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def bench_speed(path: Path, variants: list[str], batches: list[int], context: int, rounds: int, steps: int) -> dict:
    results: dict[tuple[str, int], float] = {}
    for b in batches:
        engines = {}
        for v in variants:
            name, _, how = v.partition("/")
            if how == "noamx":  # the same variant with AMX off (kernels/amx.py): its linears load without it
                os.environ["TOKENLOOM_AMX"] = "0"
            try:
                kw = dict(VARIANTS[name], enforce_eager=True) if how == "eager" else VARIANTS[name]
                engines[v] = prefilled(path, b, context, rounds * steps + 2, **kw)
            finally:
                if how == "noamx":
                    os.environ.pop("TOKENLOOM_AMX", None)
            if how == "modules":  # the same engine, its linears called through their modules
                runner = engines[v].llm_engine.runner
                runner.model.bind(runner.ops, runner.attn, flat=False)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                times[v].append(time_steps(engines[v], steps))
        for v in variants:
            results[v, b] = statistics.median(times[v])
        del engines
        print(f"\nbatch {b}, context ~{context}: median decode step over {rounds} alternating rounds of {steps} steps")
        for v in variants:
            ms = results[v, b] * 1e3
            rel = "".join(f"  {results[r, b] / results[v, b]:5.2f}x vs {r}" for r in ("bf16", "fp32")
                          if (r, b) in results and r != v)
            print(f"  {v:14s} {ms:8.1f} ms{rel}")
    return results


def bench_kernels(batches: list[int], rounds: int) -> None:
    """The GEMMs alone: every matmul weight of the Qwen2.5-0.5B shape (24 layers' qkv, o, gate/up,
    down and the 151936 x 896 vocab projection; 988 MB in bf16, more than the caches) through our
    bf16 kernel and our int8 / int4 kernels, bf16 activations, alternating rounds, medians."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.quantization import PanelQuantized, parse_scheme

    g = torch.Generator().manual_seed(0)
    shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 24 + [(151936, 896)]
    ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in shapes]
    packed = [(cpu_kernels.pack_for(w), w.shape[0], w.shape[1]) for w in ws]
    op = cpu_kernels.linear_op(packed[0][0])
    quant = {name: [PanelQuantized(w, parse_scheme(name)) for w in ws] for name in ("int8", "int4")}
    del ws
    for m in batches:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (896, 4864)}
        fns = {"bf16": lambda: [op(xs[k], p, n, None) for p, n, k in packed]}
        for name, mats in quant.items():
            fns[name] = lambda mats=mats: [q.matmul(xs[q.in_features], None) for q in mats]
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nGEMMs of one step ({m} rows), median of {rounds} alternating rounds:")
        for k, t in med.items():
            print(f"  {k:6s} {t * 1e3:8.1f} ms  {med['bf16'] / t:5.2f}x vs bf16")


def bench_quality(variants: list[str]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from tokenloom.bundled import BUNDLED_MODEL_DIR, bits_per_byte
    from tokenloom.model.tools import tokenizer_builder as tb
    from tokenloom.model.weights.quantization import TorchQuantized, parse_scheme

    report = json.loads((BUNDLED_MODEL_DIR / "training_report.json").read_text())
    texts = [p.read_text(encoding="utf-8") for p in tb.stdlib_corpus_files("val")]
    tok = Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(tok.encode(t).ids) for t in texts)
    print(f"\nbundled model, held-out bits per byte ({len(texts)} val files):")
    base = None
    for v in ["fp32", *[v for v in variants if v.startswith("int")]]:
        hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
        if v != "fp32":
            scheme = parse_scheme(VARIANTS[v]["quantization"])
            with torch.no_grad():
                for m in hf.modules():
                    if isinstance(m, torch.nn.Linear):
                        m.weight.copy_(TorchQuantized(m.weight, scheme).dequantize())
                emb = hf.get_input_embeddings().weight  # tied: the LM head too
                emb.copy_(TorchQuantized(emb, scheme).dequantize())
        bpb = bits_per_byte(hf, tok, texts, context=report["hyperparameters"]["context"])
        ppl = math.exp(bpb * math.log(2) * n_bytes / n_tokens)  # per token
        base = base or ppl
        print(f"  {v:10s} {bpb:.4f} bits/byte, perplexity {ppl:.4f} per token ({100 * (ppl / base - 1):+.2f}% vs fp32)")


def bench_logprobs(variants: list[str], chunk: int | None = None) -> None:
    """Mean |logprob(quantized) - logprob(bf16)| of the bf16 run's greedy tokens, teacher-forced
    through prompt_logprobs, on a Qwen2-shaped checkpoint saved by transformers; with `chunk`,
    prefill chunks of that many tokens, one request at a time."""
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen2Config

    from tokenloom.model.tools.tokenizer_builder import default_tokenizer, save_hf_tokenizer

    out = Path(tempfile.mkdtemp()) / "qwen2-ref"
    cfg = Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)  # transformers' own init (std 0.02)
    save_hf_tokenizer(default_tokenizer(1024), out, model_max_length=512)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(5, 1000, (96,), generator=g).tolist()} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def lps(q):
        small = dict(max_num_batched_tokens=chunk, max_num_seqs=1) if chunk else {}
        outs = LLM(str(out), dtype="bfloat16", quantization=q, max_model_len=256, num_kv_blocks=128,
                   **small).generate(prompts, params, use_tqdm=False)
        return [lp for o in outs for d in o.prompt_logprobs[1:] for lp in [next(iter(d.values())).logprob]]

    ref = torch.tensor(lps(None))
    print(f"\nlog-prob agreement with bf16 ({ref.numel()} prompt tokens, transformers-saved Qwen2 checkpoint):")
    for v in [v for v in variants if v.startswith("int")]:
        got = torch.tensor(lps(VARIANTS[v]["quantization"]))
        nll_ref, nll = -ref.mean().item(), -got.mean().item()
        print(f"  {v:10s} mean |dlogprob| {((got - ref).abs().mean()).item():.4f} nats; "
              f"perplexity {torch.exp(torch.tensor(nll)).item():.3f} vs {torch.exp(torch.tensor(nll_ref)).item():.3f} "
              f"({100 * (torch.exp(torch.tensor(nll - nll_ref)).item() - 1):+.2f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--variants", default="fp32,bf16,int8,int4")
    ap.add_argument("--quality", action="store_true", help="also the quality figures (held-out bpb, log-probs)")
    ap.add_argument("--logprobs-chunk", type=int, default=None,
                    help="with --quality: score prompts in prefill chunks of this many tokens (8: the integer path)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="also time the GEMMs alone (bf16 vs int8 vs int4)")
    a = ap.parse_args()
    variants = a.variants.split(",")
    print(f"torch threads: {torch.get_num_threads()}")
    if not a.no_speed:
        bench_speed(model_dir(a.model), variants, [int(b) for b in a.batch_sizes.split(",")], a.context, a.rounds,
                    a.steps)
    if a.kernels:
        bench_kernels([int(b) for b in a.batch_sizes.split(",")], a.rounds)
    if a.quality:
        named = [v for v in variants if "/" not in v]
        bench_quality(named)
        bench_logprobs(named, a.logprobs_chunk)


if __name__ == "__main__":
    main()
