#!/usr/bin/env python
"""Train, from scratch, a small Llama that copies from its prompt (a benchmark model).

Why: n-gram speculative decoding (docs/speculative-decoding.md) pays off when the output
repeats the prompt (code edits, extraction).  The bundled model (`tokenloom/py-tiny`) hardly
copies.  Copying needs induction heads ("find the earlier occurrence of the current token,
emit what followed it"), which its short pretraining did not grow, and fine-tuning it toward
copying did not grow them either.  So this script trains a fresh, shallow model on a mixture
built to make induction the cheapest way to lower the loss.  The result is a benchmark model,
not a shipped one.

This script does not yet give a model that copies: no run tried showed the sudden drop in
loss that marks induction heads forming.  `scripts/wire_copy_model.py` (the circuit set by
hand) does copy, and is what the benchmark figures use.  The runs tried, what they reached and
what to try next: docs/speculative-decoding.md, "Training a copier from scratch".

Model: LlamaForCausalLM from LlamaConfig (default 2 layers, hidden 256, 8 heads of 32, tied
embeddings, 512 positions), the bundled tokenizer (vocab 4096) saved beside it, so tokenloom
and transformers load the directory as any checkpoint.

Two phases: 1. `--induction-steps` of random rows only, short (`--induction-context`) with
short runs (`--min-run`..`--induction-max-run`); 2. `--steps` of the mixture below.
Data (every row is `context + 1` token ids with a loss mask; all seeded).  A row is one kind:
  * random (`--random-frac`): examples of `noise + run + run`, packed with <|endoftext|>
    between them: a run of random ids (length `--min-run`..`--max-run`, drawn per example),
    after random noise (so the run starts at varying offsets), then repeated; loss on the
    repeat after its first token.  Nothing but copying predicts it, and since the length and
    offset vary, "copy the token n back" does not work: the model has to look the current
    token up (with one fixed length it learns a fixed offset, which does not transfer).
  * copy (the rest): `snippet + separator + snippet` (scripts/copy_task.py) of whole lines
    of the stdlib training split (`stdlib_corpus_files("train")`; the check uses the
    held-out "val" split), 24..140 tokens, packed; loss on the second copy.  `--edit-frac` of
    them have one line of the copy replaced by a line from another file, so the model learns
    to pick the copy up again after a change (the benchmark's `edit` workload).
  * plain (`--plain-frac`): stdlib windows, loss everywhere, so the model also writes Python
    (what it says where there is nothing to copy: the benchmark's `random` workload).
AdamW, linear warmup, constant through phase 1, cosine decay over phase 2 to 10%, gradient
clipping at 1; embeddings initialised with `--embed-std` (~unit rows, not 0.02).

The copy check, printed every `--check-every` steps (8 snippets) and at the end: on held-out
snippets, prompt = snippet + "\\n\\n" + its first third of lines; the greedy continuation is
compared with the rest of the snippet: the mean share of its characters reproduced before the
first difference, and the share of snippets reproduced whole.

Example (one thread of a shared 2-core machine; ~0.3 s a phase-1 step, ~0.7 s a phase-2 one):
  nice -n 19 python scripts/make_copy_model.py --out /tmp/tokenloom-trained-copy-model
Rerunning with the same arguments on the same Python/torch versions repeats the run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

# Run from a checkout without installing: the repository root and this folder importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_task import SEPARATORS, common_prefix_len, copy_text, cue_prompt, edited, snippet_lines  # noqa: E402

from tokenloom.bundled import BUNDLED_MODEL_DIR  # noqa: E402
from tokenloom.model.tools.tokenizer_builder import BOS_ID, EOS_ID, PAD_ID, stdlib_corpus_files  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FIRST_ORDINARY_ID = 10  # ids below are special tokens: never in random runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/tokenloom-copy-model"))
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL_DIR, help="where the tokenizer files come from")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--embed-std", type=float, default=0.0625,
                   help="init std of the (tied) embeddings: ~unit-norm rows, so logits can be confident early")
    p.add_argument("--induction-steps", type=int, default=1500, help="phase 1: short rows of random runs only")
    p.add_argument("--induction-context", type=int, default=48)
    p.add_argument("--induction-batch-size", type=int, default=32)
    p.add_argument("--induction-max-run", type=int, default=16)
    p.add_argument("--steps", type=int, default=600, help="phase 2: the mixture of random, copy and plain rows")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--context", type=int, default=256, help="tokens per training row (phase 2)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--random-frac", type=float, default=0.4, help="share of rows of repeated random runs")
    p.add_argument("--plain-frac", type=float, default=0.2, help="share of rows of plain stdlib text")
    p.add_argument("--edit-frac", type=float, default=0.3, help="share of copy examples with one line edited")
    p.add_argument("--min-run", type=int, default=3, help="shortest random run")
    p.add_argument("--max-run", type=int, default=64, help="longest random run (phase 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=250, help="steps between quick copy checks (0: none)")
    p.add_argument("--eval-snippets", type=int, default=32)
    p.add_argument("--eval-snippet-tokens", type=int, default=120)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, vocab: int) -> LlamaForCausalLM:
    """A fresh Llama of `--layers` x `--hidden` (heads of `--head-dim`), tied embeddings."""
    heads = args.hidden // args.head_dim
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=args.head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config)
    # With the default 0.02 a row's norm is ~0.3, so a tied head's logits start within a few
    # nats of each other and copying cannot pay off much until they grow.
    torch.nn.init.normal_(model.model.embed_tokens.weight, 0.0, args.embed_std)
    return model


class RowMaker:
    """Training rows of context+1 token ids and their loss mask (1 = predict this token);
    the kinds are described in the module docstring."""

    def __init__(self, tok, texts: list[str], args: argparse.Namespace, rng: random.Random):
        self.fast = tok.backend_tokenizer  # the `tokenizers.Tokenizer`: offsets, no length warnings
        self.texts, self.args, self.rng = texts, args, rng
        self.vocab = len(tok)

    def random_example(self) -> tuple[list[int], list[int]]:
        """noise + run + run: loss on the repeat after its first token (what copying predicts)."""
        rng = self.rng
        noise = [rng.randrange(FIRST_ORDINARY_ID, self.vocab) for _ in range(rng.randint(0, self.args.max_run))]
        run = [rng.randrange(FIRST_ORDINARY_ID, self.vocab) for _ in range(rng.randint(self.args.min_run,
                                                                                          self.args.max_run))]
        return noise + run + run, [0] * (len(noise) + len(run) + 1) + [1] * (len(run) - 1)

    def copy_example(self) -> tuple[list[int], list[int]]:
        """snippet + separator + snippet (or the snippet with one line edited): loss on the copy."""
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

    def plain_row(self) -> tuple[list[int], list[int]]:
        width = self.args.context + 1
        ids: list[int] = [EOS_ID]
        while len(ids) < width:
            text = self.rng.choice(self.texts)
            start = self.rng.randrange(0, max(1, len(text) - 4 * width))
            ids += self.fast.encode(text[start:start + 4 * width]).ids + [EOS_ID]
        return ids[:width], [1] * width

    def packed_row(self, example) -> tuple[list[int], list[int]]:
        ids, mask = [EOS_ID], [0]
        while len(ids) < self.args.context + 1:
            i, m = example()
            ids += i + [EOS_ID]
            mask += m + [0]
        return ids[: self.args.context + 1], mask[: self.args.context + 1]

    def row(self) -> tuple[list[int], list[int]]:
        r = self.rng.random()
        if r < self.args.random_frac:
            return self.packed_row(self.random_example)
        if r < self.args.random_frac + self.args.plain_frac:
            return self.plain_row()
        return self.packed_row(self.copy_example)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row() for _ in range(self.args.batch_size)]
        return (torch.tensor([r[0] for r in rows], dtype=torch.long),
                torch.tensor([r[1] for r in rows], dtype=torch.bool))


def make_optimizer(model, args: argparse.Namespace) -> torch.optim.AdamW:
    # No weight decay on norms (1-D params): decaying a gain toward 0 only fights the model.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, --lr through phase 1, then cosine decay over phase 2 to 10% of --lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if step < args.induction_steps:
        return args.lr
    t = (step - args.induction_steps) / max(1, args.steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def induction_args(args: argparse.Namespace) -> argparse.Namespace:
    """Phase 1's row settings: random rows only, short rows, short runs, bigger batches."""
    return argparse.Namespace(**{**vars(args), "random_frac": 1.0, "plain_frac": 0.0,
                                 "context": args.induction_context, "batch_size": args.induction_batch_size,
                                 "max_run": args.induction_max_run})


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
    return {"snippets": n, "copied_share": round(statistics.mean(shares), 4),
            "copied_whole": round(sum(s == 1.0 for s in shares) / len(shares), 4)}


