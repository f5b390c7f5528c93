"""`speculative_config`: vLLM's dict shape, parsed and validated once.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    tokenloom serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Pure Python (the scheduler and the simulator read it too).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

METHODS = ("ngram",)

DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
# Above this many running requests a step stops drafting: at batch 1 a decode step is bound by
# reading the weights, so verifying k more tokens is almost free; with many requests the
# step is already compute-bound and rejected drafts cost real time.  Measured here (bundled
# model, docs/speculative-decoding.md): 1.45-1.78x at batch 1, 0.91-1.10x at batch 4.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    """What speculation does: n-gram drafts of up to `num_speculative_tokens` tokens, found
    by matching the last `prompt_lookup_max`..`prompt_lookup_min` tokens earlier in the
    request; off in steps with more than `disable_by_batch_size` running requests."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; "
                             f"supported: {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A dict (the LLM keyword), a JSON string (the CLI flag), a config, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        d = dict(value)
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError('speculative_config needs "method" and "num_speculative_tokens", e.g. '
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        if "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            d["prompt_lookup_min"] = min(DEFAULT_PROMPT_LOOKUP_MIN, d["prompt_lookup_max"]) \
                if isinstance(d["prompt_lookup_max"], int) else d["prompt_lookup_max"]
        if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
            d["prompt_lookup_max"] = max(DEFAULT_PROMPT_LOOKUP_MAX, d["prompt_lookup_min"]) \
                if isinstance(d["prompt_lookup_min"], int) else d["prompt_lookup_min"]
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
