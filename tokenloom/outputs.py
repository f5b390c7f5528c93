"""What a request gives back, vLLM-shaped: RequestOutput / CompletionOutput / RequestMetrics.

`metrics` carries the seed's per-request figures: arrival, first token (TTFT), finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.request import LoRARequest


# One position's logprobs: token id -> Logprob (the sampled token is always included).
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine refused the request (LLM.generate keeps going)
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran with (None: the base model)


# ---- embeddings (vLLM's EmbeddingRequestOutput shape) -------------------------------------

@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector (normalised where the model or request says so)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request gives back: one vector for the whole prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine refused or failed the request


# ---- beam search (vLLM's BeamSearchOutput shape) ------------------------------------------

@dataclass
class BeamSearchSequence:
    """One finished beam.  As in vLLM, `tokens` are the prompt's followed by the generated
    ones and `text` decodes them all; `output_token_ids` / `output_text` are the generated
    part alone."""

    tokens: list[int]
    cum_logprob: float
    text: str
    output_token_ids: list[int]
    output_text: str
    score: float  # what ranked it: cum_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str | None = None  # "stop" (an EOS token) | "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
