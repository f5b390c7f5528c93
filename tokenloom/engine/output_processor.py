"""OutputProcessor: sampled token ids become text, stop decisions and RequestOutputs.

The engine's step is schedule -> execute -> update; everything after that -- appending
logprobs, detokenizing, stop strings, letting the siblings of an n>1 request in, and
building the cumulative `RequestOutput`s -- happens here, one request group at a time.

Three rules shape it:

- **Outputs flow one way.**  The processor never touches the scheduler or the runner: it
  *decides* -- which samples end and why, how many trailing tokens a stop string cuts off,
  which held-back siblings may enter, whose per-request runner state can go -- and returns
  those `Decisions`; the engine applies them (`LLMEngine._apply`).  A step is therefore two
  calls: `process` (decide) and, once the engine applied what it decided, `outputs` (build
  the `RequestOutput`s from the state the decisions left).
- **One finish path.**  A sample can end because the scheduler saw a stop token / the
  length limit, because the detokenizer found a stop string, because the caller aborted,
  or because it failed.  Whoever decided it, the sample is wrapped up by `_finish_sample`
  (flush the detokenizer, release the runner's per-request state), and a group leaves the
  books only in `_retire`.
- **A failure stays with its request.**  Detokenizing, stop checks and logprob formatting
  run per request inside a `try`: if one raises, that request (all its samples) is failed
  -- its KV blocks are freed and its output carries `finish_reason="error"` and an
  `error` message -- and the other requests of the step carry on untouched.

Two kinds of request produce no sampled tokens.  An embedding request (`Group.pooling`)
ends when its prompt is computed; its output is the pooled vector the runner returned
(`EmbeddingRequestOutput`).  A beam search (`Group.beam`, engine/beam_search.py) collects
its beams' candidates each step and decides the next beams -- a `Fork` or, when the beams
fell out of step, a `Restart` -- which the engine applies like any other decision; its
output, the best finished sequences, comes once the search ends.  Neither streams
partial outputs.

Timestamps have one owner each: a sample's (`Request.first_scheduled_time`,
`first_token_time`, `last_token_time`, `finished_time`) are the scheduler's; a group keeps
only its arrival and the time it left the books, and its `RequestMetrics` are derived from
its samples whenever an output is built (`Group.metrics`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from tokenloom.core.scheduler import SchedulerOutput
from tokenloom.engine.beam_search import BeamGroup, Fork, Restart
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.faults import FaultInjector
from tokenloom.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestMetrics,
                               RequestOutput)
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.runner.model_runner import RunnerOutput

logger = logging.getLogger("tokenloom")

ERROR_FINISH_REASON = "error"


@dataclass(frozen=True)
class Finish:
    """End one sample: the engine hands it to `Scheduler.finish_request` (KV blocks freed)."""

    request: Request
    status: RequestStatus
    stop_reason: int | str | None = None
    # tokens to cut off the end of its output first: accepted drafts that came after a
    # stop string (speculative decoding) are not part of the output
    drop_tokens: int = 0


@dataclass(frozen=True)
class Decisions:
    """What output processing decided, for the engine to apply, in this order: `admit`
    (held-back siblings enter the scheduler), `finish` (each ended sample leaves it, its
    trailing tokens dropped first), `release` (the runner forgets these request ids),
    `beams` (beam searches move their beams on, or restart)."""

    admit: tuple[Request, ...] = ()
    finish: tuple[Finish, ...] = ()
    release: tuple[str, ...] = ()
    beams: tuple[Fork | Restart, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.admit or self.finish or self.release or self.beams)


@dataclass
class _Decider:
    """The decisions of one call, collected in order (mutable while the call runs)."""

    admit: list[Request] = field(default_factory=list)
    finish: dict[str, Finish] = field(default_factory=dict)  # by scheduler request id
    release: list[str] = field(default_factory=list)
    beams: list[Fork | Restart] = field(default_factory=list)

    def ended(self, req: Request) -> bool:
        """Finished by the scheduler's token rules, or decided to end in this call."""
        return req.is_finished or req.request_id in self.finish

    def freeze(self) -> Decisions:
        return Decisions(tuple(self.admit), tuple(self.finish.values()), tuple(dict.fromkeys(self.release)),
                         tuple(self.beams))


@dataclass
class Sample:
    """One of the n samples of a request: a scheduler Request plus its text state."""

    req: Request
    detok: IncrementalDetokenizer | None  # None: no text of its own (an embedding, a beam)
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    failed: bool = False  # ended by a failure, not by a stop rule: finish_reason "error"


