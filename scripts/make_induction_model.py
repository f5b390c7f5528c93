#!/usr/bin/env python
"""Write a Llama checkpoint that copies from its context by construction: an induction head.

    python scripts/make_induction_model.py --out /tmp/tokenloom-induction-model [--check]

Why: n-gram speculative decoding (docs/speculative-decoding.md) pays when the output repeats
the context (code edits, extraction), and no model trained here copies (scripts/
make_copy_model.py).  This one is not trained: its weights are set so that, at every
position, it predicts the token that followed the longest recent match of its last
`--ngram` tokens earlier in the context, which is what a trained model's induction heads
learn to do.  A benchmark model, the limit case of a copier, not a language model: where
nothing matches (the `random` workload) its output is arbitrary.

The checkpoint is an ordinary one (transformers' `LlamaConfig` and `save_pretrained`, the
bundled tokenizer beside it), loaded by tokenloom and transformers alike; float32, since its
attention scores are hundreds of nats apart.  Its residual stream holds, in blocks of `--code`
dimensions: the current token's code (a random ±1 vector per vocabulary entry), the codes of
the 1..n previous tokens, and the prediction; one more dimension is always 1.

* Layer 0, one head per offset d = 1..n: query and key are constant vectors (read from the
  constant dimension) laid over the highest rotary frequencies so that, after rotary
  embedding, the score peaks where s = t - d (a sum of cosines of (s - t + d) * theta_j); the
  value is the token's code, written into the d-th "previous" block.  The offset is in the
  query, so every head shares one key/value head (grouped-query attention): the KV cache holds
  one head a layer, not n.
* Layer 1, one head: the query is (x_t, x_t-1, ..., x_t-n+1), the key (x_s-1, ..., x_s-n),
  both over the lowest rotary frequencies (rope_theta 1e20: they turn less than 1e-4 rad over
  the context), so the score counts the matching tokens; a small term rising with t - s
  prefers the earliest of equal matches.  The value is x_s's code, written to the prediction.
* The MLPs are zero; the norms' weights undo RMSNorm's scaling (every code has norm 1); the
  LM head reads the prediction block against every token's code.

`--check` reports how much of held-out code it copies: prompts of a snippet of this
repository's sources, a separator and the snippet's first line (scripts/copy_task.py, as
the `copy` workload of bench_spec_decode.py), greedy continuation through transformers.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenloom.bundled import BUNDLED_MODEL_DIR  # noqa: E402

ROPE_THETA = 1e20
POSITION_PAIRS = 40  # rotary pairs (highest frequencies) the offset heads score position with
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Shape:
    vocab: int = 4096
    ngram: int = 10  # tokens matched
    code: int = 48  # dimensions of a token's code
    position_gap: float = 30.0  # nats between the right offset and the best wrong one (layer 0)
    match: float = 40.0  # nats per matching token (layer 1)
    earliest: float = 0.3  # of `match`: the earliest-first term's range
    logit: float = 30.0  # LM head scale

    @property
    def heads(self) -> int:
        return self.ngram

    @property
    def head_dim(self) -> int:
        # The match needs ngram * code dims in pairs that barely rotate: with rope_theta 1e20, the
        # pairs from head_dim / 8 on turn by at most 1e-5 rad a position, so those pairs must
        # hold ngram * code / 2; the offset heads' pairs and the earliest-first pair lie below.
        match_pairs = (self.ngram * self.code + 1) // 2
        return max(-(-match_pairs * 8 // 3 // 64) * 64, 8 * (POSITION_PAIRS + 8))

    @property
    def hidden(self) -> int:
        width = (self.ngram + 2) * self.code + 1  # current, n previous, prediction, constant
        step = 32 * self.heads
        return -(-width // step) * step


def _theta(j: int, head_dim: int) -> float:
    return ROPE_THETA ** (-2 * j / head_dim)


def build(s: Shape, seed: int = 0) -> LlamaForCausalLM:
    """The model's weights, set as the module docstring says."""
    g = torch.Generator().manual_seed(seed)
    C, HD, H, half = s.code, s.head_dim, s.hidden, s.head_dim // 2
    const = H - 1
    block = lambda i: slice(i * C, (i + 1) * C)  # noqa: E731  0 current, 1..n previous, n+1 prediction
    pred = s.ngram + 1
    codes = (torch.randint(0, 2, (s.vocab, C), generator=g).float() * 2 - 1) / math.sqrt(C)
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=s.heads, num_key_value_heads=1, head_dim=HD,
                      rope_theta=ROPE_THETA, max_position_embeddings=4096, tie_word_embeddings=False,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float()
    w = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    w["model.embed_tokens.weight"][:, block(0)] = codes
    w["model.embed_tokens.weight"][:, const] = 1.0
    scale = math.sqrt(HD)  # transformers divides scores by it

    # layer 0: head d-1 reads the token d back.  Every head shares one key, (a, 0) in each
    # position pair, and one value, the token's code; head d's query, a (cos d theta_j,
    # -sin d theta_j), makes the score a^2 sum_j cos((s - t + d) theta_j): largest at s = t - d.
    # a is set so the next best offset within the context is position_gap lower.
    thetas = torch.tensor([_theta(j, HD) for j in range(POSITION_PAIRS)], dtype=torch.float64)
    deltas = torch.arange(1, 4096, dtype=torch.float64)
    worst = torch.cos(deltas[:, None] * thetas[None, :]).sum(1).max().item()
    a = math.sqrt(s.position_gap * scale / (POSITION_PAIRS - worst))
    L = "model.layers.0."
    w[L + "input_layernorm.weight"].fill_(math.sqrt(2.0 / H))  # rms of [code, 0..., 1]: the norm is undone
    w[L + "post_attention_layernorm.weight"].fill_(1.0)
    w[L + "self_attn.k_proj.weight"][0:POSITION_PAIRS, const] = a
    w[L + "self_attn.v_proj.weight"][0:C, block(0)] = torch.eye(C)
    for h, d in enumerate(range(1, s.ngram + 1)):
        r = h * HD
        for j in range(POSITION_PAIRS):
            w[L + "self_attn.q_proj.weight"][r + j, const] = a * math.cos(d * thetas[j].item())
            w[L + "self_attn.q_proj.weight"][r + half + j, const] = -a * math.sin(d * thetas[j].item())
        w[L + "self_attn.o_proj.weight"][block(d), r:r + C] = torch.eye(C)

    # layer 1: the induction head (head 0; the others' queries stay zero).
    L = "model.layers.1."
    w[L + "input_layernorm.weight"].fill_(math.sqrt((s.ngram + 2.0) / H))
    w[L + "post_attention_layernorm.weight"].fill_(1.0)
    pairs = list(range(half - (s.ngram * C + 1) // 2, half))  # the lowest frequencies
    assert pairs[0] >= HD // 8, "the match pairs must barely rotate"
    dims = (pairs + [half + j for j in pairs])[: s.ngram * C]
    b = math.sqrt(s.match * scale)
    for i in range(s.ngram):
        rows = dims[i * C:(i + 1) * C]
        w[L + "self_attn.q_proj.weight"][rows, block(i)] = b * torch.eye(C)  # x_{t-i}
        w[L + "self_attn.k_proj.weight"][rows, block(i + 1)] = b * torch.eye(C)  # x_{s-1-i}
    # earliest first: -e^2 cos((s - t) theta) rises with t - s while theta (t - s) < pi, over
    # contexts of up to ~1,100 tokens
    jb = min(range(POSITION_PAIRS, pairs[0]), key=lambda j: abs(_theta(j, HD) - math.pi / 1100))
    e = math.sqrt(s.earliest * s.match * scale)
    w[L + "self_attn.q_proj.weight"][jb, const] = e
    w[L + "self_attn.k_proj.weight"][jb, const] = -e
    w[L + "self_attn.v_proj.weight"][0:C, block(0)] = torch.eye(C)  # x_s
    w[L + "self_attn.o_proj.weight"][block(pred), 0:C] = torch.eye(C)
    w["model.norm.weight"].fill_(math.sqrt((s.ngram + 3.0) / H))
    w["lm_head.weight"][:, block(pred)] = s.logit * codes
    model.load_state_dict(w)
    return model


def save(model: LlamaForCausalLM, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(BUNDLED_MODEL_DIR) / name, out / name)


def check(model: LlamaForCausalLM, snippets: int, seed: int) -> dict:
    """Greedy continuations of copy prompts over this repository's sources (transformers)."""
    from copy_task import BENCH_SEPARATOR, cue_prompt, snippet_lines
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(BUNDLED_MODEL_DIR) / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tok.encode(text).ids

    rng = random.Random(seed)
    files = sorted((Path(__file__).resolve().parents[1] / "tokenloom").rglob("*.py"))
    shares, whole = [], 0
    while len(shares) < snippets:
        lines = snippet_lines(rng.choice(files).read_text(), rng, 160, encode)
        if len(lines) < 3:
            continue
        prompt, rest = cue_prompt(lines, BENCH_SEPARATOR, 1)
        ids = encode(prompt)
        want = encode(prompt + rest)[len(ids):]
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), max_new_tokens=len(want), do_sample=False)[0, len(ids):].tolist()
        k = 0
        while k < min(len(got), len(want)) and got[k] == want[k]:
            k += 1
        shares.append(k / len(want))
        whole += k == len(want)
    return {"snippets": snippets, "copied_share": round(sum(shares) / len(shares), 4), "copied_whole": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--ngram", type=int, default=Shape.ngram)
    ap.add_argument("--code", type=int, default=Shape.code)
    ap.add_argument("--check", action="store_true", help="report how much held-out code it copies")
    ap.add_argument("--check-snippets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shape = Shape(ngram=a.ngram, code=a.code)
    model = build(shape, a.seed)
    save(model, a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.out}: {n / 1e6:.1f} M parameters, hidden {shape.hidden}, {shape.heads} heads of {shape.head_dim}")
    if a.check:
        print("copy check:", check(model, a.check_snippets, a.seed + 1))


if __name__ == "__main__":
    main()
