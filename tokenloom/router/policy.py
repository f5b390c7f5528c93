"""Routing policies: which replica gets the next request.

Pure Python -- no HTTP, no torch -- so that the router in front of live servers and the
simulator's fleet of virtual replicas run the very same classes.  A policy is asked one
question, `choose(key, candidates, loads)`: of these healthy backends (by index), each with
this many requests in flight, which one takes a request whose prompt is `key`?

- `RoundRobin`: each backend in turn.
- `LeastLoaded`: the fewest requests in flight (the router's own count); ties in turn.
- `CacheAware`: the backend most likely to hold the prompt's prefix in its KV cache
  already, so its prefill reads the cache instead of recomputing it -- unless that backend
  is busier than the least-loaded one by more than `balance_threshold` requests, when the
  queueing it would cost outweighs the prefill it would save.

How `CacheAware` knows what a backend caches: it does not ask.  The router never tokenizes,
so it keys prompts by their text (or by token ids when the client sent ids), cut into
fixed-size blocks, each block's hash chained to its parent's -- the engine's prefix-cache
keying (`core.kv_cache`), done on characters.  Each backend keeps a bounded LRU record of
the block hashes of the prompts routed to it; the longest run of leading blocks found in a
backend's record is its expected prefix hit.  The record is an estimate (the engine evicts
on its own schedule), which is all routing needs.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, ClassVar, Mapping, Sequence, Union

# What a prompt is keyed by: its text, or its token ids; None when the request has no prompt.
PromptKey = Union[str, tuple[int, ...], None]

DEFAULT_BLOCK_CHARS = 64  # characters per block of a text key (roughly 16 tokens of English)
DEFAULT_BLOCK_TOKENS = 16  # token ids per block when the client sent ids
DEFAULT_RECORD_BLOCKS = 1 << 16  # blocks remembered per backend
DEFAULT_BALANCE_THRESHOLD = 4  # in-flight requests the best prefix match may exceed the least loaded by


# ---------------------------------------------------------------- prompt keys
def prompt_key(body: Mapping[str, Any] | None) -> PromptKey:
    """The routing key of an OpenAI request body: the prompt's text (completions), the
    messages rendered to one string (chat), or the token ids a client sent; None if none.

    Only the first prompt of a batch (`prompt: [..., ...]`) keys the request: it goes to
    one backend whole."""
    if not isinstance(body, Mapping):
        return None
    if "messages" in body:
        return _render_messages(body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: key by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return None


def _render_messages(messages: Any) -> str | None:
    """Messages as one string in which a conversation's earlier turns are a prefix of its
    later ones (a chat template does the same, so cache hits line up)."""
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        content = m.get("content")
        if not isinstance(content, str):  # content parts, tool calls: stable, if not pretty
            content = json.dumps(content, sort_keys=True, separators=(",", ":"))
        parts.append(f"<{m.get('role')}>{content}\n")
    return "".join(parts)


def block_hashes(key: PromptKey, *, block_chars: int = DEFAULT_BLOCK_CHARS,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[bytes]:
    """One hash per *full* block of `key`, each chained to its parent's, so equal hashes at
    position i mean equal prompts up to the end of block i.  Stable across processes."""
    if not key:
        return []
    if isinstance(key, str):
        size = block_chars
        chunks = [key[i:i + size].encode("utf-8", "surrogatepass") for i in range(0, len(key) - size + 1, size)]
    else:
        size = block_tokens
        chunks = [b",".join(str(t).encode() for t in key[i:i + size]) for i in range(0, len(key) - size + 1, size)]
    out: list[bytes] = []
    parent = b""
    for chunk in chunks:
        parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        out.append(parent)
    return out


class PrefixRecord:
    """A bounded LRU set of block hashes: what one backend was last sent."""

    def __init__(self, capacity: int = DEFAULT_RECORD_BLOCKS):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` this record holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Remember `hashes` as most recently used; forget the least recently used beyond capacity."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


# ---------------------------------------------------------------- policies
class Policy:
    """Base class: picks one of `candidates` (backend indices, never empty)."""

    name: ClassVar[str] = ""

    def __init__(self, num_backends: int):
        if num_backends < 1:
            raise ValueError(f"a router needs at least one backend, got {num_backends}")
        self.num_backends = num_backends

    def choose(self, key: PromptKey, candidates: Sequence[int], loads: Sequence[int]) -> int:
        raise NotImplementedError

    def backend_down(self, index: int) -> None:
        """`index` left rotation (died, restarted): whatever was learnt about it is stale."""


class RoundRobin(Policy):
    """Each backend in turn, skipping those not among the candidates."""

    name = "round-robin"

    def __init__(self, num_backends: int):
        super().__init__(num_backends)
        self._next = 0

    def _take_turn(self, among: Sequence[int]) -> int:
        """The first of `among` at or after the current turn (cyclically); advance the turn."""
        pick = min(among, key=lambda i: (i - self._next) % self.num_backends)
        self._next = (pick + 1) % self.num_backends
        return pick

    def choose(self, key: PromptKey, candidates: Sequence[int], loads: Sequence[int]) -> int:
        return self._take_turn(candidates)


class LeastLoaded(RoundRobin):
    """Fewest requests in flight; among equals, in turn (so an idle fleet still spreads)."""

    name = "least-loaded"

    @staticmethod
    def least_loaded(candidates: Sequence[int], loads: Sequence[int]) -> list[int]:
        """The candidates with the fewest requests in flight."""
        low = min(loads[i] for i in candidates)
        return [i for i in candidates if loads[i] == low]

    def choose(self, key: PromptKey, candidates: Sequence[int], loads: Sequence[int]) -> int:
        return self._take_turn(self.least_loaded(candidates, loads))


class CacheAware(LeastLoaded):
    """Longest expected prefix-cache hit first; least-loaded when there is none, or when the
    best match is busier than the least-loaded backend by more than `balance_threshold`."""

    name = "cache-aware"

    def __init__(self, num_backends: int, *, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
                 block_chars: int = DEFAULT_BLOCK_CHARS, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 record_blocks: int = DEFAULT_RECORD_BLOCKS):
        super().__init__(num_backends)
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        self.balance_threshold = balance_threshold
        self.block_chars = block_chars
        self.block_tokens = block_tokens
        self.records = [PrefixRecord(record_blocks) for _ in range(num_backends)]

    def matches(self, key: PromptKey) -> list[int]:
        """Leading blocks of `key` each backend's record holds (for tests and traces)."""
        hashes = block_hashes(key, block_chars=self.block_chars, block_tokens=self.block_tokens)
        return [r.match(hashes) for r in self.records]

    def choose(self, key: PromptKey, candidates: Sequence[int], loads: Sequence[int]) -> int:
        hashes = block_hashes(key, block_chars=self.block_chars, block_tokens=self.block_tokens)
        lowest = self.least_loaded(candidates, loads)
        pick: int | None = None
        if hashes:
            hits = {i: self.records[i].match(hashes) for i in candidates}
            best_hit = max(hits.values())
            if best_hit > 0:
                # Among equal matches the least loaded; among those, the lowest index.
                best = min((i for i in candidates if hits[i] == best_hit), key=lambda i: (loads[i], i))
                if loads[best] - loads[lowest[0]] <= self.balance_threshold:
                    pick = best
        if pick is None:  # no match, or the match is too busy: least-loaded, ties in turn
            pick = self._take_turn(lowest)
        if hashes:
            self.records[pick].insert(hashes)
        return pick

    def backend_down(self, index: int) -> None:
        self.records[index].clear()


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)}


def make_policy(name: str, num_backends: int, **options: Any) -> Policy:
    """The policy called `name` (a key of `POLICIES`); `options` go to `CacheAware` only."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}") from None
    if cls is CacheAware:
        return CacheAware(num_backends, **options)
    return cls(num_backends)
