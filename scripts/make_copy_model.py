#!/usr/bin/env python
"""Fine-tune the bundled model (`tokenloom/py-tiny`) into one that copies from its prompt.

Why: n-gram speculative decoding (docs/speculative-decoding.md) pays off when the output
repeats the prompt (code edits, extraction), but the bundled model does not copy: shown a
snippet and then the first third of it again, its greedy continuation follows the snippet
for ~2% of the rest (held-out files).  Copying needs induction heads, which its 805 steps
of pretraining did not grow.  The result is meant as a benchmark model, not a shipped one.

STATUS: at the defaults this does NOT yet give a model that copies (see the copy check it
prints; docs/speculative-decoding.md, "What the workloads really are").  Measured on the
shared 2-core machine, one thread, 2026-12-05:
  * the code mixture alone (phase 2 only, 300-600 steps, lr 1e-3..3e-3): no change;
  * phase 1 with ONE run length (32) learns in ~250 steps, but as "copy the token 32
    positions back" (RoPE makes a fixed offset easy): it breaks as soon as the length
    varies and does not transfer to code;
  * phase 1 with run lengths 6..32 per row: loss on the repeats 8.4 -> 7.5 nats over 1,300
    steps (uniform guessing is 8.3, copying ~0): induction is forming, slowly; whether the
    2,000 default steps (~15 minutes) are enough was not seen.  More steps, a higher
    learning rate or more heads-friendly data (shorter runs first) are the next things to try.

Phases (all data seeded; the model starts from the bundled weights):
  1. induction: rows of a random-id run repeated, loss after the first run (nothing but
     copying predicts it), run length varying per row;
  2. code, from the bundled model's own training split of the CPython standard library
     (`stdlib_corpus_files("train")`; the check uses the held-out "val" split):
     * copy rows: `snippet + separator + snippet` (scripts/copy_task.py), snippets of 24..140
       tokens of whole lines, packed with <|endoftext|> between examples, loss on the copy;
     * edit rows: the same with one line of the second copy replaced by a line from another
       file, so the model learns to find its place again after a change;
     * random rows (as phase 1) and plain rows (stdlib windows, loss everywhere), so it
       keeps copying and keeps writing Python.
Rerunning with the same arguments on the same Python/torch versions repeats the run.

The check, before and after: on held-out snippets, prompt = snippet + "\\n\\n" + its first
third of lines; greedy continuation is compared with the rest of the snippet (the share of
its characters reproduced before the first difference, and how many are reproduced whole).

Example (phase 1 ~0.4 s a step, phase 2 ~0.8 s, one core of a shared 2-core machine):
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
from train_bundled_model import make_optimizer  # noqa: E402

from tokenloom.bundled import BUNDLED_MODEL_DIR  # noqa: E402
from tokenloom.model.tokenizer_builder import EOS_ID, stdlib_corpus_files  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=BUNDLED_MODEL_DIR, help="model to fine-tune (the bundled one)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tokenloom-copy-model"))
    p.add_argument("--induction-steps", type=int, default=2000, help="phase 1: repeated random ids")
    p.add_argument("--induction-batch-size", type=int, default=16)
    p.add_argument("--induction-min-run", type=int, default=6, help="phase 1: shortest random run")
    p.add_argument("--induction-max-run", type=int, default=32, help="phase 1: longest random run")
    p.add_argument("--induction-width", type=int, default=96, help="phase 1: tokens per row")
    p.add_argument("--steps", type=int, default=150, help="phase 2: copy/edit/plain rows of stdlib code")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=256, help="tokens per training row (the bundled model's)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--plain-frac", type=float, default=0.25, help="share of rows that are plain stdlib text")
    p.add_argument("--random-frac", type=float, default=0.1, help="share of rows that repeat random ids")
    p.add_argument("--edit-frac", type=float, default=0.3, help="share of copy examples with one line edited")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=50, help="steps between quick copy checks (0: none)")
    p.add_argument("--eval-snippets", type=int, default=24)
    p.add_argument("--eval-snippet-tokens", type=int, default=120)
    return p.parse_args()


class RowMaker:
    """Training rows of context+1 token ids and their loss mask (1 = predict this token).

    Copy rows are packed copy/edit examples with the loss on the second copy only (the first
    is unpredictable text; the second is what copying predicts), so every gradient step is
    about copying; plain rows are stdlib windows with the loss everywhere; random rows repeat
    a run of random token ids, where nothing but copying predicts the second run (the cleanest
    signal for induction heads).
    """

    def __init__(self, tok, texts: list[str], args: argparse.Namespace, rng: random.Random):
        self.fast = tok.backend_tokenizer  # the `tokenizers.Tokenizer`: offsets, no length warnings
        self.texts, self.args, self.rng = texts, args, rng
        self.vocab = tok.vocab_size if hasattr(tok, "vocab_size") else len(tok)

    def copy_example(self) -> tuple[list[int], list[int]]:
        rng = self.rng
        lines: list[str] = []
        while len(lines) < 2:
            lines = snippet_lines(rng.choice(self.texts), rng, rng.randint(24, 140))
        second = None
        if rng.random() < self.args.edit_frac:
            donor_lines = [ln for ln in rng.choice(self.texts).splitlines() if ln.strip()] or ["pass"]
            second = edited(lines, rng, rng.choice(donor_lines))
        sep = rng.choice(SEPARATORS)
        first_len = len("\n".join(lines) + sep)
        enc = self.fast.encode(copy_text(lines, sep, second))
        return enc.ids, [int(start >= first_len) for start, _ in enc.offsets]

    def random_example(self) -> tuple[list[int], list[int]]:
        run = [self.rng.randrange(10, self.vocab) for _ in range(self.rng.randint(8, 60))]
        return run + run, [0] * len(run) + [1] * len(run)

    def plain_row(self) -> tuple[list[int], list[int]]:
        width = self.args.context + 1
        ids: list[int] = [EOS_ID]
        while len(ids) < width:
            text = self.rng.choice(self.texts)
            start = self.rng.randrange(0, max(1, len(text) - 4 * width))
            ids += self.fast.encode(text[start:start + 4 * width]).ids + [EOS_ID]
        return ids[:width], [1] * width

    def row(self) -> tuple[list[int], list[int]]:
        r = self.rng.random()
        if r < self.args.plain_frac:
            return self.plain_row()
        example = self.random_example if r < self.args.plain_frac + self.args.random_frac else self.copy_example
        ids, mask = [EOS_ID], [0]
        while len(ids) < self.args.context + 1:
            i, m = example()
            ids += i + [EOS_ID]
            mask += m + [0]
        return ids[: self.args.context + 1], mask[: self.args.context + 1]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row() for _ in range(self.args.batch_size)]
        return (torch.tensor([r[0] for r in rows], dtype=torch.long),
                torch.tensor([r[1] for r in rows], dtype=torch.bool))


def induction_batch(args: argparse.Namespace, rng: random.Random, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1: rows of <|endoftext|> + a run of random ids repeated to `induction_width`, loss
    after the first run.  Nothing but copying predicts it, and the run length differs per row
    (`induction_min_run`..`induction_max_run`): with one fixed length the model learns "copy
    the token that many positions back" (in ~250 steps) and that does not transfer to code."""
    w = args.induction_width
    rows, masks = [], []
    for _ in range(args.induction_batch_size):
        n = rng.randint(args.induction_min_run, args.induction_max_run)
        run = [rng.randrange(10, vocab) for _ in range(n)]
        rows.append([EOS_ID] + (run * (w // n + 1))[:w])
        masks.append([False] * (n + 1) + [True] * (w - n))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool)


def train_step(model, opt, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """One AdamW step on next-token loss over the masked-in targets."""
    logits = model(input_ids=ids[:, :-1]).logits
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


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
    phases = [("induction", args.induction_steps, lambda: induction_batch(args, rng, rows.vocab)),
              ("code", args.steps, rows.batch)]
    step = 0
    for name, steps, make_batch in phases:
        ema = None
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
            loss = train_step(model, opt, *make_batch())
            step += 1
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            if (i + 1) % 25 == 0 or i + 1 == steps:
                print(f"{name} step {i + 1}/{steps} loss {ema:.3f} ({time.time() - t_train:.0f}s)", flush=True)
            if args.check_every and (i + 1) % args.check_every == 0:
                quick = copy_check(model, tok, val_texts, 8, args.eval_snippet_tokens, args.seed + 1)
                print(f"  quick copy check (8 snippets): {quick}", flush=True)
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
        "induction_steps": args.induction_steps,
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
