"""`SegmentEncoder`: exact tokenisation of rendered prompts, reusing the ids of text seen before.

An agent re-sends its whole history on every call, so most of a rendered prompt was
tokenised on the previous turn. A Hugging Face `tokenizers` pipeline extracts added tokens
(`<|im_start|>`, `<|im_end|>`, ...) from the raw text *before* normalisation,
pre-tokenisation and the model run on the pieces between them, each piece on its own
(`AddedVocabulary::extract_and_normalize`). So
`encode(a + tok + b) == encode(a) + [id(tok)] + encode(b)`, and the ids of each piece can be
cached by its text. The chat template writes an added token around every message, so a piece
is about one message: a new turn costs the tokenisation of its new messages only.

Invariants:
  * `encode(text)` returns exactly `backend.encode(text, add_special_tokens=False).ids`
    (tested against the tokenizer on adversarial texts). Piecewise encoding is used only when
    that identity holds by construction: no added token strips whitespace (`lstrip`/`rstrip`),
    requires word boundaries (`single_word`) or is matched after a normaliser, and special
    tokens are extracted (`encode_special_tokens` off). Otherwise every call encodes whole.
  * Added tokens are matched leftmost-longest, as the tokenizer's Aho-Corasick matcher does.
  * Escaped content (`marker`, `restore`): a piece holding `marker` is content text in which
    the chat layer replaced special-token text by markers; it is encoded with `restore`d
    text and special tokens *not* extracted (`encode_special_tokens`), so text such as
    `<|im_end|>` inside a tool result becomes plain-text ids, never a control token. Text
    with markers is always split at added tokens (those are the template's own).
  * The cache holds at most `max_cached_tokens` ids (least recently used pieces go first);
    it is guarded by a lock, so worker threads may encode concurrently.

What this module deliberately does not do: render templates (`chat.py`) or add special
tokens of a post-processor (prompts are rendered text with every special token written).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MAX_CACHED_PIECE_CHARS = 262_144
"""Longest piece whose ids are cached: the cache is bounded by ids, and a long piece of few ids
(a run of one character) would otherwise keep its whole text as the key."""


class SegmentEncoder:
    """Encodes text with a `tokenizers.Tokenizer`, caching ids per piece between added tokens.

    Args:
        backend: the Rust tokenizer (`PreTrainedTokenizerFast.backend_tokenizer`).
        max_cached_tokens: bound on cached ids (~36 bytes each in CPython lists).
        marker: the string that opens an escaped special token in content ("" for none).
        restore: maps a piece holding markers back to its original text.
    """

    def __init__(self, backend: Any, max_cached_tokens: int = 2_000_000, *, marker: str = "",
                 restore: Callable[[str], str] | None = None) -> None:
        self.backend = backend
        self._marker = marker
        self._restore = restore
        self._plain: Any = None
        self.max_cached_tokens = max_cached_tokens
        added = backend.get_added_tokens_decoder()
        self._added_ids = {tok.content: int(i) for i, tok in added.items()}
        self.piecewise = bool(added) and max_cached_tokens > 0 and not getattr(backend, "encode_special_tokens", False) \
            and all(not (t.lstrip or t.rstrip or t.single_word or (t.normalized and backend.normalizer is not None))
                    for t in added.values())
        contents = sorted(self._added_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if contents else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without post-processor special tokens (a fresh list)."""
        ids = self.encode_within(text, None)
        assert ids is not None
        return ids

    def encode_within(self, text: str, max_uncached_chars: int | None) -> list[int] | None:
        """`encode(text)`, or None (nothing encoded) when more than `max_uncached_chars`
        characters of it are not in the cache (None: no limit). One pass over the text."""
        if self._split is None or not (self.piecewise or self._escaped(text)):
            if max_uncached_chars is not None and len(text) > max_uncached_chars:
                return None
            return self.backend.encode(text, add_special_tokens=False).ids
        pieces = self._split.split(text)
        if max_uncached_chars is not None:
            with self._lock:
                missing = sum(len(p) for p in pieces[::2] if p not in self._cache)
            if missing > max_uncached_chars:
                return None
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(self._added_ids[piece])
            elif piece:  # the split leaves "" between adjacent added tokens
                out.extend(self._piece_ids(piece))
        return out

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` that `encode` would tokenise (pieces not in the cache)."""
        if self._split is None or not (self.piecewise or self._escaped(text)):
            return len(text)
        pieces = self._split.split(text)[::2]
        with self._lock:
            return sum(len(p) for p in pieces if p not in self._cache)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_tokens = 0

    def _escaped(self, text: str) -> bool:
        return bool(self._marker) and self._marker in text

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token text encoded as plain text (not extracted)."""
        if self._plain is None:
            from tokenizers import Tokenizer  # lazy: optional fast path

            plain = Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def _piece_ids(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
                return ids
        if self._escaped(piece) and self._restore is not None:
            ids = self.encode_plain(self._restore(piece))
        else:
            ids = self.backend.encode(piece, add_special_tokens=False).ids
        if len(ids) <= self.max_cached_tokens and len(piece) <= MAX_CACHED_PIECE_CHARS:
            with self._lock:
                if piece not in self._cache:
                    self._cache[piece] = ids
                    self._cached_tokens += len(ids)
                while self._cached_tokens > self.max_cached_tokens:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_tokens -= len(dropped)
        return ids
