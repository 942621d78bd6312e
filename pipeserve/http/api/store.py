"""ResponseStore: finished /v1/responses kept for `previous_response_id` and retrieval — an
in-process LRU with a time to live and a byte cap. Event loop only (no locking)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]                 # the response object as returned
    conversation: list[dict[str, Any]]   # template messages: history, input, then the output
    nbytes: int
    expires_s: float


class ResponseStore:
    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, body: dict[str, Any],
            conversation: list[dict[str, Any]], ttl_s: float | None = None) -> bool:
        """Store one response (for `ttl_s`, the store's own by default); False when it alone
        is over the byte cap, or cannot be written as JSON (nested past orjson's 254 levels),
        and is not stored."""
        try:
            size = len(orjson.dumps(body)) + len(orjson.dumps(conversation))
        except TypeError:   # orjson.JSONEncodeError: "Recursion limit reached", say
            return False
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        self._expire()
        while self._items and self.nbytes + size > self.max_bytes:
            self._drop(next(iter(self._items)))
        ttl = self.ttl_s if ttl_s is None else ttl_s
        self._items[response_id] = StoredResponse(body, conversation, size,
                                                  time.monotonic() + ttl)
        self.nbytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when unknown or expired; a hit refreshes LRU order."""
        self._expire()
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        if response_id not in self._items:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        self.nbytes -= self._items.pop(response_id).nbytes

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, v in self._items.items() if v.expires_s <= now]:
            self._drop(key)
