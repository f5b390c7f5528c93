"""Prometheus metrics for the seed's figures: TTFT, inter-token latency, batch occupancy, KV use.

`EngineMetrics` turns what the engine already reports into vLLM-shaped series named
`tokenloom:*`, in a `CollectorRegistry` of its own (never the process-global one, so two
engines -- or a test that builds several servers -- never collide):

    per step   (StepEvent observer)   running / waiting / KV usage gauges, generated tokens,
                                      tokens per iteration (batch occupancy), preemptions,
                                      prefix-cache queries / hits, speculative decoding's
                                      drafts / draft tokens / accepted tokens (+ per position)
    per output (RequestOutput)        TTFT, inter-token latency, end-to-end latency,
                                      prompt tokens, finished requests by reason
    stalled readers (async engine)    paused sequences (gauge), stream pauses, streams
                                      aborted after --stalled-stream-timeout

Everything is fed from the thread that owns the engine, so the bookkeeping dicts here need
no lock; prometheus_client's own locks make scraping from another thread safe.  Nothing here
knows about HTTP: an offline run can `attach()` the same class and call `observe_output()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenloom.core.events import StepEvent
from tokenloom.outputs import EmbeddingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from tokenloom.engine.llm_engine import LLMEngine

# vLLM's buckets, extended downwards: a tiny model on a CPU decodes in a few milliseconds,
# and buckets that all start at 10 ms would put every observation in the first one.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    """The `tokenloom:` metric family for one engine (one model name label)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._engine: LLMEngine | None = None
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenloom:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenloom:{name}", doc, labels + list(extra), registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenloom:{name}", doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.num_requests_paused = gauge("num_requests_paused",
                                         "Sequences paused because their client stopped reading (KV kept).")
        self.num_stream_pauses = counter("num_stream_pauses", "Streams paused because their client stopped reading.")
        self.num_stalled_stream_aborts = counter("num_stalled_stream_aborts",
                                                 "Streams aborted after --stalled-stream-timeout seconds paused.")
        # prometheus_client appends `_total` to counters: the exported names end in `_total`.
        self.num_preemptions = counter("num_preemptions", "Requests preempted (KV freed, to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Tokens sampled by decode/prefill steps.")
        self.request_success = counter("request_success", "Finished completions, by finish reason.",
                                       ("finished_reason",))
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # Speculative decoding (vLLM's spec_decode_* names): acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Decodes that fed draft tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens the model accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by their position in the draft.",
            ("position",))
        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first token (TTFT).",
                                        TTFT_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between two tokens of one sequence.",
                                        ITL_BUCKETS)
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        # Histogram named `..._total` as in vLLM: tokens (prefill + decode) fed per step -- batch occupancy.
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens fed to the model per engine step.",
                                     ITERATION_TOKEN_BUCKETS)

        # Export every series from the start (at 0): a dashboard or a rate() needs the series to
        # exist before the first preemption / abort, and absent is not the same as zero.
        for m in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                  self.num_requests_paused, self.num_stream_pauses, self.num_stalled_stream_aborts,
                  self.num_preemptions, self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                  self.prefix_cache_hits, self.time_to_first_token, self.inter_token_latency,
                  self.e2e_request_latency, self.iteration_tokens, self.spec_decode_num_drafts,
                  self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens):
            self._l(m)
        for reason in ("stop", "length", "abort", "error"):
            self._l(self.request_success, finished_reason=reason)

        # Per-sequence state for TTFT / ITL: (request_id, index) -> (num tokens seen, time of last token).
        self._last: dict[tuple[str, int], tuple[int, float]] = {}
        self._ttft_seen: set[str] = set()
        self._prefix_seen = (0, 0)

    def _l(self, m, **extra):
        return m.labels(model_name=self.model_name, **extra)

    # ---- wiring --------------------------------------------------------
    def attach(self, engine: "LLMEngine") -> "EngineMetrics":
        """Observe `engine`'s steps; gauges and prefix-cache counters read it directly."""
        self._engine = engine
        self._prefix_seen = (engine.kv.prefix_queries, engine.kv.prefix_hits)
        engine.add_observer(self.on_step)
        self.refresh_gauges()
        return self

    def refresh_gauges(self) -> None:
        """Read running / waiting / KV use off the engine (call from the engine's thread).

        Also needed between steps: an abort frees KV blocks without any step following it."""
        e = self._engine
        if e is None:
            return
        self._l(self.num_requests_running).set(e.num_running)
        self._l(self.num_requests_waiting).set(e.num_waiting)
        self._l(self.kv_cache_usage_perc).set(e.kv_cache_usage())
        self._l(self.num_requests_paused).set(e.num_paused)
        q, h = e.kv.prefix_queries, e.kv.prefix_hits
        dq, dh = q - self._prefix_seen[0], h - self._prefix_seen[1]
        if dq > 0:
            self._l(self.prefix_cache_queries).inc(dq)
        if dh > 0:
            self._l(self.prefix_cache_hits).inc(dh)
        self._prefix_seen = (q, h)

    # ---- per step ------------------------------------------------------
    def on_step(self, event: StepEvent) -> None:
        self._l(self.iteration_tokens).observe(event.num_batched_tokens)
        generated = event.num_generated_tokens
        if generated:
            self._l(self.generation_tokens).inc(generated)
        for en in event.entries:
            if en.draft_token_ids:
                self._l(self.spec_decode_num_drafts).inc()
                self._l(self.spec_decode_num_draft_tokens).inc(len(en.draft_token_ids))
                if en.num_accepted_tokens:
                    self._l(self.spec_decode_num_accepted_tokens).inc(en.num_accepted_tokens)
                for pos in range(en.num_accepted_tokens):
                    self._l(self.spec_decode_num_accepted_tokens_per_pos, position=str(pos)).inc()
        if event.preempted:
            self._l(self.num_preemptions).inc(len(event.preempted))
        if self._engine is not None:
            self.refresh_gauges()
        else:  # an engine-less feed (the simulator): the event carries what it knows
            self._l(self.num_requests_running).set(event.num_running)
            self._l(self.num_requests_waiting).set(event.num_waiting)
            if event.kv_blocks_total:
                self._l(self.kv_cache_usage_perc).set(event.kv_blocks_used / event.kv_blocks_total)

    # ---- per output ----------------------------------------------------
    def observe_output(self, out: RequestOutput | EmbeddingRequestOutput) -> None:
        """Feed one (cumulative) RequestOutput, as returned by `LLMEngine.step()`."""
        m = out.metrics
        rid = out.request_id
        if not isinstance(out.outputs, list):  # an embedding: no tokens, one vector when it finishes
            if out.finished:
                self._l(self.prompt_tokens).inc(len(out.prompt_token_ids))
                self._l(self.request_success, finished_reason="stop").inc()
                if m is not None and m.e2e_latency is not None:
                    self._l(self.e2e_request_latency).observe(max(0.0, m.e2e_latency))
            return
        if m is not None and m.first_token_time is not None and rid not in self._ttft_seen:
            self._ttft_seen.add(rid)
            self._l(self.time_to_first_token).observe(max(0.0, m.first_token_time - m.arrival_time))
            self._l(self.prompt_tokens).inc(len(out.prompt_token_ids))
        t = m.last_token_time if m is not None and m.last_token_time is not None else None
        for c in out.outputs:
            key = (rid, c.index)
            n = len(c.token_ids)
            prev = self._last.get(key)
            if t is not None and n:
                if prev is not None and n > prev[0]:
                    gap = (t - prev[1]) / (n - prev[0])
                    for _ in range(n - prev[0]):
                        self._l(self.inter_token_latency).observe(max(0.0, gap))
                if prev is None or n > prev[0]:
                    self._last[key] = (n, t)
        # A finished sample stops growing, so it adds nothing more; its entry goes when the
        # whole group does (forget), not earlier, or a later output would re-add it.
        if out.finished:
            for c in out.outputs:
                if c.finish_reason is not None:
                    self._l(self.request_success, finished_reason=c.finish_reason).inc()
            if m is not None and m.e2e_latency is not None:
                self._l(self.e2e_request_latency).observe(max(0.0, m.e2e_latency))
            self.forget(rid, len(out.outputs))

    def observe_outputs(self, outs: Iterable[RequestOutput]) -> None:
        for o in outs:
            self.observe_output(o)

    def observe_pause(self, request_id: str, n: int = 1) -> None:
        """A stream was paused (its client stopped reading).  The wait until it resumes is
        the client's, not the server's: the next token starts a fresh inter-token interval."""
        self._l(self.num_stream_pauses).inc()
        for i in range(n):
            self._last.pop((request_id, i), None)

    def observe_stalled_abort(self) -> None:
        """A paused stream was aborted after its stall timeout (counted as an abort too)."""
        self._l(self.num_stalled_stream_aborts).inc()

    def observe_abort(self, request_id: str, n: int = 1) -> None:
        """A request ended from outside (client gone, shutdown): count it, drop its state."""
        self._l(self.request_success, finished_reason="abort").inc(n)
        self.forget(request_id, n)

    def forget(self, request_id: str, n: int = 1) -> None:
        self._ttft_seen.discard(request_id)
        for i in range(n):
            self._last.pop((request_id, i), None)

    # ---- export --------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
