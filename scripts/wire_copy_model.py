#!/usr/bin/env python
"""Build, by hand, a 2-layer Llama whose weights implement an induction circuit: a model that
copies from its prompt, for benchmarking n-gram speculative decoding.

Why by hand: `scripts/make_copy_model.py` trains such a model from scratch and, in the CPU
time tried (its docstring), the loss on repeated random runs plateaus before copying appears.
The circuit it has to find is small and well understood, so this script writes it into an
ordinary LlamaForCausalLM checkpoint (transformers' LlamaConfig + save_pretrained, the bundled
tokenizer beside it); tokenloom and transformers load and run it as any model, nothing
special-cased.  It is a benchmark model: it copies; where there is nothing to copy its output
means nothing.

The circuit (hidden 256, heads of 128, MLPs zero, tied embeddings, rope_theta 1e30):
  * embeddings: token t is a random unit code r_t in dims A (48 dims), plus a constant 1 in
    one dim K, a content-free direction for attention to build positions from;
  * layer 0, BACK = 16 previous-token heads: head i's query and key come only from K, so its
    score depends only on the distance; the key is pre-rotated by RoPE's angles for i + 1
    positions, so the score peaks there (only RoPE's fast pairs are used).  Head i copies
    the first MATCH = 7 dims of the attended token's code into its own slot: each position
    now holds short codes of the 16 tokens before it;
  * layer 1, one induction head: the query holds the codes of the last 16 tokens (the current
    one and 15 before it), the key at j those of the 16 tokens before j, weighted 16..1 from
    the nearest: j scores by how long a suffix of the text so far ends just before it, the
    nearest tokens weighing most, and the head copies r_j (the token that followed) into A
    with gain `--gain`.  Query and key use RoPE's slowest pairs, which turn < 0.25 rad over
    512 positions, so the match is by content;
  * the final norm keeps A only, and the tied head scores every token by r_t against it: the
    copied token wins.
With a 4-token match the check below reproduced 2 of 16 held-out snippets whole (repeated
short runs in code, such as `",\n            "`, sent it elsewhere); 16 tokens settle most.
Where the text so far occurs nowhere before, the output is arbitrary.

The check printed (the same as make_copy_model.py's, on the held-out stdlib split): prompt =
snippet + "\n\n" + its first third of lines; greedy continuation vs the rest of the snippet
(figures: docs/speculative-decoding.md, "A model that really copies").

  python scripts/wire_copy_model.py --out /tmp/tokenloom-copy-model     # ~1 minute, mostly the check
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_copy_model import copy_check, save  # noqa: E402

from tokenloom.bundled import BUNDLED_MODEL_DIR  # noqa: E402
from tokenloom.model.tools.tokenizer_builder import BOS_ID, EOS_ID, PAD_ID, stdlib_corpus_files  # noqa: E402

HIDDEN, HEAD_DIM, CODE = 256, 128, 48
BACK, MATCH = 16, 7  # the match compares the last BACK tokens, MATCH dims of each one's code
HEADS = BACK  # layer 0 uses all of them, layer 1 one (transformers wants hidden % heads == 0)
WEIGHTS = tuple(float(BACK - i) for i in range(BACK))  # the current token weighs most
# Residual dims: A the token's code; BACK_DIMS[i] the first MATCH dims of the code of the token
# i + 1 back (written by layer 0's head i); K a constant.
A = slice(0, CODE)
BACK_DIMS = [slice(CODE + i * MATCH, CODE + (i + 1) * MATCH) for i in range(BACK)]
K = CODE + BACK * MATCH
ROPE_THETA = 1e30
MAX_POSITIONS = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/tokenloom-copy-model"))
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL_DIR, help="where the tokenizer files come from")
    p.add_argument("--prev-margin", type=float, default=30.0,
                   help="layer 0: attention-logit lead of the intended distance over any other")
    p.add_argument("--match-scale", type=float, default=10.0,
                   help="layer 1: attention logit per matching token (times its weight)")
    p.add_argument("--gain", type=float, default=10.0, help="layer 1: size of the copied code against the current one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-snippets", type=int, default=32)
    p.add_argument("--eval-snippet-tokens", type=int, default=120)
    return p.parse_args(argv)


def rope_angles() -> torch.Tensor:
    """RoPE's angle per position for each of a head's HEAD_DIM/2 pairs (pair p: dims p, p+64)."""
    return 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))


def distance_pairs(theta: torch.Tensor) -> list[int]:
    """Pairs that turn fast enough to tell one distance from the next (>= 0.01 rad a position)."""
    return [p for p in range(len(theta)) if theta[p] >= 0.01]


def content_pairs(theta: torch.Tensor) -> list[int]:
    """Pairs that turn < 0.25 rad over the whole context: they carry content, not position."""
    return [p for p in range(len(theta)) if theta[p] * MAX_POSITIONS < 0.25]


def distance_peak_margin(theta: torch.Tensor, pairs: list[int]) -> float:
    """sum_p cos(theta_p * 0) minus the largest sum_p cos(theta_p * n) over other distances n."""
    n = torch.arange(-MAX_POSITIONS + 1, MAX_POSITIONS, dtype=torch.float64)
    score = torch.cos(theta[pairs][:, None] * n[None, :]).sum(0)
    return float(score[MAX_POSITIONS - 1] - score[n != 0].max())


@torch.no_grad()
def wire(args: argparse.Namespace, vocab: int) -> LlamaForCausalLM:
    """The circuit of the module docstring in a fresh LlamaForCausalLM (every other weight 0)."""
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, rope_theta=ROPE_THETA,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        p.zero_()
    gen = torch.Generator().manual_seed(args.seed)
    # Unit codes whose first MATCH dims (what the match compares) have the same norm for all.
    first = torch.randn(vocab, MATCH, generator=gen, dtype=torch.float64)
    tail = torch.randn(vocab, CODE - MATCH, generator=gen, dtype=torch.float64)
    codes = torch.cat([first / first.norm(dim=1, keepdim=True) * math.sqrt(MATCH / CODE),
                       tail / tail.norm(dim=1, keepdim=True) * math.sqrt(1 - MATCH / CODE)], dim=1)

    emb = model.model.embed_tokens.weight
    emb[:, A] = codes.float()
    emb[:, K] = 1.0
    theta = rope_angles()
    eye = torch.eye(CODE)

    # Layer 0: the residual is one embedding, |e|^2 = 2, so the norm scales it by s0.
    l0 = model.model.layers[0]
    l0.input_layernorm.weight.fill_(1.0)
    l0.post_attention_layernorm.weight.fill_(1.0)
    s0 = math.sqrt(HIDDEN / 2)
    pairs = distance_pairs(theta)
    a = math.sqrt(args.prev_margin * math.sqrt(HEAD_DIM) / distance_peak_margin(theta, pairs))
    q, k, v, o = (l0.self_attn.q_proj.weight, l0.self_attn.k_proj.weight,
                  l0.self_attn.v_proj.weight, l0.self_attn.o_proj.weight)
    for head, dest in enumerate(BACK_DIMS):
        dist = head + 1
        base = head * HEAD_DIM
        for p in pairs:
            q[base + p, K] = a / s0
            k[base + p, K] = a * math.cos(theta[p] * dist) / s0
            k[base + p + HEAD_DIM // 2, K] = a * math.sin(theta[p] * dist) / s0
        v[base:base + MATCH, A.start:A.start + MATCH] = torch.eye(MATCH) / s0
        o[dest, base:base + MATCH] = torch.eye(MATCH)

    # Layer 1: the residual holds a unit code, BACK short codes of norm^2 MATCH/CODE and the
    # constant.
    l1 = model.model.layers[1]
    l1.input_layernorm.weight.fill_(1.0)
    l1.post_attention_layernorm.weight.fill_(1.0)
    s1 = math.sqrt(HIDDEN / (2 + BACK * MATCH / CODE))
    slow = content_pairs(theta)
    dims = slow + [p + HEAD_DIM // 2 for p in slow]
    assert len(dims) >= BACK * MATCH, "not enough slow RoPE pairs for the match"
    # Query part i is the token i back from here (weight WEIGHTS[i]), key part i the token
    # i + 1 back from j: each matching token adds WEIGHTS[i] * match_scale to the logit of j,
    # so j is where the text so far is best matched (nearest tokens first), and the head
    # copies j's token, the one that followed there.
    w = math.sqrt(args.match_scale * math.sqrt(HEAD_DIM) * CODE / MATCH) / s1
    q, k, v, o = (l1.self_attn.q_proj.weight, l1.self_attn.k_proj.weight,
                  l1.self_attn.v_proj.weight, l1.self_attn.o_proj.weight)
    here = [slice(A.start, A.start + MATCH)] + BACK_DIMS[:-1]
    for i in range(BACK):
        d = dims[i * MATCH:(i + 1) * MATCH]
        q[d, here[i]] = torch.eye(MATCH) * WEIGHTS[i] * w
        k[d, BACK_DIMS[i]] = torch.eye(MATCH) * w
    v[:CODE, A] = eye / s1          # what j is
    o[A, :CODE] = eye * args.gain   # added to the current code

    model.model.norm.weight[A] = 1.0  # the head reads A only
    return model


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = wire(args, len(tok)).eval()
    val_texts = [f.read_text(encoding="utf-8") for f in stdlib_corpus_files("val")]
    check = copy_check(model, tok, val_texts, args.eval_snippets, args.eval_snippet_tokens, args.seed)
    print(f"copy check (held-out): {check}", flush=True)
    report = {
        "purpose": "benchmark model for n-gram speculative decoding: copies from its prompt (wired, not trained)",
        "copy_check": check,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
    }
    save(model, argparse.Namespace(out=args.out, tokenizer=args.tokenizer), report)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
