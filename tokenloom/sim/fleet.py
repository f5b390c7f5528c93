"""A fleet of simulated replicas behind the router's own policy, on one virtual clock.

`tokenloom serve --data-parallel-size N` and `tokenloom router` spread requests over
engines with `router.policy` (round-robin, least-loaded, cache-aware).  This module runs
*those very policy classes* in front of N simulated replicas -- each one the real
`Scheduler` + `KVCacheManager` timed by the cost model, exactly as `sim.simulator` runs
one -- so "how many replicas hold P95 TTFT under 500 ms at 40 req/s?" is a few seconds
of arithmetic instead of a fleet.

Event-driven, time virtual.  The events are arrivals and step ends; at each event time T:

    1. every replica whose step ends at T applies it (update_from_output, observers);
    2. every request that has arrived by T is routed: the policy sees the prompt's token
       ids and each replica's in-flight count (running + waiting + routed, not yet admitted);
    3. every replica not in a step admits what was routed to it and, if it has work,
       starts its next step, which ends at T + the cost model's time for that batch;
    4. T moves to the earliest pending step end or next arrival.

A request routed to a busy replica waits for that replica's step to end (as a server
admits between steps); replicas advance independently.  With one replica the loop is
`Simulator.run`'s, step for step.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tokenloom.measure.metrics import RequestRecord
from tokenloom.measure.steps import StepRecorder
from tokenloom.measure.workloads import BenchRequest
from tokenloom.core.events import StepEvent
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import Scheduler, SchedulerOutput
from tokenloom.request import Request
from tokenloom.router.policy import Policy, make_policy
from tokenloom.sim.estimate import CostModel
from tokenloom.sim.simulator import CLIENT_TURNAROUND_S, Client, CostModelExecutor, SimConfig, SimResult, Simulator

DEFAULT_ROUTER = "cache-aware"  # what `serve --data-parallel-size` routes with


@dataclass
class ReplicaStats:
    """One replica's share of a fleet run."""

    index: int
    num_requests: int  # routed to it (refused requests are routed nowhere)
    num_steps: int
    busy_s: float  # virtual seconds spent in steps
    num_preemptions: int
    prefix_cache_hit_rate: float  # NaN when it saw no prefix-cache lookups

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FleetResult(SimResult):
    """`SimResult` for the whole fleet (records, steps and counts summed over replicas) plus
    each replica's share and where each request went."""

    router: str = ""
    replicas: list[ReplicaStats] = field(default_factory=list)
    replica_of: list[int | None] = field(default_factory=list)  # workload order; None: refused


class _Replica:
    """One simulated engine: a Scheduler, its KV cache, an executor and the step in flight."""

    def __init__(self, index: int, sim: Simulator, vocab: tuple[int, int], seed: int) -> None:
        self.index = index
        self.kv = KVCacheManager(sim.num_kv_blocks, sim.config.block_size, sim.config.enable_prefix_caching)
        self.sched = Scheduler(sim.scheduler_config, self.kv)
        self.executor = CostModelExecutor(sim.cost_model, vocab, seed, sim.config)
        self.recorder = StepRecorder()
        self.inbox: list[Request] = []  # routed here, admitted when the current step ends
        self.step: tuple[SchedulerOutput, dict[str, int], float, float, float] | None = None
        self.num_requests = 0
        self.busy_s = 0.0

    @property
    def load(self) -> int:
        """Requests in flight here, as the router counts them."""
        return self.sched.num_running + self.sched.num_waiting + len(self.inbox)

    def start_step(self, t: float) -> None:
        """Admit the inbox and, if there is work, schedule a step starting at `t`."""
        for req in self.inbox:
            self.sched.add_request(req)
        self.inbox.clear()
        if not self.sched.has_unfinished():
            return
        self.executor.draft(self.sched.running)
        out = self.sched.schedule()
        if out.is_empty:  # cannot happen with a valid config; never spin forever
            raise RuntimeError(f"replica {self.index}: scheduler made no progress at t={t:.6f}s with "
                               f"{self.sched.num_running} running / {self.sched.num_waiting} waiting requests")
        sampled, dt = self.executor.execute(out)
        self.step = (out, sampled, t, t + dt, dt)

    def end_step(self, observers: Sequence[Callable[[StepEvent], None]]) -> list[Request]:
        """Apply the step in flight at its end time; the requests it finished."""
        assert self.step is not None
        out, sampled, start, end, dt = self.step
        self.step = None
        self.busy_s += dt
        finished = self.sched.update_from_output(out, sampled, end, self.executor.accepted)
        event = self.sched.make_event(out, sampled, start, end, dt)
        self.recorder(event)
        for fn in observers:
            fn(event)
        return finished


