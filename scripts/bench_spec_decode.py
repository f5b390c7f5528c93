"""Output tokens/s with and without n-gram speculative decoding, side by side in one run.

    python scripts/bench_spec_decode.py                      # the bundled model, batch 1
    python scripts/bench_spec_decode.py --batch-sizes 1 2 4 8 16 --rounds 3
    python scripts/bench_spec_decode.py --model /path/to/hf-dir --dtype bfloat16
    python scripts/bench_spec_decode.py --model /tmp/tokenloom-copy-model   # scripts/wire_copy_model.py

Two engines are loaded once (speculation off / on) and timed alternately, round after round
(the order flips every round); the figure is the median over rounds of output tokens / wall
seconds of `LLM.generate` over the workload's prompts, `batch` prompts at a time.  Greedy
outputs of the two engines are compared token for token: the script exits non-zero if they
differ.

Workloads (the prompts are built with scripts/copy_task.py, as the copy model's training rows):
  copy    a ~160-token snippet of this repository's own sources (real Python, in neither
          model's training data), then "\\n\\n# the same code again:\\n" and the snippet's first
          line (no newline): a model that copies continues with the rest of the snippet.
  edit    the snippet, "\\n\\n# edited:\\n", then its first quarter of lines with the last of
          them replaced by a line from elsewhere: a copier continues with the unchanged rest.
  random  uniformly random token ids (nothing to look up: the cost of trying).
The bundled model does not copy; `python scripts/wire_copy_model.py` builds one that does
(pass its --out directory as --model).  Note that a copier copies a `random` prompt too.
All run with ignore_eos and a fixed max_tokens, so both engines emit the same token count.
Acceptance (drafted / accepted tokens, mean tokens per verifying step) is read from the step
events.  docs/speculative-decoding.md has the figures and what they mean.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tokenloom import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_task import BENCH_SEPARATOR, cue_prompt, snippet_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["tokenloom/core/kv_cache.py", "tokenloom/core/scheduler.py", "tokenloom/runner/sampler.py",
           "tokenloom/engine/output_processor.py", "tokenloom/config.py", "tokenloom/request.py"]


def _snippets(tokenizer, n: int, snippet_tokens: int, rng: random.Random) -> list[list[str]]:
    """n snippets of about snippet_tokens tokens of whole lines of this repository's sources."""
    out: list[list[str]] = []
    while len(out) < n:
        text = (ROOT / rng.choice(SOURCES)).read_text()
        lines = snippet_lines(text, rng, snippet_tokens, encode=tokenizer.encode)
        if len(lines) >= 4:
            out.append(lines)
    return out


def copy_prompts(tokenizer, n: int, snippet_tokens: int, seed: int) -> list[list[int]]:
    """n prompts: a snippet of real source, a marker, and the snippet's first line again."""
    rng = random.Random(seed)
    return [tokenizer.encode(cue_prompt(lines, BENCH_SEPARATOR, 1)[0])
            for lines in _snippets(tokenizer, n, snippet_tokens, rng)]


