"""N-gram drafts (prompt lookup): guess the next tokens by finding the current suffix earlier.

When a model copies -- an edit of code it was shown, an extraction, a quote -- its last few
tokens have usually appeared before, and what followed them then is what comes next now.
For each request: take its last n tokens (n from `max_n` down to `min_n`, the longest
first), find their most recent earlier occurrence in prompt + output, and propose the up
to k tokens that followed it.  No model runs; the target model checks the guesses in the
next step (verify.py), so a wrong guess costs compute, never correctness.

Cost: one vectorised comparison of the last token against the history, then one
comparison per extra suffix token on the few positions still matching -- tens of
microseconds for a few thousand tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no suffix of length >= min_n recurs.

    The suffix tokens[-n:] (longest n in [min_n, max_n] that occurs earlier) is matched at
    its most recent earlier start i (i + n < len(tokens)); the draft is tokens[i+n : i+n+k],
    continued periodically where it runs past the end (the match implies the period)."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k < 1 or length < min_n + 1:
        return []
    # end positions j (< length-1) of earlier occurrences: arr[j] equals the last token
    cand = np.flatnonzero(arr[:-1] == arr[-1])
    best = cand if min_n <= 1 else None
    n = 1
    while cand.size and n < max_n:
        # extend the match one token to the left: arr[j-n] == arr[length-1-n]
        cand = cand[cand >= n]
        cand = cand[arr[cand - n] == arr[length - 1 - n]]
        n += 1
        if cand.size and n >= min_n:
            best = cand
    if best is None or not best.size:
        return []
    j = int(best[-1])  # the most recent occurrence of the longest matching suffix
    follow = arr[j + 1 : j + 1 + k].tolist()
    # Followers that run past the end continue as the drafts themselves: the text repeats with
    # period length-1-j (a loop "a b a b" drafts "a b a b", not just "a").
    period = length - 1 - j
    while len(follow) < k:
        follow.append(follow[len(follow) - period])
    return follow