class FleetSimulator(Simulator):
    """`num_replicas` copies of the simulated engine behind the router policy `router`.

    Each replica has the full KV cache and limits of `config` (one engine per device)."""

    def __init__(
        self,
        cost_model: CostModel,
        config: SimConfig = SimConfig(),
        *,
        num_replicas: int = 1,
        router: str = DEFAULT_ROUTER,
        model_max_positions: int | None = None,
        observers: Iterable[Callable[[StepEvent], None]] = (),
        replica_observers: Iterable[Callable[[int, StepEvent], None]] = (),
    ) -> None:
        super().__init__(cost_model, config, model_max_positions=model_max_positions, observers=observers)
        if num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
        make_policy(router, num_replicas)  # an unknown name fails here, not mid-run
        self.num_replicas = num_replicas
        self.router = router
        self.replica_observers = list(replica_observers)

    def make_policy(self) -> Policy:
        """A fresh policy (its turn and prefix records start empty each run)."""
        return make_policy(self.router, self.num_replicas)

    def run(self, requests: Sequence[BenchRequest], seed: int = 0, vocab_range: tuple[int, int] | None = None,
            max_concurrency: int | None = None, client_turnaround_s: float = CLIENT_TURNAROUND_S) -> FleetResult:
        """Simulate `requests` on the fleet; `max_concurrency` is the client's, over the whole fleet
        (a slot frees `client_turnaround_s` after its request's last step, as in `Simulator.run`)."""
        wall0 = time.perf_counter()
        vocab = vocab_range or (5, max(6, self.cost_model.spec.vocab_size))
        # Replica 0 samples exactly as the single-engine simulator does.
        reps = [_Replica(k, self, vocab, seed + k) for k in range(self.num_replicas)]
        policy = self.make_policy()
        everyone = list(range(self.num_replicas))

        # Plain observers see every replica's steps; replica observers are also told whose.
        rep_observers = [[*self.observers, *(functools.partial(fn, k) for fn in self.replica_observers)]
                         for k in everyone]
        records = [RequestRecord(prompt_len=r.prompt_len, arrival_time=r.arrival_time, group=r.group,
                                 expected_output_len=r.output_len) for r in requests]
        replica_of: list[int | None] = [None] * len(requests)
        client = Client(requests, records, max_concurrency, self._check)
        index_of = {f"sim-{i}": i for i in range(len(requests))}
        t = 0.0
        while client.unsent or any(r.step is not None or r.inbox or r.sched.has_unfinished() for r in reps):
            # 1. steps ending now
            for rep in reps:
                if rep.step is not None and rep.step[3] <= t:
                    for req in rep.end_step(rep_observers[rep.index]):
                        records[index_of[req.request_id]].end_time = req.finished_time
                        client.finished(t + client_turnaround_s)
            # 2. requests sent so far, routed
            for i, req in client.send(t):
                k = policy.choose(tuple(req.prompt_token_ids), everyone, [rep.load for rep in reps])
                replica_of[i] = k
                reps[k].num_requests += 1
                reps[k].inbox.append(req)
            # 3. idle replicas admit and start
            for rep in reps:
                if rep.step is None:
                    rep.start_step(t)
            # 4. the next event
            upcoming = [rep.step[3] for rep in reps if rep.step is not None]
            if (nxt := client.next_send()) is not None:
                upcoming.append(nxt)
            if not upcoming:
                if client.unsent:  # unreachable: no slot free means a request is in some step
                    raise RuntimeError(f"fleet stalled at t={t:.6f}s with {client.unsent} requests unsent")
                break
            t = max(t, min(upcoming))

        for rep in reps:
            for rid, times in rep.recorder.token_times.items():
                rec = records[index_of[rid]]
                rec.token_times = list(times)
                rec.first_token_time = times[0]
                rec.output_len = len(times)
        merged = _merge_recorders([rep.recorder for rep in reps])
        queries = sum(rep.kv.prefix_queries for rep in reps)
        hits = sum(rep.kv.prefix_hits for rep in reps)
        stats = [ReplicaStats(index=rep.index, num_requests=rep.num_requests, num_steps=len(rep.recorder.durations),
                              busy_s=rep.busy_s, num_preemptions=rep.sched.num_preemptions,
                              prefix_cache_hit_rate=(rep.kv.prefix_hits / rep.kv.prefix_queries
                                                     if rep.kv.prefix_queries else math.nan))
                 for rep in reps]
        return FleetResult(
            records=records,
            duration_s=t,
            steps=merged,
            wall_time_s=time.perf_counter() - wall0,
            num_kv_blocks=self.num_kv_blocks,
            scheduler_config=self.scheduler_config,
            num_preemptions=sum(s.num_preemptions for s in stats),
            prefix_cache_hit_rate=hits / queries if queries else math.nan,
            router=self.router,
            replicas=stats,
            replica_of=replica_of,
        )


def _merge_recorders(recorders: Sequence[StepRecorder]) -> StepRecorder:
    """One recorder holding every replica's steps (replica by replica), for the step summary."""
    out = StepRecorder()
    for r in recorders:
        out.token_times.update(r.token_times)
        for name in ("durations", "forward_times", "num_seqs", "num_decode", "num_batched_tokens",
                     "num_prefill_tokens", "num_waiting", "kv_usage"):
            getattr(out, name).extend(getattr(r, name))
        out.num_preemptions += r.num_preemptions
    return out


def simulate_fleet(requests: Sequence[BenchRequest], cost_model: CostModel, config: SimConfig = SimConfig(), *,
                   num_replicas: int = 1, router: str = DEFAULT_ROUTER, model_max_positions: int | None = None,
                   seed: int = 0, max_concurrency: int | None = None) -> FleetResult:
    """One-call form: `FleetSimulator(cost_model, config, num_replicas=..., router=...).run(requests, seed)`."""
    sim = FleetSimulator(cost_model, config, num_replicas=num_replicas, router=router,
                         model_max_positions=model_max_positions)
    return sim.run(requests, seed=seed, max_concurrency=max_concurrency)
