"""Speculative decoding: cheap guesses of the next tokens, checked by the model in one step.

`config.py` parses vLLM's `speculative_config` dict, `ngram.py` proposes drafts from the
request's own tokens (prompt lookup), `verify.py` accepts or rejects them from the target
model's logits.  docs/speculative-decoding.md explains the whole path and its figures.
"""

from tokenloom.spec_decode.config import SpeculativeConfig
from tokenloom.spec_decode.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
