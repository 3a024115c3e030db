"""Run-directory JSONL files read back whatever a crash left: torn or garbage lines are
skipped and reported, never fatal; a torn tail is cut before appending."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harnessrl.jsonl import read_jsonl, repair_torn_tail


def test_torn_last_line_is_skipped_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\n[1, 2]\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        read = read_jsonl(path)
    assert read.rows == [{"step": 1}, {"step": 2}]
    assert read.lines == ['{"step": 1}', '{"step": 2}']
    assert [n for n, _ in read.bad_lines] == [3, 5] and read.torn_tail
    assert "metrics.jsonl:5 skipped" in caplog.text and "torn last line" in caplog.text
    assert read_jsonl(tmp_path / "missing.jsonl").rows == []


def test_repair_cuts_only_the_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3, "b": "cut')
    assert repair_torn_tail(path) == len(b'{"a": 3, "b": "cut')
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert repair_torn_tail(path) == 0
    path.write_bytes(b'{"only": "torn')
    assert repair_torn_tail(path) == 14 and path.read_bytes() == b""
    assert repair_torn_tail(tmp_path / "missing.jsonl") == 0