@dataclass
class Group:
    """A user request: n samples sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    pending: list[Request]  # samples 1..n-1 held back until sample 0 has filled the prefix cache
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    finished_time: float | None = None  # when it left the books (None: still in, or aborted)
    error: str | None = None  # why the request failed (it is finished then)
    pooling: PoolingParams | None = None  # an embedding request
    embedding: list[float] | None = None  # its vector, once computed
    beam: BeamGroup | None = None  # a beam search (its beams are `samples`)

    @property
    def streams(self) -> bool:
        """Whether it has partial outputs to show while it runs (not an embedding or a beam search)."""
        return self.pooling is None and self.beam is None

    def metrics(self) -> RequestMetrics:
        """The request's figures, derived from its samples' timestamps (the scheduler's):
        first scheduled / first token = the earliest sample's, last token = the latest."""
        reqs = [s.req for s in self.samples]
        scheduled = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        first = [r.first_token_time for r in reqs if r.first_token_time is not None]
        last = [r.last_token_time for r in reqs if r.last_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(scheduled, default=None),
            first_token_time=min(first, default=None),
            last_token_time=max(last, default=None),
            finished_time=self.finished_time,
            num_preemptions=sum(r.num_preemptions for r in reqs),
        )


@dataclass(frozen=True)
class ProcessedStep:
    """What `process` decided for one step, and whose outputs `outputs` builds after the
    engine applied `decisions`: the requests failed in the step, then the others it touched."""

    decisions: Decisions
    failed: tuple[Group, ...]
    touched: tuple[Group, ...]


class OutputProcessor:
    """Owns the engine's request groups and turns each step's results into decisions and
    outputs.  It reads the scheduler's requests but never calls the scheduler or the runner."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, Group] = {}
        self.children: dict[str, tuple[Group, Sample]] = {}  # scheduler request id -> its group and sample
        self.faults: FaultInjector | None = None

    # ---- bookkeeping ----------------------------------------------------
    def add(self, group: Group) -> None:
        self.groups[group.request_id] = group
        for s in group.samples:
            self.children[s.req.request_id] = (group, s)

    def owns(self, request_id: str) -> bool:
        return request_id in self.groups or request_id in self.children

    def group_of(self, scheduler_request_id: str) -> Group | None:
        found = self.children.get(scheduler_request_id)
        return found[0] if found is not None else None

    def abort(self, request_id: str) -> Decisions | None:
        """End a request from outside (the caller gave up): it leaves the books, no output;
        the returned decisions free everything.  None if the request is unknown."""
        g = self.groups.get(request_id)
        if g is None:
            return None
        d = _Decider()
        self._end_unfinished(g, RequestStatus.FINISHED_ABORTED, d)
        self._retire(g, None)
        return d.freeze()

    # ---- failures -------------------------------------------------------
    def fail(self, g: Group, message: str, now: float,
             culprits: Iterable[Sample] = ()) -> tuple[RequestOutput, Decisions]:
        """Fail one request (all its samples) outside a step's processing: it leaves the
        books; returns its final output (`error` set; finish_reason "error" for every sample
        that had not finished yet and for the `culprits`, whose text state may be what broke)
        and the decisions that free its blocks.  The output does not depend on those
        decisions being applied: a failed sample's output reads nothing they change."""
        d = _Decider()
        self._fail(g, message, now, culprits, d)
        return self._make_output(g), d.freeze()

    def _fail(self, g: Group, message: str, now: float, culprits: Iterable[Sample], d: _Decider) -> None:
        if g.error is None:
            g.error = message
        for s in [*self._end_unfinished(g, RequestStatus.FINISHED_ABORTED, d), *culprits]:
            s.failed = True
        self._retire(g, now)

    def _end_unfinished(self, g: Group, status: RequestStatus, d: _Decider) -> list[Sample]:
        """Decide to end every sample not yet ended (also a sibling never handed to the
        scheduler) and to release every sample's runner state; returns those it ends."""
        ended = []
        g.pending = []
        for s in g.samples:
            if not d.ended(s.req):
                d.finish[s.req.request_id] = Finish(s.req, status)
                ended.append(s)
            d.release.append(s.req.request_id)
        return ended

    # ---- one step -------------------------------------------------------
    def process(self, out: SchedulerOutput, res: RunnerOutput, now: float) -> ProcessedStep:
        """Decide what one step's results (after `Scheduler.update_from_output`) mean: which
        samples end, what is trimmed, which siblings enter.  The engine applies the returned
        decisions, then calls `outputs` with the same `ProcessedStep`."""
        d = _Decider()
        touched: dict[str, Group] = {}
        failed: list[Group] = []
        for s in out.scheduled:
            found = self.children.get(s.request_id)
            if found is None:
                continue
            g, sample = found
            if g.finished:  # failed earlier in this very step
                continue
            touched[g.request_id] = g
            if g.beam is not None:  # decided once all its beams are in, below
                g.beam.collect(s.request, res.beam_candidates.get(s.request_id))
                continue
            try:
                self._apply(g, sample, s.request, res, now, d, s.emitted)
            except Exception as e:
                logger.exception("request %s failed while its output was processed; failing it alone", g.request_id)
                del touched[g.request_id]
                self._fail(g, failure_message("processing its output", e), now, [sample], d)
                failed.append(g)
        for g in list(touched.values()):
            if g.beam is None:
                continue
            try:
                self._advance_beams(g, d)
            except Exception as e:
                logger.exception("beam search %s failed; failing it alone", g.request_id)
                del touched[g.request_id]
                self._fail(g, failure_message("choosing its next beams", e), now, [], d)
                failed.append(g)
        return ProcessedStep(d.freeze(), tuple(failed), tuple(touched.values()))

    def _advance_beams(self, g: Group, d: _Decider) -> None:
        """A beam search after a step: its next beams (a fork), a restart, or its end."""
        move = g.beam.advance()
        if isinstance(move, Fork):
            for beam, _, _ in move.moves:
                if beam.request_id not in self.children:  # a new beam
                    sample = Sample(beam, None, None)
                    g.samples.append(sample)
                    self.children[beam.request_id] = (g, sample)
            d.beams.append(move)
        elif isinstance(move, Restart):
            for old in move.old:
                self.children.pop(old.request_id, None)
                d.release.append(old.request_id)
            g.samples = [Sample(move.head, None, None)]
            self.children[move.head.request_id] = (g, g.samples[0])
            d.beams.append(move)
        elif g.beam.search.done:  # every beam ends with the search
            for x in g.samples:
                d.finish[x.req.request_id] = Finish(x.req, RequestStatus.FINISHED_STOPPED)
                d.release.append(x.req.request_id)

    def outputs(self, step: ProcessedStep, now: float, finished_only: bool) -> tuple[list[RequestOutput], Decisions]:
        """The cumulative outputs of the requests `step` touched (only finished ones if
        `finished_only`), built once the engine applied `step.decisions`; plus the decisions
        for any request that failed while its output was built (the engine applies those too)."""
        d = _Decider()
        outputs = [self._make_output(g) for g in step.failed]
        for g in step.touched:
            try:
                if all(x.req.is_finished for x in g.samples):
                    self._retire(g, now)
                if g.finished or (not finished_only and g.streams):
                    outputs.append(self._make_output(g))
            except Exception as e:
                logger.exception("request %s failed while its output was built; failing it alone", g.request_id)
                self._fail(g, failure_message("building its output", e), now, g.samples, d)
                outputs.append(self._make_output(g))
        return outputs, d.freeze()

    def _apply(self, g: Group, sample: Sample, req: Request, res: RunnerOutput, now: float, d: _Decider,
               emitted: list[int] | None = None) -> None:
        """`emitted`: the tokens the scheduler appended this step (several with speculative
        decoding: accepted drafts, then the sampled token); each goes through the stop rules
        in order, and a stop string part-way drops the ones after it."""
        rid = req.request_id
        if g.pooling is not None:  # an embedding: its vector arrives with its prompt's last chunk
            vec = res.embeddings.get(rid)
            if vec is not None:
                g.embedding = vec.tolist()
                d.release.append(rid)
            return
        if g.prompt_logprobs is not None and req is g.samples[0].req and rid in res.prompt_logprobs:
            for pos, lp, rank, top in res.prompt_logprobs[rid]:
                if pos != len(g.prompt_logprobs):  # already have it (recompute after preemption)
                    continue
                g.prompt_logprobs.append(self._logprob_dict(g.prompt_token_ids[pos], lp, rank, top))
        tok = res.sampled.get(rid)
        if tok is None:  # a prefill chunk that did not reach the end of the prompt
            return
        if self.faults is not None:
            self.faults.check("detokenize", rid, g.prompt)
        tokens = emitted or [tok]
        finished_before = req.is_finished  # by the scheduler's token rules, at the last of `tokens`
        ending: Finish | None = None  # a stop this processing found (grammar or stop string)
        for i, tok in enumerate(tokens):
            if sample.logprobs is not None and rid in res.logprobs:  # (never with drafts: one token)
                lp, rank, top = res.logprobs[rid]
                sample.logprobs.append(self._logprob_dict(tok, lp, rank, top))
                sample.cumulative_logprob += lp
            if req.grammar is not None and not finished_before and ending is None:  # structured output
                if not req.grammar.accept(tok):
                    raise RuntimeError(f"token {tok} is outside the request's grammar")
                if req.grammar.terminated:  # the document is complete (it took a stop token)
                    ending = d.finish[rid] = Finish(req, RequestStatus.FINISHED_STOPPED, tok)
            stop_str = sample.detok.add(tok) if g.params.detokenize else None
            if stop_str is not None and not finished_before and ending is None:
                # accepted drafts after the stop string are not part of the output
                ending = d.finish[rid] = Finish(req, RequestStatus.FINISHED_STOPPED, stop_str,
                                                drop_tokens=len(tokens) - i - 1)
            if ending is not None:
                break
        if finished_before or ending is not None:
            self._finish_sample(sample, d)
        if g.pending and req is g.samples[0].req:
            # the prompt's blocks are cached now: let the siblings in
            d.admit.extend(g.pending)
            g.pending = []

    def _finish_sample(self, sample: Sample, d: _Decider) -> None:
        """The one place a sample that reached a stop rule (token, string or length) is wrapped up."""
        sample.detok.flush()
        d.release.append(sample.req.request_id)

    def _retire(self, g: Group, now: float | None) -> None:
        """The group is done (finished, failed or aborted): it leaves the books."""
        g.finished = True
        if now is not None:
            g.finished_time = now
        self.groups.pop(g.request_id, None)
        for x in g.samples:
            self.children.pop(x.req.request_id, None)

    # ---- output assembly --------------------------------------------------
    def _logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        d = {t: Logprob(v, i + 1, self.tokenizer.decode([t])) for i, (t, v) in enumerate(top)}
        if tok not in d:
            d = {tok: Logprob(lp, rank, self.tokenizer.decode([tok])), **d}
        return d

    def _make_output(self, g: Group) -> RequestOutput | EmbeddingRequestOutput:
        if g.pooling is not None:
            out = EmbeddingRequestOutput(request_id=g.request_id, outputs=EmbeddingOutput(g.embedding or []),
                                         prompt_token_ids=g.prompt_token_ids, finished=g.finished, prompt=g.prompt,
                                         metrics=g.metrics(), error=g.error)
            return out
        if g.beam is not None:
            return self._beam_output(g)
        comps = []
        for i, s in enumerate(g.samples):
            r = s.req
            if s.failed:
                text = _safe_text(s)
                reason: str | None = ERROR_FINISH_REASON
            else:
                text = s.detok.visible_text(r.is_finished)
                reason = r.status.value if r.is_finished else None
            comps.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=list(r.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=reason,
                stop_reason=r.stop_reason,
            ))
        out = RequestOutput(
            request_id=g.request_id,
            prompt=g.prompt,
            prompt_token_ids=g.prompt_token_ids,
            prompt_logprobs=list(g.prompt_logprobs) if g.prompt_logprobs is not None else None,
            outputs=comps,
            finished=g.finished,
            metrics=g.metrics(),
            num_cached_tokens=max(g.samples[0].req.num_cached_tokens, 0),
            lora_request=g.samples[0].req.lora_request,
        )
        out.error = g.error
        return out


    def _beam_output(self, g: Group) -> RequestOutput:
        """A beam search's output: its finished sequences, best first (while it runs, or if
        it failed part-way, those finished so far)."""
        comps = []
        for i, h in enumerate(g.beam.search.results()):
            detok = IncrementalDetokenizer(self.tokenizer, g.prompt_token_ids, g.params.skip_special_tokens, [], False)
            for tok in h.tokens:
                detok.add(tok)
            detok.flush()
            comps.append(CompletionOutput(index=i, text=detok.visible_text(True), token_ids=list(h.tokens),
                                          cumulative_logprob=h.cum_logprob, finish_reason=h.finish_reason,
                                          stop_reason=None))
        if g.error is not None and not comps:
            comps.append(CompletionOutput(index=0, text="", token_ids=[], finish_reason=ERROR_FINISH_REASON))
        out = RequestOutput(request_id=g.request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
                            prompt_logprobs=None, outputs=comps, finished=g.finished, metrics=g.metrics(),
                            num_cached_tokens=max(g.samples[0].req.num_cached_tokens, 0))
        out.error = g.error
        return out


def _safe_text(s: Sample) -> str:
    """The text released so far, without touching a detokenizer that may be what failed."""
    return s.detok.text if isinstance(getattr(s.detok, "text", None), str) else ""


def failure_message(stage: str, exc: BaseException) -> str:
    """What a failed request reports.  Names the stage and the exception's type only:
    the message may quote internals, and the server must not echo it (it is in the log)."""
    return f"the engine failed while {stage} ({type(exc).__name__}); the log has the details"
