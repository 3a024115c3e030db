"""Reading back the JSONL files of a run directory (`rollouts.jsonl`, `metrics.jsonl`, traces).

Responsibility: one reader that never fails on what a crash leaves behind. A process killed
mid-write (SIGKILL, power loss) leaves a torn last line: bytes of one record without its
newline. Such a line, and any other line that is not a JSON object, is skipped and reported
(`JsonlRead.bad_lines`, logged at WARNING), never fatal; `repair_torn_tail` cuts a torn tail
off before a resumed run appends to the file, so the fragment never fuses with a new record.

What it does not do: validate records against a schema (callers do, e.g. `Rollout`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class JsonlRead:
    """The JSON objects of a file, in order, and the lines that were not one."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    """The text of each row's line (same order as `rows`), for rewriting a file unchanged."""
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    """(1-based line number, reason) of every skipped line."""
    torn_tail: bool = False
    """The file did not end with a newline (the last write was cut off)."""


def read_jsonl(path: Path) -> JsonlRead:
    """Every JSON-object line of `path` (blank lines ignored); a missing file reads as empty.

    Lines that are not a JSON object (a torn last line, garbage) are skipped and reported in
    `bad_lines` and at WARNING with the file and line number.
    """
    out = JsonlRead()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return out
    out.torn_tail = bool(data) and not data.endswith(b"\n")
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            out.bad_lines.append((lineno, f"not JSON ({exc.__class__.__name__}: {str(exc)[:80]})"))
            continue
        if not isinstance(obj, dict):
            out.bad_lines.append((lineno, f"a JSON {type(obj).__name__}, not an object"))
            continue
        out.rows.append(obj)
        out.lines.append(raw.decode("utf-8"))
    for lineno, reason in out.bad_lines:
        torn = " (torn last line: the writer was killed mid-write)" if out.torn_tail and lineno == \
            data.count(b"\n") + 1 else ""
        log.warning("%s:%d skipped: %s%s", path, lineno, reason, torn)
    return out


def repair_torn_tail(path: Path) -> int:
    """Cut a torn last line (bytes after the last newline) off `path`; returns the number of
    bytes removed (0 when the file ends with a newline, is empty or is missing)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        pos = size
        while pos > 0:
            start = max(0, pos - (1 << 16))
            chunk = os.pread(fd, pos - start, start)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        else:
            keep = 0
        if keep == size:
            return 0
        os.ftruncate(fd, keep)
        log.warning("%s: removed a torn last line (%d bytes) left by a killed writer", path, size - keep)
        return size - keep
    finally:
        os.close(fd)
