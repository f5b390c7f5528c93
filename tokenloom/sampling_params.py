"""SamplingParams: how each decode step picks the next token (the seed's "greedy / sampling").

Names and meanings follow vLLM / the OpenAI API.  `validate()` raises a `ValueError`
that names the offending field, so the HTTP layer can answer 400 with `param` set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence


class SamplingParamError(ValueError):
    """A ValueError that remembers which field was wrong."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a formal language (vLLM's name and fields): exactly one of a
    JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a
    regular expression (`regex`), one of a list of strings (`choice`), or an EBNF grammar
    (`grammar`, GBNF style with a `root` rule).  The grammar is compiled by
    `tokenloom.structured`; here only the shape is checked.  Properties are generated in the
    schema's own order."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # frozen, and comparable with an equal tuple
            object.__setattr__(self, "choice", tuple(self.choice))

    def spec(self) -> tuple[str, str]:
        """(kind, text): what the grammar is compiled from, and the compile cache's key.
        A JSON schema is written out again (compactly), so equal schemas share a key."""
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise SamplingParamError("structured_outputs", "exactly one of json, json_object, regex, choice, grammar "
                                     f"must be given, got {', '.join(set_) or 'none'}")
        kind = set_[0]
        if kind == "json_object":
            return kind, ""
        if kind == "json":
            v: Any = self.json
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError as e:
                    raise SamplingParamError("structured_outputs", f"json: the schema is not valid JSON ({e})") from None
            if not isinstance(v, (dict, bool)):
                raise SamplingParamError("structured_outputs", "json: the schema must be a JSON object")
            return kind, json.dumps(v, ensure_ascii=False, separators=(",", ":"))
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamError("structured_outputs", "choice: must be a non-empty list of non-empty strings")
            return kind, json.dumps(list(self.choice), ensure_ascii=False)
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise SamplingParamError("structured_outputs", f"{kind}: must be a non-empty string")
        return kind, text


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning model's think tags, as token ids (the server's `--reasoning-parser`).

    With them, structured output constrains only the *answer*: the grammar waits while the
    model reasons and starts after `end_token_id` (`tokenloom.structured.reasoning_gate`).
    Where the output begins (`starts_inside`): a tag among the prompt's last `PROMPT_TAIL`
    tokens decides, as a template puts it there for the model -- an open `start_token_id`
    (the thinking opened for it) means inside, `end_token_id` (thinking switched off,
    `<think></think>` ending the prompt) means the answer; tags further back belong to the
    conversation, not to this turn.  With none, `implicit_start` models (DeepSeek-R1, which
    may begin reasoning without writing `<think>`) start inside, and the others are
    undecided: they reason only if their first token is `start_token_id`."""

    PROMPT_TAIL = 4  # "<think>" + "\n", "</think>" + "\n\n": a tag and the newlines after it

    start_token_id: int
    end_token_id: int
    implicit_start: bool = False

    def starts_inside(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """True: the output starts inside the reasoning; False: in the answer; None: the
        first output token decides (it is `start_token_id` or the answer begins)."""
        start, end = self.start_token_id, self.end_token_id
        for t in reversed(prompt_token_ids[-self.PROMPT_TAIL:]):
            if t == start:
                return True
            if t == end:
                return False
        return True if self.implicit_start else None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output (tokenloom.structured)
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older spelling of structured_outputs
    reasoning_tags: ReasoningTags | None = None  # structured output then constrains only the answer

    @property
    def constrains_logits(self) -> bool:
        """Whether the sampler must change raw logits (bias or allow-list) before choosing."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise SamplingParamError("guided_decoding", "give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamError(param, msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1/0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        # Sample i of n is seeded with seed + i, and torch.Generator takes -2**63 .. 2**64 - 1: so
        # every signed 64-bit seed works whatever n is (the HTTP API's documented range).
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - self.n):
            bad("seed", f"must be an integer in [-2**63, 2**64 - n] (torch.Generator's range), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"bias of token {t} must be a number in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad("allowed_token_ids", f"must be non-negative integers, got {t!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.spec()  # exactly one constraint, of the right type
        tags = self.reasoning_tags
        if tags is not None:
            if not isinstance(tags, ReasoningTags):
                bad("reasoning_tags", "must be a ReasoningTags")
            ids = (tags.start_token_id, tags.end_token_id)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids) or ids[0] == ids[1]:
                bad("reasoning_tags", f"start and end must be two different token ids, got {ids}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by these params must exist in the model's vocabulary (a stop id
        beyond it could never be sampled: accepting it would hide the client's mistake)."""
        for param, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                           ("stop_token_ids", self.stop_token_ids or ()),
                           ("reasoning_tags", (self.reasoning_tags.start_token_id, self.reasoning_tags.end_token_id)
                            if self.reasoning_tags is not None else ())):
            bad_ids = [t for t in ids if t >= vocab_size]
            if bad_ids:
                raise SamplingParamError(param, f"token id {bad_ids[0]} is out of range for a vocabulary of {vocab_size}")


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search (vLLM's `LLM.beam_search` parameters, plus transformers' `early_stopping`).

    Keeps the `beam_width` most probable continuations at every step and returns the
    `beam_width` best finished ones.  Scoring is transformers' (`generate(num_beams=...)`):
    a finished sequence scores its summed log-probability divided by
    (generated tokens) ** `length_penalty`; `early_stopping` is transformers' too -- True
    stops once `beam_width` sequences finished, False (the default) once no running beam can
    plausibly beat the worst finished one, "never" only when none can (docs/beam-search.md).
    `temperature` is accepted for vLLM's signature and must be 0: the search is deterministic
    and scores the model's own log-probabilities."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamError(param, msg)

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            bad("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature != 0:
            bad("temperature", f"beam search is deterministic here: only 0 is accepted, got {self.temperature!r}")
        lp = self.length_penalty
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not -10 <= lp <= 10:
            bad("length_penalty", f"must be a number in [-10, 10], got {lp!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            bad("early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}")

    @property
    def n(self) -> int:
        """Sequences the request returns (and holds at once): one per beam."""
        return self.beam_width
