"""Request state as the scheduler sees it.

A request is just a token list that grows: the prompt, then one sampled token per
decode step.  `num_computed_tokens` says how much of that list already sits in the KV
cache.  Prefill is "many tokens not yet computed"; decode is "exactly one" (the token
sampled last step).  That single counter is what lets one scheduler mix prefill chunks
and decodes in the same step (vLLM v1's idea, written here from scratch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to run a request with (vLLM's `LoRARequest(name, int_id, path)`).

    `lora_name` is how clients know it (a server request's `model`); `lora_int_id`, a
    positive id, is what the engine keys it by -- its prefix-cache chain and its weight
    slot -- so one id must always mean one adapter; `lora_path` is the directory `peft`
    saved (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the model it adapts, as a server lists it (`parent`)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be a positive 64-bit integer (0 means the base model), "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's directory, got {self.lora_path!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV freed, will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved: never None here
    priority: int = 0
    cache_salt: str | None = None
    grammar: Any = None  # structured output: its tokenloom.structured.GrammarState (None: unconstrained)
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    # that adapter's loaded weights (model/lora.py `LoRAAdapter`), set by the engine
    lora_adapter: Any = field(default=None, repr=False)
    # An embedding request: prefill only; the runner pools its hidden states and it ends
    # when its prompt is computed (no token is sampled).
    pooling: PoolingParams | None = None
    # A beam of a beam search: after its last position the runner returns this many top
    # log-probabilities instead of sampling, and the engine appends the token its beam
    # search chose (engine/beam_search.py).  0: an ordinary request.
    beam_topk: int = 0
    # Batch seats it accounts for: a beam search's first beam holds one for every beam it
    # will fork into, so the forks never push the batch past max_num_seqs.
    seats: int = 1

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens at first admission (-1: not yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    chunked: bool = False  # its prompt was split over several steps this admission
    # out of the schedule until resumed (its client stopped reading); status says whether it
    # still holds its KV blocks (RUNNING) or will recompute (WAITING / PREEMPTED)
    paused: bool = False
    # prefix-cache keys (chained SHA-256 digests) of its full blocks, extended as blocks fill
    block_hashes: list[bytes] = field(default_factory=list)
    # speculative decoding: draft tokens proposed for the next step (not part of the request's
    # tokens until the model accepts them; the scheduler feeds them after the last token)
    spec_token_ids: list[int] = field(default_factory=list)
    # timestamps, each set by the scheduler only (on the clock its caller passes; None
    # without one): first admission, first / latest appended token, end
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def samples_tokens(self) -> bool:
        """Whether the scheduler appends the token sampled after its last position (not for
        an embedding, which produces none, nor a beam, whose token the beam search picks)."""
        return self.pooling is None and not self.beam_topk

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def check_stop_tokens(self) -> bool:
        """Token-level stop checks after appending a token (stop strings live in the detokenizer).

        Sets status / stop_reason and returns True when the request is done."""
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        sp = self.sampling_params
        if n >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = None
                return True
            if last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
