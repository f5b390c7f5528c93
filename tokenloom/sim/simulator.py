"""Simulator: the real Scheduler and KV cache on a virtual clock.

The seed's continuous batching ("step1: A B C D / step2: A B C / step3: A B") and its
two knobs (max-num-seqs, max-num-batched-tokens) are decided by `core.scheduler` and
`core.kv_cache`.  This module runs *those very classes* -- no copy of their logic --
and replaces only the executor: instead of a forward pass, each step advances a
virtual clock by the roofline `CostModel` time of the batch it was handed (weights
read once, KV read per request, FLOPs per token), and "samples" a seeded pseudo-random
token.  So "what would P95 TTFT be on an H100 with --max-num-batched-tokens 512?" takes
seconds on a laptop, with the same queueing, chunking, preemption and prefix-cache
behaviour the engine has.

Driving loop (mirrors `bench.offline.run_with_arrivals`, with time virtual):

    t = 0
    while requests remain:
        add every request whose arrival_time <= t
        if something is unfinished:  out = schedule(); t += cost(out); update_from_output(out, tokens, t)
        else:                        t = next arrival   (an idle engine just waits)

A request arriving during a step is admitted when the step ends, as on a server.  The
same `StepEvent`s the engine emits go to observers, and per-request timelines become
`bench.metrics.RequestRecord`s, so the summary is the one `bench serve` prints.

Speculative decoding is modelled by its two figures: `num_speculative_tokens` drafts per
decode (the scheduler gives them KV slots and budget, the cost model prices the 1 + k token
verification like any short chunk) and `spec_mean_accepted`, the mean drafts accepted per
verifying step (measure it with scripts/bench_spec_decode.py); acceptances are spread
evenly with a per-request running credit, so a request emits 1 + accepted tokens a step.

What it cannot know: there is no model, so output lengths are the workload's (EOS is
never sampled), and step times are roofline estimates -- calibrate `CostModel`'s
efficiencies and overheads against `bench latency` / `bench roofline` on real hardware.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

from tokenloom.measure.metrics import RequestRecord
from tokenloom.measure.steps import StepRecorder
from tokenloom.measure.workloads import BenchRequest
from tokenloom.config import EngineArgs, EngineConfig, SchedulerConfig, default_max_num_batched_tokens, parse_size
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import Scheduler, SchedulerOutput
from tokenloom.core.events import StepEvent
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.estimate import CostModel
from tokenloom.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory for weights + KV


# A closed-loop client (`bench serve --max-concurrency`) sends its next request when the last
# token of one reaches it: that token leaves the engine at a step's end, the new request
# reaches the engine a few milliseconds later, by which time the engine -- which steps back
# to back -- has begun its next step, so the newcomer waits for that step to end.  Modelling
# the trip as zero admits it one step early (a step of several hundred ms with prefill
# chunks in it, on a CPU).  Measured on localhost: 1-5 ms.
CLIENT_TURNAROUND_S = 0.002


class Client:
    """The load generator's side of a simulation (`Simulator.run`, `FleetSimulator.run`): the
    requests in arrival order, each sent once it has arrived and, with `max_concurrency`, a
    client slot is free (`bench serve --max-concurrency`).  The slots are a min-heap of the
    times they free; a request held back for one gets its record's `send_time` then, and its
    latencies count from it.  A request `check` refuses is recorded as failed at once and its
    slot is free again."""

    def __init__(self, requests: Sequence[BenchRequest], records: list[RequestRecord], max_concurrency: int | None,
                 check: Callable[[BenchRequest], str | None]):
        self.requests, self.records, self.check = requests, records, check
        self.order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_time, i))
        self.nxt = 0  # how many of `order` were sent
        self.slots: list[float] | None = [0.0] * max_concurrency if max_concurrency else None

    @property
    def unsent(self) -> int:
        return len(self.order) - self.nxt

    def _can_send(self, t: float) -> bool:
        return (self.nxt < len(self.order) and self.requests[self.order[self.nxt]].arrival_time <= t
                and (self.slots is None or (bool(self.slots) and self.slots[0] <= t)))

    def send(self, t: float) -> Iterable[tuple[int, Request]]:
        """Every request sent by `t` and not refused: (its index, the engine's Request for it)."""
        while self._can_send(t):
            i = self.order[self.nxt]
            self.nxt += 1
            r, rec = self.requests[i], self.records[i]
            if self.slots is not None:
                free_at = heapq.heappop(self.slots)
                if free_at > r.arrival_time:  # held back by the client until a slot freed
                    rec.send_time = free_at
            err = self.check(r)
            if err is not None:
                rec.success, rec.error = False, err
                if self.slots is not None:  # refused at once: its slot is free again
                    heapq.heappush(self.slots, rec.start)
                continue
            yield i, Request(
                request_id=f"sim-{i}",
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0,
                                               detokenize=False),
                arrival_time=rec.start,
                max_tokens=r.output_len,
            )

    def finished(self, at: float) -> None:
        """A request's last token reached the client at `at`: its slot is free from then."""
        if self.slots is not None:
            heapq.heappush(self.slots, at)

    def next_send(self) -> float | None:
        """When the next request can be sent (its arrival, or a slot freeing if later); None
        when none is left or every slot waits on a request in flight."""
        if not self.unsent or self.slots == []:
            return None
        return max(self.requests[self.order[self.nxt]].arrival_time, self.slots[0] if self.slots else 0.0)


