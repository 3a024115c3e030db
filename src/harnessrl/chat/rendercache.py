"""Exact-input caches of the chat layer: a rendered prompt by its messages and tools, the ids of
a rendered prompt by its text.

Responsibility: a bounded, thread-safe least-recently-used map (`LruCache`) and the keys the
chat layer uses with it (`render_key`). An agent re-sends its conversation on retries, several
processes it spawned send the same prompt, and a load generator re-sends one body: a hit
returns what the same input rendered or encoded before. A key is the input itself (the frozen
`Message` records, the tools' exact JSON), never a hash of it, so a hit can only be the same
input; a miss costs one hash of the input.

What this module deliberately does not do: render or tokenise (`chat.py`, `tokencache.py`),
or decide what is cached (the chat layer: the template's output is a pure function of its
inputs, the tokenizer's of its text).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import orjson

from harnessrl.chat.messages import Message

V = TypeVar("V")


class LruCache(Generic[V]):
    """At most `max_size` units of values (`size_of(value)` each; least recently used go first)
    and at most `max_entries` entries. A value larger than `max_size` is not kept.

    Raises ValueError for a negative bound; 0 disables the cache (nothing is kept).
    """

    def __init__(self, max_size: int, size_of: Callable[[V], int], max_entries: int = 4096) -> None:
        if max_size < 0 or max_entries < 0:
            raise ValueError(f"max_size={max_size} and max_entries={max_entries} must be >= 0")
        self.max_size = max_size
        self.max_entries = max_entries
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self._size_of(value)
        if size > self.max_size or self.max_entries == 0:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._items[key] = (value, size)
            self._size += size
            while self._size > self.max_size or len(self._items) > self.max_entries:
                _, (_, dropped) = self._items.popitem(last=False)
                self._size -= dropped

    def discard(self, key: Hashable) -> None:
        """Drop `key`'s entry, if any."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= old[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size(self) -> int:
        """Units held (characters, ids: whatever `size_of` counts)."""
        return self._size


def render_key(messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool, settings: Hashable = ()) -> Hashable | None:
    """The exact input of one render: the messages (frozen records), the tools' JSON (orjson keeps
    key order and every value), the generation-prompt flag and the renderer's own `settings`.
    None when the tools are not plain JSON (such a render is not cached)."""
    try:
        tools_key = orjson.dumps(list(tools)) if tools else b""
    except TypeError:
        return None
    return tuple(messages), tools_key, add_generation_prompt, settings
