"""The router's Prometheus series, and the merge of its replicas' expositions.

The router's own series (`tokenloom:router_*`, one `backend` label per backend URL) live
in a `CollectorRegistry` of their own, like the engine's, so two routers in one process
(tests) never collide.

For data-parallel serving, `/metrics` also carries every replica's series, each sample
labelled `engine="<i>"` (vLLM's convention): `merge_expositions` folds N text expositions
into one, writing each family's `# HELP` / `# TYPE` once with the samples of every replica
beneath it, as the text format requires.
"""

from __future__ import annotations

import re
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    """Counters and gauges the router updates as it routes."""

    def __init__(self, backend_urls: list[str]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tokenloom:router_requests", "Requests sent to each backend (retries included).",
                                ["backend"], registry=r)
        self.retries = Counter("tokenloom:router_retries",
                               "Tries that failed on this backend before any byte reached the client "
                               "(the request then goes to another backend, if one is left).", ["backend"], registry=r)
        self.failed = Counter("tokenloom:router_failed_requests",
                              "Requests no backend could serve (every healthy one was tried, or none was healthy).",
                              registry=r)
        self.stream_errors = Counter("tokenloom:router_stream_errors",
                                     "Responses cut off by the backend after bytes had reached the client "
                                     "(never retried).", ["backend"], registry=r)
        self.healthy = Gauge("tokenloom:router_backend_healthy", "1 if the backend is in rotation, else 0.",
                             ["backend"], registry=r)
        self.in_flight = Gauge("tokenloom:router_in_flight", "Requests sent to the backend and not yet finished.",
                               ["backend"], registry=r)
        for url in backend_urls:  # every series exists from the start, at 0
            for family in (self.requests, self.retries, self.stream_errors, self.healthy, self.in_flight):
                family.labels(backend=url)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_HEADER = re.compile(r"^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*)")
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*")


def add_label(sample: str, label: str, value: str) -> str:
    """`name{a="b"} 1` -> `name{label="value",a="b"} 1` (one sample line of the text format)."""
    m = _NAME.match(sample)
    if m is None:
        return sample
    name, rest = m.group(0), sample[m.end():]
    pair = f'{label}="{value}"'
    if rest.startswith("{}"):
        return f"{name}{{{pair}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{pair},{rest[1:]}"
    return f"{name}{{{pair}}}{rest}"


def merge_expositions(parts: Iterable[tuple[str, str]], label: str = "engine") -> str:
    """Merge (label value, exposition text) pairs into one exposition, every sample labelled."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (header lines, samples), in order
    kinds: dict[str, set[str]] = {}  # name -> header kinds written (HELP, TYPE): each once
    for value, text in parts:
        current: str | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            h = _HEADER.match(line)
            if h is not None:
                kind, current = h.group(1), h.group(2)
                headers, _ = families.setdefault(current, ([], []))
                if kind not in kinds.setdefault(current, set()):
                    kinds[current].add(kind)
                    headers.append(line)
                continue
            if line.startswith("#"):
                continue
            if current is None:  # a sample before any header: a family of its own
                name = _NAME.match(line)
                current = name.group(0) if name else ""
            families.setdefault(current, ([], []))[1].append(add_label(line, label, value))
    out: list[str] = []
    for headers, samples in families.values():
        out += headers + samples
    return "\n".join(out) + ("\n" if out else "")
