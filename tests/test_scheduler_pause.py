"""Pausing in the scheduler (pure Python, no model): a paused request is never scheduled,
keeps its KV blocks unless memory is short, frees its seat, and -- paused and resumed at
random points, evicted or not -- finishes with exactly the tokens it would have produced
without ever being paused.

The fake executor of test_scheduler_properties checks every attended KV slot holds the
request's own token, so a resumed request that lost or mixed up its blocks fails there."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler_properties import FakeExecutor, run
from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import Scheduler
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams

workloads = st.lists(
    st.tuples(
        st.lists(st.integers(3, 12), min_size=1, max_size=40),  # prompt
        st.integers(1, 20),  # max_tokens
        st.integers(0, 10),  # arrival step
        st.integers(0, 2),  # priority
    ),
    min_size=1, max_size=8,
)
# (step, request index, pause for how many steps)
pauses = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 7), st.integers(0, 25)), max_size=12)


def run_with_pauses(workload, pause_plan, *, num_blocks, block_size, max_num_seqs, budget, max_model_len, caching,
                    policy):
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, True, policy), kv)
    exe = FakeExecutor(kv)
    reqs = [Request(f"r{i}", list(prompt), SamplingParams(max_tokens=mt, ignore_eos=True), arrival_time=float(i),
                    max_tokens=mt, priority=prio)
            for i, (prompt, mt, _, prio) in enumerate(workload)]
    arrivals = sorted(((w[2], r) for w, r in zip(workload, reqs)), key=lambda x: x[0])
    resume_at: dict[str, int] = {}
    step = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            sched.add_request(arrivals.pop(0)[1])
        for at, idx, length in pause_plan:
            if at == step and idx < len(reqs):
                r = reqs[idx]
                held = kv.block_ids(r.request_id) if r.request_id in kv.tables else []
                if sched.pause_request(r.request_id):
                    resume_at[r.request_id] = step + length
                    assert r not in sched.running and r.paused
                    # KV kept: the very same blocks
                    assert (kv.block_ids(r.request_id) if r.request_id in kv.tables else []) == held
        for rid, at in list(resume_at.items()):
            if at <= step:
                assert sched.resume_request(rid)
                del resume_at[rid]
        paused_now = {id(r) for r in sched.paused.values()}
        held_before = {rid: kv.block_ids(rid) for rid, r in sched.paused.items()
                       if r.status == RequestStatus.RUNNING}
        out = sched.schedule()
        # a paused request is never scheduled, and keeps its blocks unless evicted (then reported)
        assert not any(id(s.request) in paused_now for s in out.scheduled)
        evicted = {r.request_id for r in out.preempted}
        for rid, ids in held_before.items():
            assert rid in evicted or kv.block_ids(rid) == ids
        # seats are for running requests only: paused ones do not count
        assert len(sched.running) <= sched.num_seats
        assert out.num_batched_tokens <= budget
        sched.update_from_output(out, exe(out))
        step += 1
        assert step < 20000, "no progress"
    assert kv.pool.num_free == num_blocks and not kv.tables
    return {r.request_id: list(r.output_token_ids) for r in reqs}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, pauses, st.sampled_from([1, 2, 4, 16]), st.integers(1, 6), st.integers(1, 48), st.booleans(),
       st.sampled_from(["fcfs", "priority"]), st.booleans())
def test_pausing_is_lossless_and_paused_requests_are_never_scheduled(workload, pause_plan, block_size, max_num_seqs,
                                                                     budget, caching, policy, scarce):
    max_model_len = 64
    need = -(-max_model_len // block_size)
    paused = run_with_pauses(workload, pause_plan, num_blocks=need * (1 if scarce else 12), block_size=block_size,
                             max_num_seqs=max_num_seqs, budget=budget, max_model_len=max_model_len, caching=caching,
                             policy=policy)
    plain, _, _ = run([(p, mt, at, pr) for p, mt, at, pr in workload], num_blocks=need * 12, block_size=block_size,
                      max_num_seqs=max_num_seqs, budget=budget, max_model_len=max_model_len, caching=False,
                      policy=policy)
    assert paused == plain
    for i, (_, mt, _, _) in enumerate(workload):
        assert len(paused[f"r{i}"]) == mt


def _engine(num_blocks: int, max_num_seqs: int = 4) -> tuple[Scheduler, KVCacheManager, FakeExecutor]:
    kv = KVCacheManager(num_blocks, 4, False)
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 32), kv), kv, FakeExecutor(kv)


def _step(sched: Scheduler, exe: FakeExecutor):
    out = sched.schedule()
    sched.update_from_output(out, exe(out))
    return out


def _req(rid: str, prompt_len: int = 6, max_tokens: int = 20) -> Request:
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0,
                   max_tokens=max_tokens)


def test_a_paused_request_gives_its_seat_to_a_waiting_one_and_keeps_its_blocks():
    sched, kv, exe = _engine(num_blocks=32, max_num_seqs=1)
    a, b = _req("a"), _req("b")
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, exe)
    assert sched.running == [a] and b in sched.waiting  # one seat
    blocks = kv.block_ids("a")
    assert sched.pause_request("a")
    out = _step(sched, exe)
    assert [s.request_id for s in out.scheduled] == ["b"]  # the seat went to b
    assert kv.block_ids("a") == blocks and a.status == RequestStatus.RUNNING
    computed = a.num_computed_tokens
    assert sched.resume_request("a")
    # b holds the only seat: a waits for it with its blocks, never recomputing
    while not b.is_finished:
        out = _step(sched, exe)
        assert all(s.request_id != "a" for s in out.scheduled) or b.is_finished
    while not a.is_finished:
        out = _step(sched, exe)
        assert all(s.phase == "decode" for s in out.scheduled if s.request_id == "a")
    assert a.num_preemptions == 0 and computed > 0


def test_under_memory_pressure_a_paused_request_loses_its_blocks_first_and_recomputes():
    sched, kv, exe = _engine(num_blocks=8)  # 32 token slots
    a, b = _req("a", prompt_len=12, max_tokens=4), _req("b", prompt_len=12, max_tokens=15)
    sched.add_request(a)
    _step(sched, exe)
    assert sched.pause_request("a")
    sched.add_request(b)  # b's 27 tokens do not fit beside a's blocks
    while not b.is_finished:
        out = _step(sched, exe)
        assert all(s.request_id != "a" for s in out.scheduled)
    assert a.status == RequestStatus.PREEMPTED and "a" not in kv.tables and a.num_preemptions == 1
    assert b.num_preemptions == 0  # the running request was never the one to give way
    assert sched.resume_request("a")
    while not a.is_finished:
        _step(sched, exe)
    assert len(a.output_token_ids) == 4 and kv.pool.num_free == 8


def test_finishing_a_paused_request_frees_its_blocks():
    sched, kv, exe = _engine(num_blocks=16)
    a = _req("a")
    sched.add_request(a)
    _step(sched, exe)
    assert sched.pause_request("a") and not sched.pause_request("a")
    assert not sched.has_schedulable() and sched.has_unfinished() and sched.num_paused == 1
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free == 16 and not sched.has_unfinished() and sched.num_paused == 0
    assert not sched.resume_request("a")