@dataclass(frozen=True)
class SimConfig:
    """Engine knobs the simulated scheduler runs with (same names and defaults as `EngineArgs`)."""

    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int | None = None  # None: the engine's default for max_model_len
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = EngineArgs.block_size
    num_kv_blocks: int | None = None  # None: from kv_cache_memory, else from device memory
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    scheduling_policy: str = EngineArgs.scheduling_policy
    # speculative decoding: drafts per decode (0: off), mean drafts accepted per verifying
    # step, and the running-request count above which no step drafts
    num_speculative_tokens: int = 0
    spec_mean_accepted: float = 0.0
    spec_disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_engine_config(cls, ec: EngineConfig) -> "SimConfig":
        """The limits a real engine resolved (`EngineConfig`), KV blocks included."""
        return cls(max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
                   max_model_len=ec.max_model_len, block_size=ec.block_size, num_kv_blocks=ec.num_kv_blocks,
                   enable_chunked_prefill=ec.scheduler.enable_chunked_prefill,
                   enable_prefix_caching=ec.enable_prefix_caching, scheduling_policy=ec.scheduler.scheduling_policy)

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_max_model_len(cfg: SimConfig, model_max_positions: int | None) -> int:
    return int(cfg.max_model_len or model_max_positions or 4096)


def num_kv_blocks_for(cfg: SimConfig, cost_model: CostModel) -> int:
    """KV blocks as the engine would size them on the simulated device.

    Explicit `num_kv_blocks` wins; else `kv_cache_memory` bytes; else what is left of
    `gpu_memory_utilization` x device memory after the weights (vLLM's rule).
    """
    if cfg.num_kv_blocks is not None:
        return int(cfg.num_kv_blocks)
    per_block = cfg.block_size * cost_model.kv_bytes_per_token
    if cfg.kv_cache_memory is not None:
        budget = parse_size(cfg.kv_cache_memory)
    else:
        weights = cost_model.total_weight_bytes  # quantized where the cost model is
        budget = int(cost_model.hardware.memory_bytes * cfg.gpu_memory_utilization) - weights
        if budget <= 0:
            raise ValueError(
                f"{cost_model.spec.name} in {cost_model.dtype} ({weights / 1e9:.1f} GB) does not fit in "
                f"{cfg.gpu_memory_utilization:g} x {cost_model.hardware.memory_bytes / 2**30:.0f} GiB of "
                f"{cost_model.hardware.name}; pick bigger hardware, a smaller dtype or --kv-cache-memory"
            )
    return max(1, budget // per_block)


class CostModelExecutor:
    """The simulator's executor: time from `CostModel`, tokens from a seeded RNG."""

    _TABLE = 4096  # distinct pseudo-random tokens, cycled

    def __init__(self, cost_model: CostModel, vocab_range: tuple[int, int] = (5, 32000), seed: int = 0,
                 spec: SimConfig | None = None):
        self.cost_model = cost_model
        self.spec = spec if spec is not None and spec.num_speculative_tokens > 0 else None
        self.accepted: dict[str, list[int]] = {}  # the last step's accepted drafts, per request
        self._credit: dict[str, float] = {}
        self.vocab_range = vocab_range
        lo, hi = vocab_range
        rng = random.Random(seed)
        # Tokens only matter for prefix-cache hashes of generated text; a seeded table read
        # cyclically is as good as fresh draws and costs nothing per token.
        self._tokens = [rng.randrange(lo, hi) for _ in range(self._TABLE)]
        self._next = 0

    def draft(self, running: Sequence[Request]) -> None:
        """Before `schedule()`: placeholder drafts on every running decode (speculative decoding),
        as the engine's proposer would set them when the batch is small enough."""
        c = self.spec
        if c is None:
            return
        on = len(running) <= c.spec_disable_by_batch_size
        for req in running:
            room = req.max_tokens - req.num_output_tokens - 1
            k = min(c.num_speculative_tokens, room) if on and req.num_tokens - req.num_computed_tokens == 1 else 0
            req.spec_token_ids = self._tokens[:k] if k > 0 else []

    def _accept(self, out: SchedulerOutput) -> None:
        """How many drafts each verifying request keeps: its credit grows by the mean each step."""
        self.accepted = {}
        if self.spec is None:
            return
        for s in out.scheduled:
            if s.spec_token_ids:
                credit = self._credit.get(s.request_id, 0.0) + self.spec.spec_mean_accepted
                a = min(int(credit), len(s.spec_token_ids))
                self._credit[s.request_id] = credit - a
                self.accepted[s.request_id] = s.spec_token_ids[:a]

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], float]:
        """(sampled token per request that reached its end, seconds this step takes)."""
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for s in out.scheduled:
            # A one-token step costs exactly a decode at that context, whatever its phase.
            if s.num_new_tokens == 1:
                decode.append(s.num_computed_before)
            else:
                prefill.append((s.num_new_tokens, s.num_computed_before))
        # A calibrated model (`sim.engine_cost.EngineCostModel`) also needs to know which entries
        # sample a token (a chunk short of the prompt's end computes no logits row).
        scheduled_time = getattr(self.cost_model, "scheduled_step_time", None)
        dt = scheduled_time(out) if scheduled_time is not None else self.cost_model.step_time(prefill, decode)
        sampled: dict[str, int] = {}
        toks, k, n = self._tokens, self._next, self._TABLE
        for s in out.scheduled:
            if s.sample:
                sampled[s.request_id] = toks[k % n]
                k += 1
        self._next = k
        self._accept(out)
        return sampled, dt


