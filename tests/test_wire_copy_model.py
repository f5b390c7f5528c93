"""The hand-wired copy model (scripts/wire_copy_model.py) is a normal checkpoint that copies:
its layer-0 heads look at fixed distances, transformers' greedy output continues a repeated
snippet with the rest of it, and tokenloom's engine emits the same tokens as transformers
(rope_theta 1e30 and heads*head_dim != hidden included).  Seconds: nothing is trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenloom import LLM, SamplingParams

from script_modules import load_script

wcm = load_script("wire_copy_model")

# Python the model has never "seen" (it has seen nothing; its weights are set, not trained).
SNIPPET = """def merge_intervals(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class Window:
    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[float] = []"""


@pytest.fixture(scope="module")
def wired(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wired")
    args = wcm.parse_args(["--out", str(out)])
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    wcm.save(wcm.wire(args, len(tok)), args, {"test": True})
    return out


def _copy_prompt(tok) -> tuple[list[int], list[int]]:
    """snippet + separator + its first line; and the tokens of the rest of the snippet."""
    first, rest = SNIPPET.split("\n", 1)
    prompt = tok.encode(SNIPPET + "\n\n# the same code again:\n" + first)
    full = tok.encode(SNIPPET + "\n\n# the same code again:\n" + SNIPPET)
    assert full[:len(prompt)] == prompt
    return prompt, full[len(prompt):]


def test_layer0_heads_attend_at_their_distance(wired: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(wired, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(wired)
    ids = torch.tensor([tok.encode(SNIPPET)])
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions[0][0]  # layer 0: [heads, T, T]
    positions = torch.arange(ids.shape[1])
    for head in range(wcm.BACK):
        dist = head + 1
        looked = att[head, dist:].argmax(-1)
        assert torch.equal(looked, positions[dist:] - dist), f"head {head}"


def test_transformers_greedy_copies_the_snippet(wired: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(wired).eval()
    tok = AutoTokenizer.from_pretrained(wired)
    prompt, rest = _copy_prompt(tok)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    assert out == rest[:40]


def test_tokenloom_matches_transformers_and_copies(wired: Path) -> None:
    tok = AutoTokenizer.from_pretrained(wired)
    prompt, rest = _copy_prompt(tok)
    llm = LLM(str(wired), num_threads=1, max_model_len=512, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ours = list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert ours == rest[:40]
