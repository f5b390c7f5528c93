"""OutputProcessor: sampled token ids become text, stop decisions and RequestOutputs.

The engine's step is schedule -> execute -> update; everything after that -- appending
logprobs, detokenizing, stop strings, letting the siblings of an n>1 request in, and
building the cumulative `RequestOutput`s -- happens here, one request group at a time.

Two rules shape it:

- **One finish path.**  A sample can end because the scheduler saw a stop token / the
  length limit, because the detokenizer found a stop string, because the caller aborted,
  or because it failed.  Whoever decided it, the sample is wrapped up by `_finish_sample`
  (flush the detokenizer, drop the runner's per-request state), and a group leaves the
  books only in `_retire`.
- **A failure stays with its request.**  Detokenizing, stop checks and logprob formatting
  run per request inside a `try`: if one raises, that request (all its samples) is failed
  -- its KV blocks are freed and its output carries `finish_reason="error"` and an
  `error` message -- and the other requests of the step carry on untouched.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from tokenloom.core.scheduler import Scheduler, SchedulerOutput
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.faults import FaultInjector
from tokenloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.runner.model_runner import RunnerOutput

logger = logging.getLogger("tokenloom")

ERROR_FINISH_REASON = "error"


@dataclass
class Sample:
    """One of the n samples of a request: a scheduler Request plus its text state."""

    req: Request
    detok: IncrementalDetokenizer
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
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    error: str | None = None  # why the request failed (it is finished then)


class OutputProcessor:
    """Owns the engine's request groups and turns each step's results into outputs."""

    def __init__(self, tokenizer, scheduler: Scheduler, release: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._release = release  # drops the runner's per-request state (its sampling generator)
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

    def abort(self, request_id: str) -> Group | None:
        """End a request from outside (the caller gave up): free everything, no output."""
        g = self.groups.get(request_id)
        if g is None:
            return None
        self._end_unfinished(g, RequestStatus.FINISHED_ABORTED)
        self._retire(g, None)
        return g

    # ---- failures -------------------------------------------------------
    def fail(self, g: Group, message: str, now: float, culprits: Iterable[Sample] = ()) -> RequestOutput:
        """Fail one request (all its samples): blocks freed, books cleared; returns its
        final output (`error` set; finish_reason "error" for every sample that had not
        finished yet and for the `culprits`, whose text state may be what broke)."""
        if g.error is None:
            g.error = message
        for s in [*self._end_unfinished(g, RequestStatus.FINISHED_ABORTED), *culprits]:
            s.failed = True
        self._retire(g, now)
        return self._make_output(g)

    def _end_unfinished(self, g: Group, status: RequestStatus) -> list[Sample]:
        ended = []
        g.pending = []
        for s in g.samples:
            if not s.req.is_finished:
                self.scheduler.finish_request(s.req.request_id, status)  # frees its KV blocks
                s.req.status = status  # also for a sibling never handed to the scheduler
                ended.append(s)
            self._release(s.req.request_id)
        return ended

    # ---- one step -------------------------------------------------------
    def process(self, out: SchedulerOutput, res: RunnerOutput, start: float, now: float,
                finished_only: bool) -> list[RequestOutput]:
        """Apply one step's results (after `Scheduler.update_from_output`); returns the
        cumulative outputs of the requests it touched (only finished ones if `finished_only`)."""
        touched: dict[str, Group] = {}
        failed: list[RequestOutput] = []
        for s in out.scheduled:
            found = self.children.get(s.request_id)
            if found is None:
                continue
            g, sample = found
            if g.finished:  # failed earlier in this very step
                continue
            touched[g.request_id] = g
            try:
                self._apply(g, sample, s.request, res, start, now, s.emitted)
            except Exception as e:
                logger.exception("request %s failed while its output was processed; failing it alone", g.request_id)
                del touched[g.request_id]
                failed.append(self.fail(g, failure_message("processing its output", e), now, [sample]))
        outputs = failed
        for g in touched.values():
            try:
                if all(x.req.is_finished for x in g.samples):
                    self._retire(g, now)
                if g.finished or not finished_only:
                    outputs.append(self._make_output(g))
            except Exception as e:
                logger.exception("request %s failed while its output was built; failing it alone", g.request_id)
                outputs.append(self.fail(g, failure_message("building its output", e), now, g.samples))
        return outputs

    def _apply(self, g: Group, sample: Sample, req: Request, res: RunnerOutput, start: float, now: float,
               emitted: list[int] | None = None) -> None:
        """`emitted`: the tokens the scheduler appended this step (several with speculative
        decoding: accepted drafts, then the sampled token); each goes through the stop rules
        in order, and a stop string part-way drops the ones after it."""
        rid = req.request_id
        if g.metrics.first_scheduled_time is None:
            g.metrics.first_scheduled_time = start
        if g.prompt_logprobs is not None and req is g.samples[0].req and rid in res.prompt_logprobs:
            for pos, lp, rank, top in res.prompt_logprobs[rid]:
                if pos != len(g.prompt_logprobs):  # already have it (recompute after preemption)
                    continue
                g.prompt_logprobs.append(self._logprob_dict(g.prompt_token_ids[pos], lp, rank, top))
        tok = res.sampled.get(rid)
        if tok is None:  # a prefill chunk that did not reach the end of the prompt
            return
        if g.metrics.first_token_time is None:
            g.metrics.first_token_time = now
        g.metrics.last_token_time = now
        if self.faults is not None:
            self.faults.check("detokenize", rid, g.prompt)
        tokens = emitted or [tok]
        finished_before = req.is_finished  # by the scheduler's token rules, at the last of `tokens`
        for i, tok in enumerate(tokens):
            if sample.logprobs is not None and rid in res.logprobs:  # (never with drafts: one token)
                lp, rank, top = res.logprobs[rid]
                sample.logprobs.append(self._logprob_dict(tok, lp, rank, top))
                sample.cumulative_logprob += lp
            if req.grammar is not None and not req.is_finished:  # structured output: advance its grammar
                if not req.grammar.accept(tok):
                    raise RuntimeError(f"token {tok} is outside the request's grammar")
                if req.grammar.terminated:  # the document is complete (it took a stop token)
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, tok)
            stop_str = sample.detok.add(tok) if g.params.detokenize else None
            if stop_str is not None and not req.is_finished:
                later = len(tokens) - i - 1
                if later:  # accepted drafts after the stop string are not part of the output
                    del req.output_token_ids[-later:]
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop_str)
            if req.is_finished and not finished_before:
                break
        if req.is_finished:
            self._finish_sample(sample, now)
        if g.pending and req is g.samples[0].req:
            pending, g.pending = g.pending, []
            for p in pending:  # the prompt's blocks are cached now: let the siblings in
                self.scheduler.add_request(p)

    def _finish_sample(self, sample: Sample, now: float) -> None:
        """The one place a sample that reached a stop rule (token, string or length) is wrapped up."""
        if sample.req.finished_time is None:
            sample.req.finished_time = now
        sample.detok.flush()
        self._release(sample.req.request_id)

    def _retire(self, g: Group, now: float | None) -> None:
        """The group is done (finished, failed or aborted): it leaves the books."""
        g.finished = True
        if now is not None:
            g.metrics.finished_time = now
        g.metrics.num_preemptions = sum(x.req.num_preemptions for x in g.samples)
        self.groups.pop(g.request_id, None)
        for x in g.samples:
            self.children.pop(x.req.request_id, None)

    # ---- output assembly --------------------------------------------------
    def _logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        d = {t: Logprob(v, i + 1, self.tokenizer.decode([t])) for i, (t, v) in enumerate(top)}
        if tok not in d:
            d = {tok: Logprob(lp, rank, self.tokenizer.decode([tok])), **d}
        return d

    def _make_output(self, g: Group) -> RequestOutput:
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
            metrics=copy.copy(g.metrics),
            num_cached_tokens=max(g.samples[0].req.num_cached_tokens, 0),
        )
        out.error = g.error
        return out


def _safe_text(s: Sample) -> str:
    """The text released so far, without touching a detokenizer that may be what failed."""
    return s.detok.text if isinstance(getattr(s.detok, "text", None), str) else ""


def failure_message(stage: str, exc: BaseException) -> str:
    """What a failed request reports.  Names the stage and the exception's type only:
    the message may quote internals, and the server must not echo it (it is in the log)."""
    return f"the engine failed while {stage} ({type(exc).__name__}); the log has the details"
