#!/usr/bin/env python
"""Fine-tune the bundled model (`tokenloom/py-tiny`) into one that copies from its prompt.

Why: n-gram speculative decoding (docs/speculative-decoding.md) pays off when the output
repeats the prompt (code edits, extraction), but the bundled model does not copy: shown a
snippet and then the snippet's first line again, its greedy continuation follows the snippet
for a handful of tokens at most.  A few hundred steps on a copy objective grow the induction
heads it lacks.  The result is a benchmark model, not a shipped one.

Data (all from the bundled model's own training split of the CPython standard library,
`stdlib_corpus_files("train")`; the check uses the held-out "val" split):
  * copy rows: `snippet + separator + snippet` (scripts/copy_task.py), snippets of 24..140
    tokens of whole lines, packed with <|endoftext|> between examples;
  * edit rows: the same with one line of the second copy replaced by a line from another
    file, so the model learns to find its place again after a change;
  * plain rows: windows of stdlib files, plain language modelling, so it keeps writing Python.
Everything is seeded (data order, model init is the bundled weights); rerunning with the same
arguments on the same Python/torch versions repeats the run.

The check, before and after: on held-out snippets, prompt = snippet + "\\n\\n" + its first
third of lines; greedy continuation is compared with the rest of the snippet (the share of
its characters reproduced before the first difference, and how many are reproduced whole).

Example (about 3 minutes on one core of a 2-core machine):
  nice -n 19 python scripts/make_copy_model.py --out /tmp/tokenloom-copy-model
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# Run from a checkout without installing: the repository root and this folder importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_task import SEPARATORS, common_prefix_len, copy_text, cue_prompt, edited, snippet_lines  # noqa: E402
from train_bundled_model import make_optimizer, train_step  # noqa: E402

from tokenloom.bundled import BUNDLED_MODEL_DIR  # noqa: E402
from tokenloom.model.tokenizer_builder import EOS_ID, stdlib_corpus_files  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=BUNDLED_MODEL_DIR, help="model to fine-tune (the bundled one)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tokenloom-copy-model"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=256, help="tokens per training row (the bundled model's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--plain-frac", type=float, default=0.25, help="share of rows that are plain stdlib text")
    p.add_argument("--edit-frac", type=float, default=0.3, help="share of copy examples with one line edited")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-snippets", type=int, default=24)
    p.add_argument("--eval-snippet-tokens", type=int, default=120)
    return p.parse_args()


class RowMaker:
    """Training rows of context+1 token ids: packed copy/edit examples or a plain text window."""

    def __init__(self, tok, texts: list[str], args: argparse.Namespace, rng: random.Random):
        self.tok, self.texts, self.args, self.rng = tok, texts, args, rng

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def copy_example(self) -> list[int]:
        rng = self.rng
        lines: list[str] = []
        while len(lines) < 2:
            lines = snippet_lines(rng.choice(self.texts), rng, rng.randint(24, 140))
        second = None
        if rng.random() < self.args.edit_frac:
            donor_lines = [ln for ln in rng.choice(self.texts).splitlines() if ln.strip()] or ["pass"]
            second = edited(lines, rng, rng.choice(donor_lines))
        return self.encode(copy_text(lines, rng.choice(SEPARATORS), second))

    def plain_row(self) -> list[int]:
        width = self.args.context + 1
        ids: list[int] = [EOS_ID]
        while len(ids) < width:
            text = self.rng.choice(self.texts)
            start = self.rng.randrange(0, max(1, len(text) - 4 * width))
            ids += self.encode(text[start:start + 4 * width]) + [EOS_ID]
        return ids[:width]

    def row(self) -> list[int]:
        if self.rng.random() < self.args.plain_frac:
            return self.plain_row()
        ids: list[int] = [EOS_ID]
        while len(ids) < self.args.context + 1:
            ids += self.copy_example() + [EOS_ID]
        return ids[: self.args.context + 1]

    def batch(self) -> torch.Tensor:
        return torch.tensor([self.row() for _ in range(self.args.batch_size)], dtype=torch.long)


@torch.no_grad()
def copy_check(model, tok, texts: list[str], n: int, n_tokens: int, seed: int) -> dict[str, float]:
    """Greedy continuation of `snippet + "\\n\\n" + first third of its lines` against the rest
    of the snippet: mean share of its characters reproduced before the first difference, and
    the share of snippets reproduced whole."""
    rng = random.Random(seed)
    model.eval()
    shares: list[float] = []
    while len(shares) < n:
        lines = snippet_lines(rng.choice(texts), rng, n_tokens)
        if len(lines) < 3:
            continue
        prompt, expected = cue_prompt(lines, "\n\n", len(lines) // 3)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        budget = len(tok.encode(expected, add_special_tokens=False)) + 4
        out = model.generate(ids, max_new_tokens=budget, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=None)
        got = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
        shares.append(common_prefix_len(got, expected) / len(expected))
    model.train()
    return {"copied_share": round(statistics.mean(shares), 4),
            "copied_whole": round(sum(s == 1.0 for s in shares) / len(shares), 4)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    train_texts = [f.read_text(encoding="utf-8") for f in stdlib_corpus_files("train")]
    val_texts = [f.read_text(encoding="utf-8") for f in stdlib_corpus_files("val")]
    print(f"base {args.base}: {sum(p.numel() for p in model.parameters()):,} params; "
          f"{len(train_texts)} train / {len(val_texts)} held-out files", flush=True)

    t0 = time.time()
    before = copy_check(model, tok, val_texts, args.eval_snippets, args.eval_snippet_tokens, args.seed)
    print(f"copy check before: {before} ({time.time() - t0:.0f}s)", flush=True)

    opt = make_optimizer(model, args)
    rows = RowMaker(tok, train_texts, args, rng)
    model.train()
    t_train = time.time()
    ema = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        loss = train_step(model, opt, rows.batch())
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if (step + 1) % 25 == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps} loss {ema:.3f} ({time.time() - t_train:.0f}s)", flush=True)
    train_seconds = time.time() - t_train

    after = copy_check(model, tok, val_texts, args.eval_snippets, args.eval_snippet_tokens, args.seed)
    print(f"copy check after:  {after}", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    report = {
        "base": str(args.base),
        "purpose": "benchmark model for n-gram speculative decoding: copies from its prompt",
        "steps": args.steps,
        "train_wall_seconds": round(train_seconds, 1),
        "copy_check_before": before,
        "copy_check_after": after,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
    }
    (out / "copy_model_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
