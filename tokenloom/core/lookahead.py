"""Scheduling one step ahead (async scheduling): step N+1 chosen while step N still runs.

With `--async-scheduling` the engine launches step N+1 before step N's sampled tokens reach
the host, so the host's scheduling and input preparation overlap the device's forward pass.
The step chosen here is what `Scheduler.schedule` would choose once step N's results were in,
under the assumption that every request of step N that samples gets exactly one token:

  * its requests are exactly the running ones, each a one-token decode at the position of the
    token step N samples for it (its input id comes from step N's sampler, on the device);
  * a request whose step-N token certainly ends it (its `max_tokens`) is left out;
  * a request that ends for a reason found only with the token (EOS, a stop token or stop
    string, an abort) is in the step anyway: the engine drops that extra token when the step
    completes -- the KV slot it wrote holds the real last token, and the request's blocks were
    freed when it ended.

Whenever that assumption or the equivalence could fail, there is no step ahead (None) and the
engine waits for step N, then schedules normally: a request waits or was resumed with a free
seat (admission, prefill chunks), a running request was not a sampling decode in step N
(prefill chunk, speculative drafts, paused), its sampling reads its own output so far
(penalties, min_tokens still counting, a grammar), it is a beam (beam search picks its tokens
after the step) or an embedding, step N's token takes it past `SchedulerConfig.recompute_past`
(LongRoPE: it is then recomputed), or the KV pool cannot hold the new
position without preempting.  So a step ahead never preempts, admits or drafts, and the
tokens are the same as without it.  Pure Python, no torch.
"""

from __future__ import annotations

from tokenloom.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tokenloom.request import Request, RequestStatus


def reads_own_output(req: Request, num_output: int) -> bool:
    """Whether sampling `req`'s next token depends on its output so far, which a step ahead
    does not hold yet (`num_output`: its output length once step N's token is in)."""
    p = req.sampling_params
    if req.grammar is not None or req.beam_topk or req.pooling is not None:  # beams: the engine picks
        return True
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return True
    return bool(p.min_tokens) and num_output <= p.min_tokens


def schedule_ahead(sched: Scheduler, prev: SchedulerOutput) -> SchedulerOutput | None:
    """Step N+1 for the requests of `prev` (step N, launched, results not in yet), or None
    when it cannot be chosen before those results (see the module docstring)."""
    if sched.resumed or sched.kv.pending_copies:  # copy-on-write of beam blocks goes with a normal step
        return None
    in_prev = {id(s.request): s for s in prev.scheduled}
    picked: list[tuple[Request, int]] = []
    for req in sched.running:
        s = in_prev.get(id(req))
        if s is None or not s.sample or s.spec_token_ids or req.paused or req.status != RequestStatus.RUNNING:
            return None
        if sched.config.recompute_past == req.num_tokens:
            return None  # step N's token takes it past LongRoPE's split: it will be recomputed
        num_output = req.num_output_tokens + 1
        if num_output >= req.max_tokens:
            continue  # step N's token ends it (length)
        if reads_own_output(req, num_output):
            return None
        picked.append((req, s.num_computed_before + s.num_new_tokens))
    if not picked or (sched.waiting and len(picked) < sched.num_seats):
        return None  # nothing to run, or seats free for waiting requests once step N is in
    kv = sched.kv
    for req, pos in picked:  # room for the new position; never preempts (None instead)
        if not kv.allocate(req, pos + 1 - req.num_computed_tokens):
            return None
    sched.step_counter += 1
    scheduled = [ScheduledRequest(request=req, num_new_tokens=1, num_computed_before=pos, phase="decode",
                                  sample=True, block_ids=kv.block_ids(req.request_id)) for req, pos in picked]
    return SchedulerOutput(step=sched.step_counter, scheduled=scheduled, preempted=[],
                           num_batched_tokens=len(scheduled))
