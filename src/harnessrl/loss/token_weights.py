"""Each trained token's loss weight, and whether the clip or the weight's bound stopped it.

Responsibility: turn the loss's per-token outputs of one step (`LossOutputs.weight_T`,
`clipped_T`, `bounded_T`, over packed micro-batches) into one record per trained row, and
write and read those records as `token_weights.jsonl` in the run directory (one line a row),
so the viewer can show, on a row's tokens, what the loss did with each of them.

A record: `{"step", "rollout_id", "row_key", "n", "w", "clipped", "bounded"}`. `row_key` is
`row_key(row.input_ids)` (CRC-32 of the ids as little-endian int64), which the viewer recomputes
on the rows it rebuilds, so a record finds its row whatever order or bound the trainer applied;
`n` is the row's trained-token count; `w` is the list of its trained tokens' weights in row
order (the bounded behaviour weight `LossOutputs.weight_T`: 1 where the loss has none, 0 where
masked), to `DIGITS` significant digits, or None for a row past the step's `MAX_TOKENS_PER_STEP`
(then `clipped` / `bounded` are counts, not positions); `clipped` / `bounded` are the
positions among the row's trained tokens (0-based) that the ratio clip stopped / whose weight
was truncated or masked. A step thus writes at most `MAX_TOKENS_PER_STEP` weights
(~7 bytes each).

What this module does not do: compute the weights (`losses.py`) or decide what trains.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NotRequired, TypedDict

import orjson
import torch

__all__ = ["DIGITS", "FILE_NAME", "MAX_TOKENS_PER_STEP", "TokenWeightRecord", "TokenWeightRecorder",
           "append_token_weights", "read_token_weights", "row_key"]

FILE_NAME = "token_weights.jsonl"
"""The records' file in the run directory, next to `metrics.jsonl`."""
MAX_TOKENS_PER_STEP = 32768
"""Trained tokens a step records weights for (~230 KB a step at most); later rows of the step
keep their counts only."""
DIGITS = 4
"""Significant digits a weight keeps (a weight far below 1 stays readable, not 0)."""


class TokenWeightRecord(TypedDict):
    """One trained row's line (module docstring)."""

    step: NotRequired[int]
    rollout_id: str
    row_key: int
    n: int
    w: list[float] | None
    clipped: list[int] | int
    bounded: list[int] | int


def row_key(input_ids: Sequence[int]) -> int:
    """CRC-32 of `input_ids` as little-endian int64s: a row's identity within its rollout."""
    buf = array("q", input_ids)
    if sys.byteorder == "big":
        buf.byteswap()
    return zlib.crc32(buf.tobytes())


@dataclass
class TokenWeightRecorder:
    """The records of one step, collected micro-batch by micro-batch (`add`), row by row."""

    max_tokens: int = MAX_TOKENS_PER_STEP
    records: list[TokenWeightRecord] = field(default_factory=list)
    _weights_kept: int = 0

    def add(self, rows: Sequence[tuple[str, Sequence[int]]], seq_ids_T: torch.Tensor, mask_T: torch.Tensor,
            weight_T: torch.Tensor | None, clipped_T: torch.Tensor | None, bounded_T: torch.Tensor | None) -> None:
        """One micro-batch: `rows[i]` is `(rollout_id, input_ids)` of the row whose `seq_ids_T`
        value is i; the `_T` tensors are the pack's [T] mask and the loss's per-token outputs
        (None: the loss gave none; weight 1 and no flag then). Each row's trained tokens are in
        row order in the pack (a shared prefix is context only)."""
        mask = mask_T.bool().cpu()
        seq = seq_ids_T[mask].tolist()
        n_tok = len(seq)
        w = weight_T.detach().float().cpu()[mask].tolist() if weight_T is not None else [1.0] * n_tok
        clipped = clipped_T.cpu()[mask].tolist() if clipped_T is not None else [False] * n_tok
        bounded = bounded_T.cpu()[mask].tolist() if bounded_T is not None else [False] * n_tok
        start = 0
        while start < n_tok:
            i, end = seq[start], start
            while end < n_tok and seq[end] == i:
                end += 1
            self._row(rows[i], w[start:end], clipped[start:end], bounded[start:end])
            start = end

    def _row(self, row: tuple[str, Sequence[int]], w: list[float], clipped: list[bool], bounded: list[bool]) -> None:
        n = len(w)
        keep = self._weights_kept + n <= self.max_tokens
        c = [k for k, f in enumerate(clipped) if f]
        b = [k for k, f in enumerate(bounded) if f]
        self.records.append({
            "rollout_id": row[0], "row_key": row_key(row[1]), "n": n,
            "w": [float(f"{x:.{DIGITS}g}") for x in w] if keep else None,
            "clipped": c if keep else len(c), "bounded": b if keep else len(b),
        })
        if keep:
            self._weights_kept += n

    def merge(self, other: TokenWeightRecorder) -> None:
        """Another rank's records after this one's."""
        self.records.extend(other.records)


def append_token_weights(run_dir: Path, step: int, records: Iterable[TokenWeightRecord]) -> None:
    """Append `records` (`TokenWeightRecorder.records`) as step `step`'s lines of
    `run_dir / FILE_NAME`.

    Raises:
        OSError: the file cannot be written."""
    lines = b"".join(orjson.dumps({"step": step, **r}) + b"\n" for r in records)
    if lines:
        with (run_dir / FILE_NAME).open("ab") as fh:
            fh.write(lines)


_KEYS = ("row_key", "n", "w", "clipped", "bounded")


def read_token_weights(run_dir: Path) -> dict[str, list[TokenWeightRecord]]:
    """`run_dir / FILE_NAME`'s records by rollout id (empty when the file is absent); a line
    that does not parse (a torn tail) or lacks a record's keys is skipped."""
    path = run_dir / FILE_NAME
    out: dict[str, list[TokenWeightRecord]] = {}
    if not path.is_file():
        return out
    with path.open("rb") as fh:
        for line in fh:
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("rollout_id"), str) and all(k in rec for k in _KEYS):
                out.setdefault(rec["rollout_id"], []).append(TokenWeightRecord(
                    step=rec.get("step", 0), rollout_id=rec["rollout_id"], row_key=rec["row_key"], n=rec["n"],
                    w=rec["w"], clipped=rec["clipped"], bounded=rec["bounded"]))
    return out