def save(model, args: argparse.Namespace, report: dict) -> None:
    """save_pretrained + the bundled tokenizer files + a generation config + the report."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.tokenizer / name, out / name)
    (out / "copy_model_report.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = build_model(args, len(tok))
    train_texts = [f.read_text(encoding="utf-8") for f in stdlib_corpus_files("train")]
    val_texts = [f.read_text(encoding="utf-8") for f in stdlib_corpus_files("val")]
    print(f"{args.layers} layers x {args.hidden}: {sum(p.numel() for p in model.parameters()):,} params; "
          f"{len(train_texts)} train / {len(val_texts)} held-out files", flush=True)

    opt = make_optimizer(model, args)
    phases = [("induction", args.induction_steps, RowMaker(tok, train_texts, induction_args(args), rng)),
              ("mixture", args.steps, RowMaker(tok, train_texts, args, rng))]
    model.train()
    t0 = time.time()
    checks = []
    step = 0
    for name, steps, rows in phases:
        ema = None
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            loss = train_step(model, opt, *rows.batch())
            step += 1
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            if (i + 1) % 25 == 0 or i + 1 == steps:
                print(f"{name} step {i + 1}/{steps} loss {ema:.3f} lr {lr_at(step - 1, args):.2e} "
                      f"({time.time() - t0:.0f}s)", flush=True)
            if args.check_every and (i + 1) % args.check_every == 0 and i + 1 < steps:
                quick = copy_check(model, tok, val_texts, 8, args.eval_snippet_tokens, args.seed + 1)
                checks.append({"phase": name, "step": i + 1, "loss_ema": round(ema, 3), **quick})
                print(f"  quick copy check: {quick}", flush=True)
    train_seconds = time.time() - t0

    after = copy_check(model, tok, val_texts, args.eval_snippets, args.eval_snippet_tokens, args.seed)
    print(f"copy check (held-out): {after}", flush=True)
    report = {
        "purpose": "benchmark model for n-gram speculative decoding: copies from its prompt",
        "params": sum(p.numel() for p in model.parameters()),
        "train_wall_seconds": round(train_seconds, 1),
        "copy_check": after,
        "quick_checks": checks,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
    }
    save(model, args, report)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
