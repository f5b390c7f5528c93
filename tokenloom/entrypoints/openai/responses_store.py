"""The Responses API's memory: stored responses, for `previous_response_id` and GET.

A response created with `store` (the default) is kept with the whole conversation it ends --
the earlier turns, its input and its output, as chat messages -- so a follow-up naming it
needs nothing else: the chain is never walked, and dropping an older response never breaks
a newer one.  The memory is this process's and bounded twice, least recently used dropped
first: by count (`--max-stored-responses`, default 1024; 0 stores nothing) and by size
(`max_bytes`, the JSON of what is kept, default 256 MiB), so a server that runs for months
holds at most that much.  A response that was dropped (or never stored, or stored by another
replica or an earlier run of the server) is unknown: `previous_response_id` naming it is a
400 `previous_response_not_found`, as OpenAI answers, and GET answers 404.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenloom.entrypoints.openai.responses_protocol import ResponseObject

DEFAULT_MAX_STORED = 1024
DEFAULT_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    history: list[dict[str, Any]]  # the conversation up to and including this response's output
    size: int


class ResponseStore:
    """An LRU map response id -> `StoredResponse`, bounded by count and by bytes."""

    def __init__(self, max_count: int = DEFAULT_MAX_STORED, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_count < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, got {max_count}")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response: ResponseObject, history: list[dict[str, Any]]) -> bool:
        """Keep `response` (dropping the least recently used beyond the bounds); False when it
        alone is over the byte bound or nothing is stored at all."""
        size = len(response.model_dump_json()) + len(json.dumps(history, ensure_ascii=False))
        if self.max_count == 0 or size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response.id, None)
            if old is not None:
                self._bytes -= old.size
            self._items[response.id] = StoredResponse(response, history, size)
            self._bytes += size
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item.size
            return item is not None
