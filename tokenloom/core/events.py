"""Step events: what one engine step did, in the seed's vocabulary.

The seed explains decode as a sequence of steps ("step1: A B C D / step2: A B C").
Every engine step (real or simulated) emits one `StepEvent` describing exactly that:
which requests were in the batch, in which phase (prefill / prefill chunk / decode),
how many tokens each fed, how long its KV history was before and after, and what
token was sampled.  Metrics, benchmarks, the trace and the simulator all consume
these events through the observer API (`LLMEngine.add_observer`).

Pure Python on purpose: the simulator produces the same events without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol

Phase = Literal["prefill", "prefill_chunk", "decode"]


@dataclass
class StepEntry:
    """One request's share of one step."""

    request_id: str
    phase: Phase
    num_tokens: int  # tokens fed to the model for this request in this step
    token_ids: list[int]  # the tokens fed (prompt chunk, or the one decode input token)
    kv_len_before: int  # tokens already in this request's KV cache
    kv_len_after: int  # kv_len_before + num_tokens
    num_prompt_tokens: int
    sampled_token_id: int | None = None  # None when a prefill chunk does not reach the end
    num_cached_tokens: int = 0  # prefix-cache hits counted when the request was admitted
    finished: bool = False
    finish_reason: str | None = None
    # speculative decoding (docs/speculative-decoding.md): drafts fed after the decode token,
    # how many of them the model accepted, and every token the step appended to the request
    # (accepted drafts, then the sampled one; cut at a stop) -- sampled_token_id is its last
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 0
    generated_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepEvent:
    """Everything one step did. Times are seconds on the engine's clock
    (time.perf_counter for the real engine, the virtual clock in the simulator)."""

    step: int
    start_time: float
    end_time: float
    forward_time: float  # time inside the model: forward pass + logits (the rest of the step is engine overhead)
    entries: list[StepEntry] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling
    waiting: list[str] = field(default_factory=list)  # ids still waiting after scheduling
    num_running: int = 0
    num_waiting: int = 0
    num_batched_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time

    @property
    def num_decode(self) -> int:
        return sum(1 for e in self.entries if e.phase == "decode")

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.phase != "decode")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified in this step (speculative decoding)."""
        return sum(len(e.draft_token_ids) for e in self.entries)

    @property
    def num_accepted_tokens(self) -> int:
        """Draft tokens the model accepted in this step."""
        return sum(e.num_accepted_tokens for e in self.entries)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens appended to requests in this step (one per sampling request without drafts)."""
        return sum(len(e.generated_token_ids) if e.generated_token_ids else e.sampled_token_id is not None
                   for e in self.entries)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["duration"] = self.duration
        d["num_draft_tokens"] = self.num_draft_tokens
        d["num_accepted_tokens"] = self.num_accepted_tokens
        return d


class StepObserver(Protocol):
    """Anything callable with a StepEvent can observe the engine."""

    def __call__(self, event: StepEvent) -> None: ...
