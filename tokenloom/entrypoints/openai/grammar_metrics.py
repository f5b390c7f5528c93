"""/metrics series for grammar compilation: the compiled-grammar cache against its byte
bound, and the compile workers (`tokenloom.structured.compile_pool`).

Read at scrape time from `GrammarCompiler.stats()` by a custom collector on the engine's own
registry, so nothing has to be pushed from the compiling threads.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenloom.structured import GrammarCompiler

_OUTCOMES = {"compiled": "ok", "spec_errors": "invalid", "timeouts": "timeout", "abandoned": "abandoned",
             "busy_refusals": "busy", "worker_failures": "worker_failed"}


class GrammarCollector:
    """`tokenloom:grammar_*` for one engine's compiler."""

    def __init__(self, grammars: GrammarCompiler, model_name: str):
        self.grammars = grammars
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.grammars.stats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"tokenloom:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        yield gauge("grammar_cache_bytes", "Bytes of compiled grammars kept (serialized size).", s["cache_bytes"])
        yield gauge("grammar_cache_limit_bytes", "The bound on grammar_cache_bytes (--max-grammar-cache-bytes).",
                    s["cache_limit_bytes"])
        yield gauge("grammar_cache_entries", "Compiled grammars kept.", s["cache_entries"])
        pool = s.get("pool")
        if pool is None:
            return
        yield gauge("grammar_compile_workers", "Live grammar compile worker processes.", len(pool.worker_pids))
        yield gauge("grammar_compiles_running", "Grammars being compiled now.", pool.busy)
        yield gauge("grammar_compiles_waiting", "Grammars waiting for a compile worker.", pool.queued)
        c = CounterMetricFamily("tokenloom:grammar_compiles", "Grammar compilations by outcome.",
                                labels=labels + ["outcome"])
        for attr, outcome in _OUTCOMES.items():
            c.add_metric(values + [outcome], getattr(pool, attr))
        yield c
        starts = CounterMetricFamily("tokenloom:grammar_compile_worker_starts",
                                     "Compile worker processes started (a killed one is replaced).", labels=labels)
        starts.add_metric(values, pool.worker_starts)
        yield starts


def register_grammar_metrics(registry: CollectorRegistry, grammars: GrammarCompiler, model_name: str) -> None:
    registry.register(GrammarCollector(grammars, model_name))
