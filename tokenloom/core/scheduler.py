"""The continuous-batching scheduler: who gets computed in the next step, and how much.

The seed's picture of continuous batching is

    step1: A B C D
    step2: A B C
    step3: A B

Every step, each *running* request gets one more token computed (a decode), and
whatever token budget is left goes to *waiting* requests' prompts (prefill).  Two
limits bound a step, exactly the seed's two knobs:

  * `max_num_seqs`            — how many requests may be in the batch;
  * `max_num_batched_tokens`  — how many tokens the step may feed the model.

There are no prefill/decode "modes": a request simply has `num_computed_tokens` and
`num_tokens`; the scheduler hands it `num_new_tokens` of the gap.  A long prompt whose
gap exceeds the remaining budget is **chunked** across steps and shares each step with
the decodes of other requests, so one long prompt cannot freeze everyone's decode (the
seed's P95 story).  When KV blocks run out, the most recently arrived running request
is **preempted**: its blocks are freed and it goes back to the front of the queue to be
recomputed later, losing nothing but time.

No running request starves.  Each step serves every running decode (one token each)
before any prefill chunk, and never admits more requests than one step can give a
token to (`min(max_num_seqs, max_num_batched_tokens)` seats), so a request that is
generating gets its next token every step, however many long or urgent prompts
arrive.  Under `--scheduling-policy priority` the least urgent request is the one
preempted, but only `PRIORITY_PREEMPTION_LIMIT` times: after that it is *aged* — it
ranks ahead of every request not yet preempted that often, in the queue and when a
victim is chosen — so a stream of urgent arrivals cannot keep pushing it out.

Speculative decoding: a running request may carry draft tokens (`Request.spec_token_ids`,
set by the engine's proposer before `schedule`).  Its decode then feeds 1 + len(drafts)
tokens, which take KV slots and count against the token budget like any other token;
drafts are dropped (never anyone preempted for them) when the budget or the KV pool is
short, and each later decode of the step keeps its budget.  `update_from_output` appends
the accepted drafts and the sampled token one by one, applying stop rules to each, and
rolls the rest back: `num_computed_tokens` counts only accepted positions (the rejected
slots are overwritten later), and blocks past the request's tokens go back to the pool.

Requests that produce no sampled token: an embedding request (`Request.pooling`) is
prefill only -- once its prompt is computed it finishes, its blocks are freed, and the
runner has pooled its hidden states on the way (chunk by chunk).  A beam of a beam search
(`Request.beam_topk`) gets no token appended either: the engine's beam search picks the
next token of every beam from all their candidates and calls `fork_beams`, which moves
each beam onto the sequence (tokens and KV blocks, shared copy-on-write) it continues.  A
beam waiting for that computes nothing (all its tokens are computed) but keeps its seat.
A beam search's first beam holds a seat for every beam it will fork into (`Request.seats`).

Long-context rotation (`SchedulerConfig.recompute_past`, Phi-3's LongRoPE): the model
rotates a whole sequence one way up to that many tokens and another beyond, so the step a
request grows past it, its cached K/V no longer hold.  It is recomputed then, as
transformers recomputes it: its blocks are freed and it goes back to the front of the
queue to prefill all its tokens again (drafts never carry it across).  The KV manager keys
the blocks of such long requests apart from short ones' (`KVCacheManager.regime_split`).

Pausing: a request whose client stops reading its stream can be taken out of the schedule
without being ended (`pause_request`).  It leaves `running` -- so its seat goes to someone
else -- but keeps its KV blocks, and `resume_request` puts it back: one that still holds
its blocks rejoins `running` at the start of the next step with a free seat (before any
waiting request is admitted), one without goes to the front of the waiting queue.  While
paused it is the first to give its blocks up under memory pressure (before any running
request is preempted, and before a waiting request is refused for want of blocks); it
then recomputes on resume, exactly like a preempted request.

Driving it (the engine and the simulator do exactly this, nothing else):

    sched = Scheduler(SchedulerConfig(...), KVCacheManager(num_blocks, block_size))
    sched.add_request(Request(...))
    while sched.has_unfinished():
        out = sched.schedule(now)                   # SchedulerOutput
        sampled = executor(out)                     # {request_id: token_id} for out.scheduled with .sample
        finished = sched.update_from_output(out, sampled, now)

A request's timestamps are the scheduler's to set, and only its (`now` is the caller's
clock; without one they stay None): `first_scheduled_time` at its first admission,
`first_token_time` / `last_token_time` when tokens are appended, `finished_time` when it
ends here (stop rules, `finish_request`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.events import Phase, StepEntry, StepEvent
from tokenloom.request import Request, RequestStatus


PRIORITY_PREEMPTION_LIMIT = 1
"""Preemptions a request yields to more urgent ones before it keeps its place (priority policy)."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_before: int
    phase: Phase
    sample: bool  # the step reaches the end of the request's tokens: sample the next one
    block_ids: list[int] = field(default_factory=list)
    # speculative decoding: draft tokens fed after the request's last token (a decode of
    # 1 + len(spec_token_ids) tokens); the model's verdict arrives with the sampled token
    spec_token_ids: list[int] = field(default_factory=list)
    # set by update_from_output: tokens appended to the request this step, in order, and how
    # many of the drafts the model accepted
    emitted: list[int] = field(default_factory=list)
    num_accepted: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_batched_tokens: int
    # copy-on-write of shared KV blocks (beam search): (source, copy) block ids, in order;
    # the runner copies them before the forward pass
    kv_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # paused (out of the schedule, KV kept unless evicted), oldest pause first
        self.paused: dict[str, Request] = {}
        # resumed with their KV still held: rejoin `running` as seats free up
        self.resumed: deque[Request] = deque()
        self.step_counter = 0
        self.num_preemptions = 0
        self.num_recomputes = 0  # requests recomputed for growing past `config.recompute_past`
        if kv.num_blocks * kv.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {kv.num_blocks} blocks x {kv.block_size} tokens = "
                f"{kv.num_blocks * kv.block_size} tokens, less than --max-model-len ({config.max_model_len}); "
                f"raise --num-kv-blocks / --kv-cache-memory or lower --max-model-len"
            )

    # ---- queue management -------------------------------------------
    def add_request(self, req: Request, front: bool = False) -> None:
        """Queue a request (at the front of the queue with `front`: a restarted one)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} has {req.num_tokens} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        if req.seats > self.num_seats:
            raise ValueError(f"request {req.request_id!r} needs {req.seats} batch seats at once, more than a step "
                             f"holds ({self.num_seats}: --max-num-seqs and --max-num-batched-tokens)")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.paused or self.resumed)

    def has_schedulable(self) -> bool:
        """Whether `schedule()` can have work: something runs, waits or was resumed
        (paused requests alone give a step nothing to do)."""
        return bool(self.waiting or self.running or self.resumed)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None,
                       now: float | None = None) -> Request | None:
        """End a request from outside (abort, stop string): free its blocks at once.
        None if the scheduler does not hold it (unknown, finished, never added)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.paused.pop(request_id, None) is None:
            self._unqueue(req)
        req.paused = False
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        if now is not None and req.finished_time is None:
            req.finished_time = now
        self.kv.free(req)
        return req

    def _unqueue(self, req: Request) -> None:
        """Take `req` out of whichever of running, waiting and resumed holds it."""
        if req in self.running:
            self.running.remove(req)
            return
        for queue in (self.waiting, self.resumed):
            try:
                queue.remove(req)
                return
            except ValueError:
                pass

    # ---- pausing -----------------------------------------------------
    def pause_request(self, request_id: str) -> bool:
        """Take an unfinished request out of the schedule, keeping its KV blocks and its
        place in the books; False if it is unknown, finished or paused already."""
        req = self.requests.get(request_id)
        if req is None or req.paused:
            return False
        self._unqueue(req)
        req.paused = True
        req.spec_token_ids = []  # drafts are proposed afresh when it runs again
        self.paused[request_id] = req
        return True

    def resume_request(self, request_id: str) -> bool:
        """Give a paused request back to the schedule; False if it is not paused."""
        req = self.paused.pop(request_id, None)
        if req is None:
            return False
        req.paused = False
        if req.status == RequestStatus.RUNNING:  # still holds its blocks: needs only a seat
            self.resumed.append(req)
        else:  # never admitted, or evicted while paused: (re)computes from the queue's front
            self.waiting.appendleft(req)
        return True

    def _evict_paused(self) -> Request | None:
        """Free the blocks of the longest-paused request that holds any (it recomputes when
        resumed); None if no paused request holds blocks."""
        for req in self.paused.values():
            if req.status == RequestStatus.RUNNING:
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.chunked = False
                req.status = RequestStatus.PREEMPTED
                req.num_preemptions += 1
                self.num_preemptions += 1
                return req
        return None

    def _allocate(self, req: Request, num_new: int, evicted: list[Request], hit=None) -> bool:
        """`kv.allocate`, evicting paused requests' blocks while that is what stands in the way."""
        while not self.kv.allocate(req, num_new, hit):
            victim = self._evict_paused()
            if victim is None:
                return False
            evicted.append(victim)
        return True

    def _seat_resumed(self) -> None:
        """Resumed requests that kept their blocks rejoin the batch while seats remain (and
        their LoRA adapter fits beside the running ones')."""
        if not self.resumed:
            return
        taken = self._seats_taken()
        active = self._active_loras()
        skipped: deque[Request] = deque()
        while self.resumed and taken + self.resumed[0].seats <= self.num_seats:
            req = self.resumed.popleft()
            if not self._lora_fits(req, active):
                skipped.append(req)
                continue
            taken += req.seats
            self.running.append(req)
        self.resumed.extendleft(reversed(skipped))

    # ---- LoRA adapters -------------------------------------------------
    def _active_loras(self) -> set[int]:
        """The adapters the running requests use (none tracked without a --max-loras bound)."""
        if not self.config.max_loras:
            return set()
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, req: Request, active: set[int]) -> bool:
        """Whether `req` may join the running requests without more than --max-loras different
        adapters among them (a step runs each adapter from one of that many weight slots);
        adds its adapter to `active` when it may.  The base model takes no slot."""
        lid = req.lora_int_id
        if not lid or not self.config.max_loras or lid in active:
            return True
        if len(active) >= self.config.max_loras:
            return False
        active.add(lid)
        return True

    def _seats_taken(self) -> int:
        """Seats the running requests hold (a beam search's unforked first beam holds several)."""
        return len(self.running) + sum(r.seats - 1 for r in self.running if r.seats > 1)

    # ---- one step ---------------------------------------------------
    def _preempt_victim(self, scheduled: set[int]) -> Request:
        """The least entitled running request not yet scheduled in this step.

        `running` is kept in rank order (admission order under fcfs, `_rank` under
        priority), so that is the last one not already handed tokens."""
        for k in range(len(self.running) - 1, -1, -1):
            if id(self.running[k]) not in scheduled:
                return self.running.pop(k)
        raise RuntimeError("no running request left to preempt")

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.chunked = False
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _recompute(self, req: Request) -> None:
        """`req` grew past `config.recompute_past`: free its K/V and queue it to prefill all
        its tokens again (a paused request stays paused, to recompute when resumed)."""
        self.kv.free(req)
        req.block_hashes = []  # its blocks are keyed in the long regime from now on
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.chunked = False
        req.status = RequestStatus.PREEMPTED
        self.num_recomputes += 1
        if not req.paused:
            self.running.remove(req)
            self.waiting.appendleft(req)

    @staticmethod
    def _phase(req: Request, computed: int, num_new: int) -> Phase:
        """What `num_new` tokens from `computed` on are for this request (a query: it reads
        `req.chunked`, which `_make` sets first, and changes nothing)."""
        if req.num_output_tokens > 0 and computed == req.num_tokens - 1 and num_new == 1:
            return "decode"
        return "prefill_chunk" if req.chunked else "prefill"

    @staticmethod
    def _rank(r: Request) -> tuple[bool, int, float]:
        """Priority-policy order: aged requests first (by arrival), then (priority, arrival)."""
        aged = r.num_preemptions >= PRIORITY_PREEMPTION_LIMIT
        return (not aged, 0 if aged else r.priority, r.arrival_time)

    def _order(self) -> None:
        if self.config.scheduling_policy == "priority":
            self.running.sort(key=self._rank)
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    @property
    def num_seats(self) -> int:
        """How many requests may run at once: each must get a token in every step."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick the step's requests and token counts.  `now`: the caller's clock, recorded as
        `first_scheduled_time` of requests admitted for the first time (None: not recorded)."""
        cfg = self.config
        self._seat_resumed()
        self._order()
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        evicted: list[Request] = []  # paused requests whose blocks were taken back in this step
        served: set[int] = set()  # id() of the requests scheduled so far in this step

        # 1) running requests first: every decode (1 token), then unfinished prefill chunks
        #    in rank order.  Decodes fit: at most num_seats <= budget requests run.
        work = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        num_decodes = len(work)
        if len(work) < len(self.running):
            work += [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        for i, req in enumerate(work):
            if budget <= 0:
                break
            if req.status == RequestStatus.PREEMPTED:
                continue  # a victim of an earlier request in this step
            computed = req.num_computed_tokens
            num_new = min(req.num_tokens - computed, budget)
            if num_new <= 0:
                continue
            drafts: list[int] = []
            if req.spec_token_ids and i < num_decodes:
                # drafts take what budget the later decodes of this step do not need
                room = budget - 1 - (num_decodes - i - 1)
                drafts = req.spec_token_ids[:max(0, room)]
                split = cfg.recompute_past
                if split is not None and req.num_tokens <= split:
                    drafts = drafts[:split - req.num_tokens]  # a step never carries it across
                if drafts and not self.kv.can_allocate(req, 1 + len(drafts)):
                    drafts = []  # memory is short: no request is preempted for a guess
                num_new += len(drafts)
            while not self._allocate(req, num_new, evicted):
                victim = self._preempt_victim(served)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                continue  # it was the least entitled itself
            served.add(id(req))
            scheduled.append(self._make(req, computed, num_new, drafts))
            budget -= num_new

        # 2) waiting requests, in queue order, while budget and seats remain.
        #    Not in a step that had to preempt: memory is short, admitting more would thrash.
        #    A request whose LoRA adapter would be one too many for --max-loras keeps its
        #    place in the queue and is passed over until a running adapter is done.
        if not preempted:
            seats = self._seats_taken()
            active = self._active_loras()
            skipped: deque[Request] = deque()
            while self.waiting and budget > 0 and seats + self.waiting[0].seats <= self.num_seats:
                req = self.waiting[0]
                if not self._lora_fits(req, active):
                    skipped.append(self.waiting.popleft())
                    continue
                hit = self.kv.find_cached_prefix(req)
                cached_tokens = hit.num_tokens(self.kv.block_size)
                remaining = req.num_tokens - cached_tokens
                if not cfg.enable_chunked_prefill and remaining > budget:
                    break  # a whole prompt must fit in one step; keep FCFS order
                num_new = min(remaining, budget)
                req.num_computed_tokens = cached_tokens
                if not self._allocate(req, num_new, evicted, hit):
                    req.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:  # first admission: this is what users see as cached
                    req.num_cached_tokens = cached_tokens
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self.kv.record_prefix_query(req.num_tokens, cached_tokens)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                seats += req.seats
                scheduled.append(self._make(req, cached_tokens, num_new))
                budget -= num_new
            self.waiting.extendleft(reversed(skipped))

        self.step_counter += 1
        return SchedulerOutput(
            step=self.step_counter,
            scheduled=scheduled,
            preempted=preempted + evicted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
            kv_copies=self.kv.take_copies(),
        )

    def _make(self, req: Request, computed: int, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        if drafts:  # a decode that also checks drafts
            return ScheduledRequest(request=req, num_new_tokens=num_new, num_computed_before=computed,
                                    phase="decode", sample=True, block_ids=self.kv.block_ids(req.request_id),
                                    spec_token_ids=list(drafts))
        if computed + num_new < req.num_tokens:
            req.chunked = True  # its prompt is split over several steps this admission
        phase = self._phase(req, computed, num_new)
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new,
            num_computed_before=computed,
            phase=phase,
            sample=computed + num_new == req.num_tokens,
            block_ids=self.kv.block_ids(req.request_id),
        )

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int], now: float | None = None,
                           accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token stop rules.

        `accepted`: per request that fed drafts, the drafts the model accepted (a prefix of
        them); they are appended before its sampled token, each checked for stop rules, and a
        request that stops part-way drops the rest.  Returns the requests that finished in
        this step (their blocks are already free)."""
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            if not s.sample or not req.samples_tokens:
                req.num_computed_tokens = s.num_computed_before + s.num_new_tokens
                self.kv.cache_full_blocks(req)
                if s.sample:
                    req.chunked = False
                    if req.pooling is not None:  # an embedding: its prompt is all it computes
                        req.status = RequestStatus.FINISHED_STOPPED
                        self._end(req, now)
                        finished.append(req)
                continue
            req.chunked = False
            acc = accepted.get(req.request_id, []) if (accepted and s.spec_token_ids) else []
            s.num_accepted = len(acc)
            s.emitted = []
            done = False
            before = req.num_tokens
            for tok in (*acc, sampled[req.request_id]):
                req.output_token_ids.append(tok)
                s.emitted.append(tok)
                if req.check_stop_tokens():
                    done = True
                    break
            # Rejected drafts' positions are not computed: their KV slots get overwritten.
            rejected = len(s.spec_token_ids) - len(acc)
            req.num_computed_tokens = min(s.num_computed_before + s.num_new_tokens - rejected, req.num_tokens)
            split = self.config.recompute_past
            crossed = split is not None and before <= split < req.num_tokens
            if not crossed:  # a crossing request's blocks are not published: its keys change regime
                self.kv.cache_full_blocks(req)
            if now is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
            if done:
                self._end(req, now)
                finished.append(req)
            elif crossed:
                self._recompute(req)
            elif rejected:
                self.kv.trim(req, req.num_tokens)
        return finished

    def _end(self, req: Request, now: float | None) -> None:
        """A running request that finished by its own rules leaves: blocks freed."""
        if self.paused.pop(req.request_id, None) is not None:  # paused while its step ran (async)
            req.paused = False
        else:
            self._unqueue(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req)
        req.finished_time = now

    # ---- beam search ----------------------------------------------------
    def fork_beams(self, moves: list[tuple[Request, Request, int]], now: float | None = None) -> None:
        """Beam search's step: each (beam, parent, token) -- `beam` now continues `parent`'s
        sequence with `token`: it takes the parent's generated tokens and (shared, copied on
        write) KV blocks, then `token` is appended.  A beam not yet known here (a new fork)
        joins the running batch on the seat its first beam held for it.  Every parent must
        have all its tokens computed (it produced the candidates `token` came from)."""
        for _, parent, _ in moves:
            if parent.num_computed_tokens != parent.num_tokens or parent.request_id not in self.requests:
                raise RuntimeError(f"beam {parent.request_id} forked before its candidates were computed")
        outputs = {id(p): list(p.output_token_ids) for _, p, _ in moves}
        hashes = {id(p): list(p.block_hashes) for _, p, _ in moves}
        self.kv.fork([(beam, parent) for beam, parent, _ in moves])
        for beam, parent, token in moves:
            beam.output_token_ids = outputs[id(parent)] + [token]
            beam.block_hashes = hashes[id(parent)]
            beam.num_computed_tokens = parent.num_computed_tokens
            beam.spec_token_ids = []
            if beam.request_id not in self.requests:  # a new fork: seated by the first beam's reservation
                beam.status = RequestStatus.RUNNING
                beam.num_cached_tokens = parent.num_cached_tokens
                beam.first_scheduled_time = parent.first_scheduled_time
                self.requests[beam.request_id] = beam
                self.running.append(beam)
            if now is not None:
                if beam.first_token_time is None:
                    beam.first_token_time = now
                beam.last_token_time = now
        for beam, parent, _ in moves:
            parent.seats = 1  # its reservation is used up by the forks
            beam.seats = 1

    # ---- observability ----------------------------------------------
    def make_event(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        start_time: float,
        end_time: float,
        forward_time: float,
    ) -> StepEvent:
        """The StepEvent for a step, built after update_from_output."""
        entries = []
        for s in out.scheduled:
            req = s.request
            c = s.num_computed_before
            if s.spec_token_ids:
                fed = [req.token_at(c), *s.spec_token_ids]
            else:
                fed = [req.token_at(c)] if s.num_new_tokens == 1 else req.token_slice(c, c + s.num_new_tokens)
            rejected = len(s.spec_token_ids) - s.num_accepted
            entries.append(
                StepEntry(
                    request_id=req.request_id,
                    phase=s.phase,
                    num_tokens=s.num_new_tokens,
                    token_ids=fed,
                    kv_len_before=s.num_computed_before,
                    kv_len_after=s.num_computed_before + s.num_new_tokens - rejected,
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampled_token_id=(s.emitted[-1] if s.emitted else sampled.get(req.request_id)) if s.sample else None,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    finished=req.is_finished,
                    finish_reason=req.status.value if req.is_finished else None,
                    draft_token_ids=list(s.spec_token_ids),
                    num_accepted_tokens=s.num_accepted,
                    generated_token_ids=list(s.emitted),
                )
            )
        return StepEvent(
            step=out.step,
            start_time=start_time,
            end_time=end_time,
            forward_time=forward_time,
            entries=entries,
            preempted=[r.request_id for r in out.preempted],
            waiting=[r.request_id for r in self.waiting],
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_batched_tokens=out.num_batched_tokens,
            kv_blocks_used=self.kv.pool.num_used,
            kv_blocks_total=self.kv.num_blocks,
        )
