#!/usr/bin/env python
"""Train tokenloom's bundled model (`tokenloom/py-tiny`) from scratch on the Python stdlib.

Reproducible: everything is seeded, the corpus is the running interpreter's standard library
(split by a stable path hash into train/val), and the step counts are written to
`training_report.json`.  The learning rate is warmup -> constant -> cosine decay ("WSD"): the
constant phase does not depend on the run length, so on a shared machine whose speed changes
under us `--minutes` can decide *while training* when to start the decay (so that it ends within
the budget).  The decision is recorded; rerunning with `--steps N --decay-steps D --threads T
--seed S` (the report's "reproduce" line) on the same Python/torch versions repeats the run.

Pipeline:
  1. byte-level BPE tokenizer trained on the train split (tokenloom.model.tools.tokenizer_builder)
  2. train files tokenized and packed into one stream, documents separated by <|endoftext|>
  3. a small LlamaForCausalLM (tied embeddings) trained with AdamW + linear warmup + cosine decay
  4. held-out bits per byte on the val split, then save_pretrained + tokenizer + report

Example:
  python scripts/train_bundled_model.py --out tokenloom/bundled/py-tiny --minutes 28 --threads 1 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenloom.bundled import bits_per_byte  # noqa: E402
from tokenloom.model.tools.tokenizer_builder import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PAD_ID,
    build_bytelevel_bpe,
    save_hf_tokenizer,
    stdlib_corpus_files,
    stdlib_root,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("tokenloom/bundled/py-tiny"))
    p.add_argument("--minutes", type=float, default=40.0, help="training-loop time budget (chooses the steps)")
    p.add_argument("--steps", type=int, default=None, help="exact optimizer steps (instead of --minutes)")
    p.add_argument("--decay-steps", type=int, default=None, help="cosine-decay steps at the end (with --steps)")
    p.add_argument("--decay-frac", type=float, default=0.35, help="decay share of all steps in --minutes mode")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200, help="steps between quick val checks")
    p.add_argument("--val-max-bytes", type=int, default=None, help="cap the final val text (for smoke runs)")
    return p.parse_args()


def pack_train_stream(tok, files: list[Path]) -> torch.Tensor:
    """All train files as one token stream: doc <eos> doc <eos> ... (int32 to halve memory)."""
    texts = [f.read_text(encoding="utf-8") for f in files]
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


def lr_at(step: int, decay_start: int | None, decay_steps: int, args: argparse.Namespace) -> float:
    """Linear warmup, constant, then cosine from lr down to lr * min_lr_ratio over decay_steps.

    `decay_start` is None while the run length is still undecided (constant phase).
    """
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if decay_start is None or step < decay_start:
        return args.lr
    progress = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def make_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context * 2,  # headroom for generation past the trained length
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,  # the embedding is a third of the params; sharing it saves MBs
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config)
    return model


def batches(stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator):
    """Endless shuffled batches of packed windows of context+1 tokens (epoch after epoch)."""
    width = args.context + 1
    n_windows = (len(stream) - 1) // args.context
    while True:
        order = torch.randperm(n_windows, generator=gen)
        for b in range(0, n_windows - args.batch_size + 1, args.batch_size):
            starts = order[b : b + args.batch_size] * args.context
            yield torch.stack([stream[s : s + width] for s in starts.tolist()]).long()


def train_step(model, opt, batch: torch.Tensor) -> float:
    logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def make_optimizer(model, args: argparse.Namespace) -> torch.optim.AdamW:
    # No weight decay on norms (1-D params): decaying a gain toward 0 only fights the model.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def reproduce_command(total_steps: int, decay_steps: int) -> str:
    """The invocation with --minutes replaced by the step count it chose (exactly repeatable)."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--minutes", "--steps", "--decay-steps", "--decay-frac"):
            skip = True
            continue
        if a.startswith(("--minutes=", "--steps=", "--decay-steps=", "--decay-frac=")):
            continue
        argv.append(a)
    argv += ["--steps", str(total_steps), "--decay-steps", str(decay_steps)]
    return "python scripts/train_bundled_model.py " + " ".join(shlex.quote(a) for a in argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)  # exactly as invoked
    t_start = time.time()
    root = stdlib_root()

    train_files = stdlib_corpus_files("train")
    val_files = stdlib_corpus_files("val")
    print(f"corpus: {len(train_files)} train / {len(val_files)} val files from {root}", flush=True)

    t0 = time.time()
    tok = build_bytelevel_bpe(args.vocab_size, train_files)
    print(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.1f}s", flush=True)
    stream = pack_train_stream(tok, train_files)
    train_bytes = sum(f.stat().st_size for f in train_files)
    print(f"train stream: {len(stream):,} tokens ({train_bytes / len(stream):.2f} bytes/token)", flush=True)

    val_texts = [f.read_text(encoding="utf-8") for f in val_files]
    if args.val_max_bytes is not None:
        val_texts = [t[: args.val_max_bytes] for t in val_texts[:4]]
    # Quick periodic check: first 4 KB of each of the first 8 val files (a few seconds).
    quick_val = [t[:4096] for t in val_texts[:8]]

    if args.steps is not None:
        decay_steps = args.decay_steps if args.decay_steps is not None else round(args.steps * args.decay_frac)
        total_steps: int | None = args.steps
        decay_start: int | None = args.steps - decay_steps
    else:
        total_steps, decay_start, decay_steps = None, None, 0  # decided during training

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} params ({n_params * 4 / 1e6:.1f} MB fp32)", flush=True)
    opt = make_optimizer(model, args)
    data = batches(stream, args, gen)

    t_train = time.time()
    budget = args.minutes * 60
    step_times: list[float] = []
    ema = None
    history: list[dict] = []
    bar = tqdm(total=total_steps, desc="train", file=sys.stdout, mininterval=20, ncols=100)
    step = 0
    while total_steps is None or step < total_steps:
        if time.time() - t_train > budget * 1.15:
            # Safety net for a machine far slower than measured: stop rather than blow the budget.
            tqdm.write(f"time budget exceeded: stopping at step {step}", file=sys.stdout)
            break
        if total_steps is None and step >= args.warmup_steps and len(step_times) >= 20:
            # Start the decay once the remaining budget only fits the decay phase, at the
            # recent speed (the machine is shared, so only recent steps are representative).
            sec = sorted(step_times[-50:])[len(step_times[-50:]) // 2]
            d = math.ceil(step * args.decay_frac / (1 - args.decay_frac))
            if time.time() - t_train + d * sec >= budget:
                decay_start, decay_steps, total_steps = step, d, step + d
                bar.total = total_steps
                tqdm.write(f"step {step}: {sec:.2f}s/step -> cosine decay over the last {d} steps "
                           f"(total {total_steps})", file=sys.stdout)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, decay_start, decay_steps, args)
        t_step = time.perf_counter()
        loss = train_step(model, opt, next(data))
        step_times.append(time.perf_counter() - t_step)
        step += 1
        bar.update(1)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        if step % args.eval_every == 0 or step == total_steps:
            qbpb = bits_per_byte(model, tok, quick_val, context=args.context)
            history.append({"step": step, "train_loss_ema": round(ema, 4), "quick_val_bpb": round(qbpb, 4),
                            "elapsed_s": round(time.time() - t_train, 1)})
            tqdm.write(f"step {step} loss {ema:.3f} quick-val bpb {qbpb:.3f} ({time.time() - t_train:.0f}s)",
                       file=sys.stdout)
            sys.stdout.flush()
    bar.close()
    steps_done = step
    if total_steps is None:  # stopped by the safety net before deciding: record what ran
        total_steps, decay_steps = steps_done, 0
    train_seconds = time.time() - t_train
    tokens_seen = steps_done * args.batch_size * args.context

    t0 = time.time()
    val_bpb = bits_per_byte(model, tok, val_texts, context=args.context)
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    print(f"val: {val_bpb:.4f} bits/byte over {val_bytes:,} bytes ({time.time() - t0:.0f}s)", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # Stop at <|endoftext|> (documents) and <|im_end|> (chat turns).
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID).save_pretrained(out)
    # Older readers look for "torch_dtype"; newer transformers writes "dtype": keep both.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_hf_tokenizer(tok, out, model_max_length=model.config.max_position_embeddings)

    report = {
        "model": "tokenloom/py-tiny",
        "architecture": "LlamaForCausalLM",
        "params": n_params,
        "train_tokens": tokens_seen,
        "train_stream_tokens": len(stream),
        "epochs": round(tokens_seen / len(stream), 3),
        "steps": steps_done,
        "planned_steps": total_steps,  # differs from steps only if the time safety net fired
        "train_wall_seconds": round(train_seconds, 1),
        "total_wall_seconds": round(time.time() - t_start, 1),
        "val_bits_per_byte": round(val_bpb, 4),
        "val_bytes": val_bytes,
        "val_files": [f.relative_to(root).as_posix() for f in val_files],
        "train_files": len(train_files),
        "train_bytes": train_bytes,
        "history": history,
        "command": command,
        "decay_steps": decay_steps,
        "reproduce": reproduce_command(total_steps, decay_steps),
        "seed": args.seed,
        "threads": args.threads,
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "tokenizers_version": __import__("tokenizers").__version__,
        "python_version": platform.python_version(),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved to {out} ({report['total_wall_seconds']:.0f}s total)", flush=True)


if __name__ == "__main__":
    main()