@dataclass
class SimResult:
    records: list[RequestRecord]  # workload order
    duration_s: float  # virtual seconds from t=0 to the last step's end
    steps: StepRecorder
    wall_time_s: float  # real seconds the simulation took
    num_kv_blocks: int
    scheduler_config: SchedulerConfig
    num_preemptions: int
    prefix_cache_hit_rate: float


class Simulator:
    """Runs workloads through a fresh `Scheduler` + `KVCacheManager` per `run()`."""

    def __init__(
        self,
        cost_model: CostModel,
        config: SimConfig = SimConfig(),
        *,
        model_max_positions: int | None = None,
        observers: Iterable[Callable[[StepEvent], None]] = (),
    ) -> None:
        self.cost_model = cost_model
        self.config = config
        max_model_len = resolve_max_model_len(config, model_max_positions)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens
            or default_max_num_batched_tokens(max_model_len, config.enable_chunked_prefill),
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            scheduling_policy=config.scheduling_policy,
        )
        self.num_kv_blocks = num_kv_blocks_for(config, cost_model)
        self.observers = list(observers)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def _check(self, r: BenchRequest) -> str | None:
        # The engine's own admission rules (LLMEngine.process_prompt / resolve_max_tokens).
        if r.prompt_len < 1:
            return "the prompt is empty: at least one token is needed"
        if r.prompt_len + r.output_len > self.max_model_len:
            return (f"{r.prompt_len} prompt + {r.output_len} output tokens exceed max_model_len "
                    f"{self.max_model_len}")
        return None

    def run(self, requests: Sequence[BenchRequest], seed: int = 0, vocab_range: tuple[int, int] | None = None,
            max_concurrency: int | None = None, client_turnaround_s: float = CLIENT_TURNAROUND_S) -> SimResult:
        """Simulate `requests`.  `max_concurrency` mimics `bench serve --max-concurrency`: a client
        that keeps at most that many requests in flight holds the others back until one finishes
        (their `send_time` is then when a slot freed, and latencies count from it).  A slot frees
        `client_turnaround_s` after the step that finished its request: the last token's trip to
        the client and the next request's trip back (see `CLIENT_TURNAROUND_S`)."""
        wall0 = time.perf_counter()
        kv = KVCacheManager(self.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)
        sched = Scheduler(self.scheduler_config, kv)
        vocab = vocab_range or (5, max(6, self.cost_model.spec.vocab_size))
        executor = CostModelExecutor(self.cost_model, vocab, seed, self.config)
        rec = StepRecorder()
        observers = [rec, *self.observers]

        records = [RequestRecord(prompt_len=r.prompt_len, arrival_time=r.arrival_time, group=r.group,
                                 expected_output_len=r.output_len) for r in requests]
        client = Client(requests, records, max_concurrency, self._check)
        live: dict[str, tuple[int, Request]] = {}
        t = 0.0
        while client.unsent or sched.has_unfinished():
            for i, req in client.send(t):
                sched.add_request(req)
                live[req.request_id] = (i, req)
            if not sched.has_unfinished():  # idle: jump to the next send
                nxt = client.next_send()
                if nxt is None:  # unreachable: with nothing in flight every slot is free
                    raise RuntimeError(f"simulation stalled at t={t:.6f}s with {client.unsent} requests unsent")
                t = max(t, nxt)
                continue
            executor.draft(sched.running)
            out = sched.schedule()
            if out.is_empty:  # cannot happen with a valid config; never spin forever
                raise RuntimeError(f"scheduler made no progress at t={t:.6f}s with "
                                   f"{sched.num_running} running / {sched.num_waiting} waiting requests")
            sampled, dt = executor.execute(out)
            start, t = t, t + dt
            for req in sched.update_from_output(out, sampled, t, executor.accepted):
                i, _ = live.pop(req.request_id)
                records[i].end_time = req.finished_time
                client.finished(t + client_turnaround_s)
            event = sched.make_event(out, sampled, start, t, dt)
            for fn in observers:
                fn(event)

        for rid, times in rec.token_times.items():
            i = int(rid.rsplit("-", 1)[1])
            records[i].token_times = list(times)
            records[i].first_token_time = times[0]
            records[i].output_len = len(times)
        queries, hits = kv.prefix_queries, kv.prefix_hits
        return SimResult(
            records=records,
            duration_s=t,
            steps=rec,
            wall_time_s=time.perf_counter() - wall0,
            num_kv_blocks=self.num_kv_blocks,
            scheduler_config=self.scheduler_config,
            num_preemptions=sched.num_preemptions,
            prefix_cache_hit_rate=hits / queries if queries else math.nan,
        )


def simulate(requests: Sequence[BenchRequest], cost_model: CostModel, config: SimConfig = SimConfig(), *,
             model_max_positions: int | None = None, seed: int = 0,
             observers: Iterable[Callable[[StepEvent], None]] = ()) -> SimResult:
    """One-call form: `Simulator(cost_model, config).run(requests, seed)`."""
    sim = Simulator(cost_model, config, model_max_positions=model_max_positions, observers=observers)
    return sim.run(requests, seed=seed)
