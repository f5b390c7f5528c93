"""A test-only fault injector: make one chosen request fail at one chosen place.

The engine promises that a failure attributable to one request fails that request alone,
that a failed forward pass fails only the requests of that step, and that a broken device
takes the server down loudly instead of answering 200 to `/health`.  Those paths are never
taken by a healthy engine, so tests provoke them on purpose with this object:

    engine.faults = FaultInjector.parse("detokenize:victim")      # offline tests
    TOKENLOOM_FAULTS="forward:*" tokenloom serve ...               # a server in a subprocess

A spec is `;`-separated `site:selector` rules.  Sites:

    forward     raise before the step's forward pass when a selected request is in the batch
                (not attributed to any request: the whole step fails)
    sample      raise as the sampler would for one bad row (attributed to that request)
    detokenize  raise while turning a selected request's new token into text
    device      the device health probe reports the device broken

A selector matches a request whose id equals it (a sample of an n>1 request, `ID-i`, is
matched by `ID` too), or whose prompt text contains it -- servers choose their own request
ids, so a server test marks the victim in its prompt.  `*` matches every request.

The environment is read once, when an engine is built; with no spec the engine holds
`None` and pays one `is not None` test per step, nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_VAR = "TOKENLOOM_FAULTS"
SITES = frozenset({"forward", "sample", "detokenize", "device"})


class InjectedFault(RuntimeError):
    """Raised by the injector.  `request_id` is set when the fault is attributed to one
    request, as a sampler that knows the offending row would do."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class FaultInjector:
    """Which sites fail, for which requests (see the module docstring)."""

    rules: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector":
        rules: dict[str, list[str]] = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            site, sep, selector = part.partition(":")
            site = site.strip()
            if site not in SITES:
                raise ValueError(f"{ENV_VAR}: unknown fault site {site!r} (known: {', '.join(sorted(SITES))})")
            rules.setdefault(site, []).append(selector.strip() if sep else "*")
        return cls(rules)

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = os.environ.get(ENV_VAR, "").strip()
        return cls.parse(spec) if spec else None

    def matches(self, site: str, request_id: str, prompt: str | None = None) -> bool:
        for sel in self.rules.get(site, ()):
            if sel == "*" or sel == request_id or _is_sample_of(request_id, sel):
                return True
            if prompt and sel in prompt:
                return True
        return False

    def check(self, site: str, request_id: str, prompt: str | None = None, *, attribute: bool = True) -> None:
        """Raise InjectedFault if `site` is set to fail for this request."""
        if self.matches(site, request_id, prompt):
            raise InjectedFault(f"injected {site} fault for request {request_id}",
                                request_id if attribute else None)

    def device_broken(self) -> bool:
        return "device" in self.rules


def _is_sample_of(request_id: str, parent: str) -> bool:
    """`ID-3` is sample 3 of the n>1 request `ID`."""
    head, sep, tail = request_id.rpartition("-")
    return bool(sep) and head == parent and tail.isdigit()
