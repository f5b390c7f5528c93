"""The copy-task text builder (scripts/copy_task.py) and the speculative-decoding benchmark's
`copy` / `edit` prompts built from it: what the copy model is trained on and measured with
must really ask for a copy.  No training, no engine: text and the bundled tokenizer only."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tokenloom.bundled import BUNDLED_MODEL_DIR

from script_modules import SCRIPTS, load_script

copy_task = load_script("copy_task")

SOURCE = (SCRIPTS.parent / "tokenloom" / "core" / "scheduler.py").read_text()


@pytest.mark.parametrize("seed", range(5))
def test_snippet_is_consecutive_whole_lines(seed: int) -> None:
    lines = copy_task.snippet_lines(SOURCE, random.Random(seed), 60)
    assert len(lines) >= 2 and lines[0].strip() and lines[-1].strip()
    assert "\n".join(lines) in SOURCE
    assert len("\n".join(lines)) >= 60 * 2  # about 60 tokens: not a sliver


def test_snippet_by_tokens_reaches_the_length() -> None:
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    lines = copy_task.snippet_lines(SOURCE, random.Random(1), 80, encode=tok.encode)
    n = len(tok.encode("\n".join(lines)))
    assert 80 <= n < 80 + 60  # stops at the line that crosses the length (trailing blanks dropped)


def test_cue_prompt_and_continuation_rebuild_the_copy() -> None:
    lines = ["def f(x):", "    y = x + 1", "", "    return y * 2", "# end"]
    for sep in copy_task.SEPARATORS:
        for cue in (1, 2, 4):
            prompt, expected = copy_task.cue_prompt(lines, sep, cue)
            assert prompt + expected == copy_task.copy_text(lines, sep)
            assert not prompt.endswith("\n") and expected.startswith("\n")
    assert copy_task.cue_prompt(lines, "\n\n", 99)[1] == "\n# end"  # always something left to copy


def test_edited_changes_one_later_line_and_keeps_its_indentation() -> None:
    lines = ["class A:", "    x = 1", "    y = 2", "    z = 3"]
    for seed in range(10):
        out = copy_task.edited(lines, random.Random(seed), "  new_line()")
        diff = [i for i, (a, b) in enumerate(zip(lines, out)) if a != b]
        assert len(out) == len(lines) and len(diff) == 1 and diff[0] >= 1
        assert out[diff[0]] == "    new_line()"


def test_common_prefix_len() -> None:
    assert copy_task.common_prefix_len("abcx", "abcy") == 3
    assert copy_task.common_prefix_len("ab", "abc") == 2
    assert copy_task.common_prefix_len("", "a") == 0


def test_bench_prompts_ask_for_a_copy() -> None:
    """`copy`: the text after the marker is the snippet's first line, and the snippet goes on
    from there; `edit`: the text after "# edited:" matches the snippet's start except its last
    line, and the snippet has unchanged lines left to copy."""
    bench = load_script("bench_spec_decode")
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    for ids in bench.copy_prompts(tok, 4, 120, seed=0):
        text = tok.decode(ids)
        snippet, cue = text.split(copy_task.BENCH_SEPARATOR)
        assert snippet.startswith(cue + "\n") and len(snippet) > len(cue) + 100
        assert 100 <= len(ids) < 300
    for ids in bench.edit_prompts(tok, 4, 120, seed=0):
        snippet, head = tok.decode(ids).split("\n\n# edited:\n")
        s_lines, h_lines = snippet.split("\n"), head.split("\n")
        assert len(h_lines) >= 2 and s_lines[: len(h_lines) - 1] == h_lines[:-1]
        assert s_lines[len(h_lines) - 1] != h_lines[-1] and len(s_lines) > len(h_lines)
