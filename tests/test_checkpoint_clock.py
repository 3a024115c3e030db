"""When checkpoints are written: kept ones every `train.checkpoint_every` steps and after the last,
rolling ones once `train.checkpoint_every_s` has passed (on by default), older rolling ones removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.train import loop
from harnessrl.train.loop import CheckpointClock, drop_rolling
from harnessrl.train.setup import loop_settings


def test_a_default_run_checkpoints_every_five_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `checkpoint_every = 0` wrote only the last step's: a stop before it lost the run."""
    now = [1000.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    clock = CheckpointClock(loop_settings(load_config(None, ["train.steps=50"])))
    assert clock.settings.checkpoint_every_s == 300.0
    assert not clock.due(1)
    now[0] += 299.0
    assert not clock.due(7)
    now[0] += 1.0
    assert clock.due(8) and not clock.kept(8)  # rolling
    clock.last = now[0]
    assert not clock.due(9) and clock.due(50) and clock.kept(50)  # the last step's is kept
    every = CheckpointClock(loop_settings(load_config(None, ["train.steps=50", "train.checkpoint_every=10",
                                                             "train.checkpoint_every_s=0"])))
    now[0] += 10_000.0
    assert [s for s in range(1, 51) if every.due(s)] == [10, 20, 30, 40, 50]


def test_drop_rolling_removes_only_older_rolling_checkpoints(tmp_path: Path) -> None:
    for step, rolling in [(2, True), (4, False), (6, True), (8, True)]:
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "state.json").write_text(json.dumps({"step": step, "rolling": rolling}))
    (tmp_path / "step-3").mkdir()  # no state: an earlier version's, or unreadable: kept
    (tmp_path / "step-5.tmp").mkdir()
    drop_rolling(tmp_path, before=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4", "step-5.tmp", "step-8"]
