"""Resume bookkeeping: lines logged after the checkpoint are dropped (that work is redone)."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl.train.resume import drop_lines_after_checkpoint


def test_lines_after_the_checkpoint_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": 0.1}) + "\n" for k in (1, 2, 3)))
    # steps 1-2 trained on groups 0, 1 and 3; group 2 was in flight at the checkpoint, 4 came later
    (tmp_path / "rollouts.jsonl").write_text(
        "".join(json.dumps({"group_id": g, "rollout_id": f"r{g}"}) + "\n" for g in (0, 1, 3, 2, 4)))
    drop_lines_after_checkpoint(tmp_path, step=2, next_group_id=4, replay=[2])
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(x)["group_id"] for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()] == [0, 1, 3]


def test_a_resume_without_checkpoint_starts_clean(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (tmp_path / "rollouts.jsonl").write_text(json.dumps({"group_id": 0}) + "\n")
    drop_lines_after_checkpoint(tmp_path, step=0, next_group_id=0, replay=[])
    assert (tmp_path / "metrics.jsonl").read_text() == "" and (tmp_path / "rollouts.jsonl").read_text() == ""
