"""`harnessrl rollout`: groups of rollouts without training, written and summarised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.run_rollouts import run_evaluation


@pytest.mark.e2e
def test_rollout_writes_every_rollout_and_a_summary(tmp_path: Path, sandbox_root: Path) -> None:
    cfg = load_config(None, ["engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2",
                             "sampling.max_tokens=8", f'sandbox.root_dir="{sandbox_root}"'])
    out = tmp_path / "eval"
    assert run_evaluation(cfg, out, limit=3) == 0
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 6
    assert sorted({r["group_id"] for r in rollouts}) == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"] == 3 and summary["rollouts"] == 6
    assert summary["status/ok"] == 6 and "pass@2" in summary
    assert summary["completion_tokens"] == sum(len(t["completion_ids"]) for r in rollouts for t in r["trace"]["turns"])
    assert summary["errors"] == 0 and summary["error_rate"] == 0.0 and summary["scored"] == 6
    # one readable line per rollout in run.log (and on stderr), with a fixed denominator
    log = (out / "run.log").read_text()
    assert [f"rollout {k}/6 " in log for k in range(1, 7)] == [True] * 6
    assert all(f"{r['task_id']} ok reward" in log for r in rollouts)
