"""The constructed copying model (scripts/make_induction_model.py) through the engine.

An unusual but valid checkpoint, saved by transformers: head_dim (384) unrelated to the
hidden size (256), ten query heads sharing one KV head, rope_theta 1e20, zero MLPs,
attention scores hundreds of nats apart.  The engine must continue a copy prompt exactly
as transformers does, with and without n-gram speculation, and speculation must find the
copy (drafts accepted) — the case it is built for.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from make_induction_model import Shape, build, save  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402

SHAPE = Shape(ngram=4, code=32)


@pytest.fixture(scope="module")
def induction_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("induction")
    model = build(SHAPE, seed=0)
    save(model, out)
    return out, model


def _copy_prompts(n: int = 3) -> list[list[int]]:
    """A run of random tokens, one unrelated token, then the run's first 3 tokens again."""
    rng = random.Random(3)
    out = []
    for length in (12, 40, 70)[:n]:
        run = [rng.randrange(5, SHAPE.vocab) for _ in range(length)]
        out.append(run + [rng.randrange(5, SHAPE.vocab)] + run[:3])
    return out


def test_shape_is_what_the_docstring_says(induction_model):
    _, model = induction_model
    cfg = model.config
    assert (cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (384, 256, 4, 1)


def test_it_copies_and_the_engine_continues_as_transformers_does(induction_model):
    path, hf = induction_model
    prompts = _copy_prompts()
    n = 30
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist() for p in prompts]
    for p, r in zip(prompts, ref):  # the rest of the run, token for token
        run = p[: (len(p) - 4)]
        want = run[3:3 + n]
        assert r[:len(want)] == want
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    plain = LLM(str(path), max_model_len=256, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)] == ref
    events = []
    spec = LLM(str(path), max_model_len=256, num_kv_blocks=64, observers=[events.append],
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 2})
    for p, r in zip(prompts, ref):  # one at a time: speculation runs at batch 1
        assert spec.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids == r
    drafted = sum(e.num_draft_tokens for e in events)
    accepted = sum(e.num_accepted_tokens for e in events)
    assert drafted > 0 and accepted >= 0.8 * drafted  # copying: nearly every draft is right
