"""Recording a trace: the engine's own step events, plus what each request was.

The seed explains decode as a list of steps.  The engine already reports each step
it runs as a `StepEvent` through its public observer API; the trace only *listens*
(`TraceRecorder` is an observer) and, once `LLM.generate` returns, adds what the
outputs say about each request (prompt, tokens, arrival / first-token / finish
times).  Nothing is re-enacted: every number a renderer shows comes from here.

A `Trace` is plain data and round-trips through JSON (`--json`), so a saved trace can
be rendered again without the model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from tokenloom.core.events import StepEntry, StepEvent
from tokenloom.trace.tokens import TokenPiece, build_token_table

TRACE_FORMAT_VERSION = 1


class TraceRecorder:
    """An observer: keeps every StepEvent the engine emits, in order."""

    def __init__(self) -> None:
        self.events: list[StepEvent] = []

    def __call__(self, event: StepEvent) -> None:
        self.events.append(event)


@dataclass
class SampleInfo:
    """One sequence the scheduler ran (a request, or one of its n samples)."""

    request_id: str  # the id StepEntries carry
    label: str  # the seed's letter: A, B, C ... (A1, A2 for n > 1)
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None


@dataclass
class RequestInfo:
    """A user request, as LLM.generate's output describes it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleInfo]
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.output_token_ids) for s in self.samples)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: the seed's decode step, as one request feels it.

        With n > 1 samples decoding side by side, tokens are counted per sample (max over samples)."""
        n = max((len(s.output_token_ids) for s in self.samples), default=0)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)


@dataclass
class Trace:
    """Everything a renderer needs: settings, requests, step events, token strings."""

    model: str
    settings: dict[str, Any]
    requests: list[RequestInfo]
    events: list[StepEvent]
    tokens: dict[int, TokenPiece] = field(default_factory=dict)
    created: float = field(default_factory=time.time)

    # ---- lookups ------------------------------------------------------
    def samples(self) -> list[SampleInfo]:
        return [s for r in self.requests for s in r.samples]

    def label_of(self, request_id: str) -> str:
        for s in self.samples():
            if s.request_id == request_id:
                return s.label
        return request_id

    def request_of(self, request_id: str) -> RequestInfo | None:
        for r in self.requests:
            if any(s.request_id == request_id for s in r.samples):
                return r
        return None

    @property
    def t0(self) -> float:
        """Time origin: the earliest arrival (or the first step's start)."""
        times = [r.arrival_time for r in self.requests if r.arrival_time is not None]
        if self.events:
            times.append(self.events[0].start_time)
        return min(times) if times else 0.0

    @property
    def wall_time(self) -> float:
        if not self.events:
            return 0.0
        return self.events[-1].end_time - self.t0

    @property
    def total_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    # ---- JSON ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": "tokenloom-trace",
            "version": TRACE_FORMAT_VERSION,
            "created": self.created,
            "model": self.model,
            "settings": self.settings,
            "requests": [_request_to_dict(r) for r in self.requests],
            "steps": [e.to_dict() for e in self.events],
            "tokens": {str(k): v.to_dict() for k, v in sorted(self.tokens.items())},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        if d.get("format") != "tokenloom-trace":
            raise ValueError("not a tokenloom trace (expected the JSON that `tokenloom trace --json` writes)")
        requests = []
        for r in d["requests"]:
            r = dict(r)
            for k in ("ttft", "tpot", "queue_time", "num_output_tokens"):
                r.pop(k, None)
            r["samples"] = [SampleInfo(**s) for s in r["samples"]]
            requests.append(RequestInfo(**r))
        events = []
        for s in d["steps"]:
            s = dict(s)
            for derived in ("duration", "num_draft_tokens", "num_accepted_tokens"):
                s.pop(derived, None)
            s["entries"] = [StepEntry(**e) for e in s["entries"]]
            events.append(StepEvent(**s))
        tokens = {int(k): TokenPiece.from_dict(v) for k, v in d.get("tokens", {}).items()}
        return cls(model=d["model"], settings=d.get("settings", {}), requests=requests, events=events,
                   tokens=tokens, created=d.get("created", 0.0))


def _request_to_dict(r: RequestInfo) -> dict:
    d = asdict(r)
    # derived figures are written too, so the JSON is useful on its own
    d.update(ttft=r.ttft, tpot=r.tpot, queue_time=r.queue_time, num_output_tokens=r.num_output_tokens)
    return d


def letter(i: int) -> str:
    """0 -> A, 25 -> Z, 26 -> AA: the seed's request names."""
    s = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        s = chr(ord("A") + rem) + s
    return s


def _sample_ids(request_id: str, n: int, seen: list[str]) -> list[str]:
    """The scheduler-level ids of a request's samples, as the step events spell them."""
    if n == 1:
        return [request_id]
    # The engine names sample i of request R "R-i"; prefer what the events actually show.
    ids = [f"{request_id}-{i}" for i in range(n)]
    if all(x in seen for x in ids) or not any(x in seen for x in ids):
        return ids
    return [x for x in seen if x.startswith(f"{request_id}-")][:n]


def build_trace(llm: Any, outputs: Sequence[Any], events: list[StepEvent], *, settings: dict[str, Any] | None = None) -> Trace:
    """Assemble a Trace from the recorded events and LLM.generate's outputs."""
    engine = llm.llm_engine
    seen: list[str] = []
    for e in events:
        for en in e.entries:
            if en.request_id not in seen:
                seen.append(en.request_id)
    requests: list[RequestInfo] = []
    for i, out in enumerate(outputs):
        comps = list(out.outputs)
        ids = _sample_ids(out.request_id, len(comps), seen)
        base = letter(i)
        samples = [
            SampleInfo(request_id=sid, label=base if len(comps) == 1 else f"{base}{j + 1}",
                       output_token_ids=list(c.token_ids), output_text=c.text, finish_reason=c.finish_reason)
            for j, (sid, c) in enumerate(zip(ids, comps))
        ]
        m = out.metrics
        requests.append(RequestInfo(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids), samples=samples,
            arrival_time=getattr(m, "arrival_time", None), first_scheduled_time=getattr(m, "first_scheduled_time", None),
            first_token_time=getattr(m, "first_token_time", None), last_token_time=getattr(m, "last_token_time", None),
            finished_time=getattr(m, "finished_time", None), num_preemptions=getattr(m, "num_preemptions", 0) or 0,
            num_cached_tokens=out.num_cached_tokens, error=getattr(out, "error", None),
        ))
    all_ids: set[int] = set()
    for r in requests:
        all_ids.update(r.prompt_token_ids)
        for s in r.samples:
            all_ids.update(s.output_token_ids)
    for e in events:
        for en in e.entries:
            all_ids.update(en.token_ids)
            if en.sampled_token_id is not None:
                all_ids.add(en.sampled_token_id)
            all_ids.update(en.generated_token_ids)
    return Trace(model=str(engine.model_name), settings=dict(settings or {}), requests=requests, events=list(events),
                 tokens=build_token_table(engine.tokenizer, all_ids))


def engine_settings(llm: Any) -> dict[str, Any]:
    """The knobs that shape the steps (shown in the header, kept in the JSON)."""
    args = llm.engine_args
    sc = llm.llm_engine.scheduler_config  # resolved values (e.g. the default token budget)
    return {
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "device": str(llm.llm_engine.device),
        "dtype": str(args.dtype),
    }


def run_trace(llm: Any, prompts: Sequence[Any], params: Any = None, *, extra_settings: dict[str, Any] | None = None) -> Trace:
    """Run `prompts` through `llm.generate` while recording its steps; return the Trace."""
    rec = TraceRecorder()
    llm.llm_engine.add_observer(rec)
    try:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
    finally:
        llm.llm_engine.remove_observer(rec)
    settings = engine_settings(llm)
    if params is not None:
        settings["sampling"] = dataclasses.asdict(params)
    settings.update(extra_settings or {})
    return build_trace(llm, outputs, rec.events, settings=settings)