def edit_prompts(tokenizer, n: int, snippet_tokens: int, seed: int) -> list[list[int]]:
    """n prompts: a snippet, "# edited:", then its first lines again with the last of them
    changed (a line from another snippet): a continuation that copies after an edit."""
    rng = random.Random(seed)
    out = []
    for lines in _snippets(tokenizer, n, snippet_tokens, rng):
        cut = max(2, len(lines) // 4)
        donor = rng.choice([ln for ln in (ROOT / rng.choice(SOURCES)).read_text().splitlines() if ln.strip()])
        head = list(lines[:cut])
        head[-1] = head[-1][: len(head[-1]) - len(head[-1].lstrip())] + donor.strip()  # same indentation
        out.append(tokenizer.encode("\n".join(lines) + "\n\n# edited:\n" + "\n".join(head)))
    return out


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams, batch: int
        ) -> tuple[float, float, list[list[int]]]:
    """Output tokens per wall second and per CPU second of this process (generate over the
    prompts, `batch` at a time); and the outputs.  On a shared machine the CPU-time rate is
    the steadier one: time spent waiting for a core does not count."""
    outs: list[list[int]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], sp, use_tqdm=False)
        outs += [list(r.outputs[0].token_ids) for r in res]
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(map(len, outs))
    return n / dt, n / dc, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 1024}',
                    help="the 'on' engine's config (batch-size cut-off lifted so a sweep measures every size)")
    ap.add_argument("--workloads", nargs="+", default=["copy", "edit", "random"], choices=["copy", "edit", "random"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per workload (per batch size: at least it)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--snippet-tokens", type=int, default=160,
                    help="snippet length (copy, edit) and prompt length (random), in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature instead of greedy (a model that loops greedily stops "
                         "looping; outputs are then not compared token for token: rejection sampling keeps "
                         "the distribution, not the draws)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    spec = json.loads(args.speculative_config)
    kw = dict(dtype=args.dtype, num_threads=args.num_threads, max_model_len=512, seed=0)
    off = LLM(args.model, **kw)
    events = []
    on = LLM(args.model, speculative_config=spec, observers=[events.append], **kw)
    tok = off.get_tokenizer()
    vocab = off.llm_engine.vocab_size
    greedy = args.temperature == 0
    sp = SamplingParams(temperature=args.temperature, seed=None if greedy else 0, max_tokens=args.max_tokens,
                        ignore_eos=True)
    results = []
    ok = True
    for wl in args.workloads:
        for batch in args.batch_sizes:
            n = max(args.num_prompts, batch)
            prompts = (copy_prompts(tok, n, args.snippet_tokens, seed=0) if wl == "copy"
                       else edit_prompts(tok, n, args.snippet_tokens, seed=0) if wl == "edit"
                       else random_prompts(vocab, n, args.snippet_tokens, seed=0))
            run(off, prompts[:batch], sp, batch)  # warm both engines on this shape
            run(on, prompts[:batch], sp, batch)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpu_rates: dict[str, list[float]] = {"off": [], "on": []}
            same = True
            drafted = accepted = verify_steps = 0
            for r in range(args.rounds):
                order = [("off", off), ("on", on)] if r % 2 == 0 else [("on", on), ("off", off)]
                got = {}
                for name, llm in order:
                    events.clear()
                    rate, cpu_rate, outs = run(llm, prompts, sp, batch)
                    rates[name].append(rate)
                    cpu_rates[name].append(cpu_rate)
                    got[name] = outs
                    if name == "on":
                        drafted += sum(e.num_draft_tokens for e in events)
                        accepted += sum(e.num_accepted_tokens for e in events)
                        verify_steps += sum(1 for e in events for en in e.entries if en.draft_token_ids)
                same &= got["off"] == got["on"] or not greedy
            m_off, m_on = statistics.median(rates["off"]), statistics.median(rates["on"])
            c_off, c_on = statistics.median(cpu_rates["off"]), statistics.median(cpu_rates["on"])
            row = dict(workload=wl, batch=batch, tok_s_off=m_off, tok_s_on=m_on, speedup=m_on / m_off,
                       tok_per_cpu_s_off=c_off, tok_per_cpu_s_on=c_on, cpu_speedup=c_on / c_off,
                       drafted=drafted, accepted=accepted,
                       acceptance=accepted / drafted if drafted else 0.0,
                       tokens_per_verify_step=1 + accepted / verify_steps if verify_steps else 1.0,
                       identical=same if greedy else None, temperature=args.temperature, rounds=args.rounds)
            results.append(row)
            ok &= same
            print(f"{wl:7s} batch {batch:3d}: off {m_off:8.1f} tok/s  on {m_on:8.1f} tok/s  x{m_on / m_off:5.2f}  "
                  f"(per CPU second: {c_off:8.1f} / {c_on:8.1f}  x{c_on / c_off:5.2f})  "
                  f"acceptance {row['acceptance']:.2f} ({accepted}/{drafted}), "
                  f"{row['tokens_per_verify_step']:.2f} tokens per verifying step, "
                  f"identical: {same if greedy else 'n/a (sampled)'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model or "bundled", spec=spec, results=results),
                                              indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
