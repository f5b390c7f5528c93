"""Property tests of the block pool + scheduler (pure Python, no model).

A fake executor stands in for the model: it writes each computed token into a fake
KV store at the slot the block table says, checks that every position a request
attends to holds that request's own token (so block tables, sharing and prefix
caching are exercised for real), and "samples" a token that is a deterministic
function of the whole history — like a greedy model.  Hypothesis then hammers
random workloads and limits."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import SchedulerConfig
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import PRIORITY_PREEMPTION_LIMIT, Scheduler
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams


def _next_token(history: list[int]) -> int:
    return (hash(tuple(history)) % 97) + 3


class FakeExecutor:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.store: dict[int, int] = {}  # slot -> token id

    def __call__(self, out) -> dict[str, int]:
        bs = self.kv.block_size
        sampled = {}
        for s in out.scheduled:
            req = s.request
            table = s.block_ids
            for p in range(s.num_computed_before, s.num_computed_before + s.num_new_tokens):
                self.store[table[p // bs] * bs + p % bs] = req.token_at(p)
            end = s.num_computed_before + s.num_new_tokens
            for p in range(end):  # attention reads the whole history through the table
                assert self.store.get(table[p // bs] * bs + p % bs) == req.token_at(p), "KV holds a foreign token"
            if s.sample:
                sampled[req.request_id] = _next_token(req.all_token_ids)
        return sampled


def run(workload, *, num_blocks, block_size, max_num_seqs, budget, max_model_len, caching, chunked=True, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, policy), kv)
    exe = FakeExecutor(kv)
    reqs = []
    for i, (prompt, max_tokens, arrive_step, prio) in enumerate(workload):
        reqs.append((arrive_step, Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          arrival_time=float(i), max_tokens=max_tokens, priority=prio)))
    pending = sorted(reqs, key=lambda x: x[0])
    step = 0
    steps = []
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
        out = sched.schedule()
        steps.append(out)
        # no running request starves: each decode gets its token unless it was preempted
        served = {id(x.request) for x in out.scheduled} | {id(r) for r in out.preempted}
        assert all(id(r) in served for r in decoding), "a running decode was skipped"
        # the budgets are never exceeded
        assert out.num_batched_tokens <= budget
        assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens
        assert len(out.scheduled) <= max_num_seqs and len(sched.running) <= max_num_seqs
        # ref counts are never negative; a block in use is never on the free queue (never evictable)
        for blk in kv.pool.blocks:
            assert blk.ref_cnt >= 0
            assert (blk.ref_cnt == 0) == (blk.block_id in kv.pool.free_queue)
        for r in sched.running:
            for b in kv.tables.get(r.request_id, []):
                assert b.ref_cnt > 0
        sampled = exe(out)
        sched.update_from_output(out, sampled)
        step += 1
        assert step < 20000, "no progress"
    # idle: every block is back
    assert kv.pool.num_free == num_blocks and not kv.tables
    return {r.request_id: list(r.output_token_ids) for _, r in reqs}, sched, steps


workloads = st.lists(
    st.tuples(
        st.lists(st.integers(3, 12), min_size=1, max_size=60),  # prompt (small alphabet: prefixes repeat)
        st.integers(1, 20),  # max_tokens
        st.integers(0, 15),  # arrival step
        st.integers(0, 2),  # priority
    ),
    min_size=1, max_size=10,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.sampled_from([1, 2, 4, 16]), st.integers(1, 6), st.integers(1, 64), st.booleans(),
       st.sampled_from(["fcfs", "priority"]))
def test_scheduler_invariants_and_preemption_is_lossless(workload, block_size, max_num_seqs, budget, caching, policy):
    max_model_len = 80
    need = -(-max_model_len // block_size)
    # scarce memory: barely one full-length request -> preemption under load
    scarce, sched, _ = run(workload, num_blocks=need, block_size=block_size, max_num_seqs=max_num_seqs,
                           budget=budget, max_model_len=max_model_len, caching=caching, policy=policy)
    ample, _, _ = run(workload, num_blocks=need * 12, block_size=block_size, max_num_seqs=max_num_seqs,
                      budget=budget, max_model_len=max_model_len, caching=False, policy=policy)
    # every request finished with exactly its requested length, and the same tokens
    assert scarce == ample
    for i, (_, max_tokens, _, _) in enumerate(workload):
        assert len(scarce[f"r{i}"]) == max_tokens


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    wl = [([5] * 4, 30, 0, 0), ([7, 8, 9] * 30, 3, 2, 0)]
    _, _, steps = run(wl, num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=128, caching=False)
    mixed = [s for s in steps if {x.phase for x in s.scheduled} == {"decode", "prefill_chunk"}]
    assert mixed, "the long prompt should share steps with the short request's decodes"
    for s in mixed:
        assert [x.num_new_tokens for x in s.scheduled if x.phase == "decode"] == [1]
        assert [x.num_new_tokens for x in s.scheduled if x.phase == "prefill_chunk"] == [15]


def test_no_chunking_waits_for_a_whole_prompt_budget():
    wl = [([5] * 4, 10, 0, 0), ([6] * 40, 2, 1, 0)]
    _, _, steps = run(wl, num_blocks=64, block_size=4, max_num_seqs=4, budget=128, max_model_len=128,
                      caching=False, chunked=False)
    assert all(x.phase != "prefill_chunk" for s in steps for x in s.scheduled)


def test_prefix_cache_hit_schedules_only_uncached_tokens():
    shared = list(range(3, 35))  # 32 tokens = 8 blocks of 4
    wl = [(shared + [40, 41], 2, 0, 0), (shared + [50], 2, 5, 0)]
    _, sched, steps = run(wl, num_blocks=64, block_size=4, max_num_seqs=4, budget=256, max_model_len=128, caching=True)
    second = next(x for s in steps for x in s.scheduled if x.request_id == "r1")
    assert second.num_computed_before == 32 and second.num_new_tokens == 1
    assert sched.kv.prefix_hits == 32


def test_cache_salt_isolates_and_lru_eviction_keeps_correctness():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(4, 64, 32), kv)
    exe = FakeExecutor(kv)

    def run_one(rid, prompt, salt=None):
        r = Request(rid, prompt, SamplingParams(max_tokens=1), 0.0, max_tokens=1, cache_salt=salt)
        sched.add_request(r)
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update_from_output(out, exe(out))
        return r

    a = run_one("a", list(range(3, 20)))
    assert a.num_cached_tokens == 0
    b = run_one("b", list(range(3, 20)), salt="tenant-2")
    assert b.num_cached_tokens == 0  # another salt never sees a's blocks
    c = run_one("c", list(range(3, 20)))
    assert c.num_cached_tokens == 16
    # memory pressure: unrelated prompts evict the cached blocks; correctness is checked by FakeExecutor
    for i in range(4):
        run_one(f"x{i}", [60 + i] * 20)
    assert kv.pool.num_evictions > 0
    d = run_one("d", list(range(3, 20)))
    assert d.num_cached_tokens < 16
    assert kv.pool.num_free == 12


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(8, 64), st.sampled_from([2, 4, 8]), st.integers(1, 8), st.integers(1, 3), st.booleans())
def test_a_running_request_is_never_starved_by_urgent_long_prompts(budget, block_size, max_num_seqs, every, scarce):
    """One unimportant request (priority 10), once running, against a stream of urgent
    long prompts (priority 0, several budgets long) arriving every `every` steps for
    longer than it needs: it gets a token every step it runs, is preempted at most
    PRIORITY_PREEMPTION_LIMIT times, and finishes while the urgent stream still flows.
    (A request still *waiting* may wait behind more urgent ones: that is what priority
    scheduling means.)"""
    max_model_len = 160
    need = -(-max_model_len // block_size)
    kv = KVCacheManager(need + (0 if scarce else need * 8), block_size, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, True, "priority"), kv)
    exe = FakeExecutor(kv)
    low = Request("low", [3, 4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True), 0.0, max_tokens=40, priority=10)
    sched.add_request(low)
    n_urgent = 0
    for step in range(1000):
        if step % every == 0 and step > 0:  # from the step after it started running
            prompt = [7 + n_urgent % 5] * (2 * budget + 3 + n_urgent % 7)
            sched.add_request(Request(f"u{n_urgent}", prompt[:max_model_len - 2], SamplingParams(max_tokens=2),
                                      1.0 + step, max_tokens=2, priority=0))
            n_urgent += 1
        decoding = low.status.name == "RUNNING" and low.num_tokens - low.num_computed_tokens == 1
        out = sched.schedule()
        if decoding:
            assert any(x.request is low for x in out.scheduled) or low in out.preempted
        sched.update_from_output(out, exe(out))
        if low.is_finished:
            break
    assert low.is_finished, f"the running request starved ({low.num_output_tokens} of 40 tokens)"
    assert len(low.output_token_ids) == 40
    assert low.num_preemptions <= PRIORITY_PREEMPTION_LIMIT
