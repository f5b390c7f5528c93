"""Copy-task text: a snippet of code, a separator, then the snippet again (whole or edited).

Shared by `scripts/make_copy_model.py` (its training rows and the held-out copy check, which
`scripts/wire_copy_model.py` reuses) and `scripts/bench_spec_decode.py` (the `copy` and `edit`
workloads), so the benchmark asks the copy model the kind of question it is checked on.
Pure Python (no torch, no tokenizer): callers pass an `encode(text) -> list[int]` where a
length in tokens is needed.

A *cue* prompt is `snippet + separator + the snippet's first lines`, ending without a newline
so the continuation starts with "\\n" and tokenizes as it would inside the file; the expected
continuation is the rest of the snippet.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

# "\n\n" is the plain form; the commented ones say what follows (what a user's prompt might).
SEPARATORS: tuple[str, ...] = ("\n\n", "\n\n# the same code again:\n", "\n\n# edited:\n")
BENCH_SEPARATOR = "\n\n# the same code again:\n"

# Rough bytes per token of the bundled tokenizer on Python (3.2 measured on the stdlib): used to
# cut a snippet to about n tokens without re-encoding line by line.
_BYTES_PER_TOKEN = 3.0


def snippet_lines(text: str, rng: random.Random, n_tokens: int,
                  encode: Callable[[str], list[int]] | None = None) -> list[str]:
    """About n_tokens of consecutive whole lines of `text`, starting at a random non-blank line.

    With `encode`, lines are added until the snippet is at least n_tokens long; without, the
    cut is by characters (about `_BYTES_PER_TOKEN` per token).  Empty if the text has no
    non-blank line.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip()]
    if not starts:
        return []
    start = rng.choice(starts[: max(1, len(starts) - 8)])  # leave room for a few lines after it
    out: list[str] = []
    chars = 0
    for line in lines[start:]:
        out.append(line)
        chars += len(line) + 1
        if encode is not None:
            if len(encode("\n".join(out))) >= n_tokens:
                break
        elif chars >= n_tokens * _BYTES_PER_TOKEN:
            break
    while out and not out[-1].strip():  # do not end on blank lines
        out.pop()
    return out


def edited(lines: Sequence[str], rng: random.Random, donor: str) -> list[str]:
    """lines with one line (not the first) replaced by `donor`, keeping its indentation: a code
    edit, after which a copier has to find its place again."""
    out = list(lines)
    if len(out) < 2:
        return out + [donor.strip()]
    i = rng.randrange(1, len(out))
    indent = out[i][: len(out[i]) - len(out[i].lstrip())]
    out[i] = indent + donor.strip()
    return out


def copy_text(lines: Sequence[str], separator: str, second: Sequence[str] | None = None) -> str:
    """The snippet, the separator, then `second` (default: the snippet itself)."""
    return "\n".join(lines) + separator + "\n".join(lines if second is None else second)


def cue_prompt(lines: Sequence[str], separator: str, cue_lines: int) -> tuple[str, str]:
    """(prompt, expected continuation): the snippet, the separator and its first cue_lines
    lines (no trailing newline); the continuation is "\\n" + the remaining lines."""
    cue_lines = max(1, min(cue_lines, len(lines) - 1))
    prompt = "\n".join(lines) + separator + "\n".join(lines[:cue_lines])
    return prompt, "\n" + "\n".join(lines[cue_lines:])


def common_prefix_len(a: str, b: str) -> int:
    """Characters a and b share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
