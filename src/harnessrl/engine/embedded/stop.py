"""Stop-string detection over incrementally decoded completion ids.

Responsibility: decode a growing list of sampled ids to text one id at a time (the
prefix/read-offset scheme of vLLM's and TGI's incremental detokenizers, so multi-byte
characters split across ids are only emitted once complete) and report when the decoded
completion first contains one of the stop strings.

What it deliberately does not do: cut the ids or the text at the stop string. The engine keeps
every sampled id (token faithfulness); trimming text for display is the chat layer's job.
Invariant: `text` is the decoded completion so far (minus a trailing incomplete character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StopWatcher:
    """Feeds ids one at a time; `push` returns True once any stop string has appeared."""

    def __init__(self, tokenizer: _Decoder, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> bool:
        """Append one id; True when the decoded text now contains a stop string."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence: wait for the next id
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        return any(stop in self.text[search_from:] for stop in self._stops)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
