"""A request's timestamps have one owner, the scheduler, on its caller's clock (pure Python,
no model): first admission, first and latest token, end -- and a preempted request that is
admitted again keeps the time it was first scheduled."""

from __future__ import annotations

from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import Scheduler
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams


def _req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0, max_tokens=max_tokens)


def test_scheduler_sets_each_timestamp_once_on_the_callers_clock():
    sched = Scheduler(SchedulerConfig(4, 64, 64, True, "fcfs"), KVCacheManager(16, 4, False))
    a = _req("a", 6, 3)
    sched.add_request(a)
    out = sched.schedule(now=1.0)
    assert a.first_scheduled_time == 1.0 and a.first_token_time is None
    sched.update_from_output(out, {"a": 7}, 1.5)
    assert (a.first_token_time, a.last_token_time) == (1.5, 1.5)
    out = sched.schedule(now=2.0)
    sched.update_from_output(out, {"a": 8}, 2.5)
    assert (a.first_scheduled_time, a.first_token_time, a.last_token_time) == (1.0, 1.5, 2.5)
    assert a.finished_time is None
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "x", now=3.0)
    assert a.finished_time == 3.0 and a.stop_reason == "x"


def test_a_preempted_request_keeps_its_first_scheduled_time():
    # 2 blocks of 4 tokens: two requests of 4 prompt tokens fill them, and the first decode
    # needs a third block, so the later arrival is preempted and admitted again later.
    sched = Scheduler(SchedulerConfig(2, 64, 8, True, "fcfs"), KVCacheManager(2, 4, False))
    a, b = _req("a", 4, 4), _req("b", 4, 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(now=1.0)
    assert (a.first_scheduled_time, b.first_scheduled_time) == (1.0, 1.0)
    sched.update_from_output(out, {"a": 9, "b": 9}, 1.5)
    t = 2.0
    while b.num_preemptions == 0:
        out = sched.schedule(now=t)
        sched.update_from_output(out, {s.request_id: 9 for s in out.scheduled if s.sample}, t + 0.5)
        t += 1.0
    while b.status != RequestStatus.RUNNING:
        out = sched.schedule(now=t)
        sched.update_from_output(out, {s.request_id: 9 for s in out.scheduled if s.sample}, t + 0.5)
        t += 1.0
    assert b.first_scheduled_time == 1.0 and b.first_token_time == 1.5
