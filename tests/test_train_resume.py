"""Resume bookkeeping: lines logged after the checkpoint are dropped (that work is redone); a new
run in a used directory sets the earlier run aside."""

from __future__ import annotations

import json
import os
import time
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


def test_a_new_run_sets_the_earlier_run_aside(tmp_path: Path) -> None:
    """A new run in a directory an earlier run wrote to: that run's files move to a sibling
    named after its last write (a second one gets `-2`), other files stay, nothing is lost."""
    from harnessrl.train.run import set_aside_earlier_run

    run_dir = tmp_path / "default"
    assert set_aside_earlier_run(run_dir) is None  # no directory yet
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert set_aside_earlier_run(run_dir) is None  # nothing of a run in it
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "rollouts.jsonl").write_text('{"group_id": 0}\n')
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-1" / "state.json").write_text("{}")
    os.utime(run_dir / "metrics.jsonl", (1_700_000_000, 1_700_000_000))
    os.utime(run_dir / "rollouts.jsonl", (1_700_000_000, 1_700_000_000))
    os.utime(run_dir / "checkpoints", (1_700_000_000, 1_700_000_000))
    moved = set_aside_earlier_run(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(1_700_000_000))
    assert moved == tmp_path / f"default.{stamp}"
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "metrics.jsonl", "rollouts.jsonl"]
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (moved / "checkpoints" / "step-1" / "state.json").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    os.utime(run_dir / "metrics.jsonl", (1_700_000_000, 1_700_000_000))
    assert set_aside_earlier_run(run_dir) == tmp_path / f"default.{stamp}-2"


def test_a_run_that_fails_its_checks_leaves_the_earlier_run_where_it_is(tmp_path: Path) -> None:
    """`run_training` called directly (not through the CLI) checks the task source, the
    verifier and the model before the earlier run is set aside: a missing tasks file, a source
    that raises and a missing model each leave the directory as it was, with no sibling."""
    import pytest

    from harnessrl.config import load_config
    from harnessrl.errors import HarnessRLError
    from harnessrl.train.run import run_training

    run_dir = tmp_path / "default"
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "checkpoints" / "step-1" / "state.json").write_text("{}")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    for overrides, named in (
        (['tasks.kind="stdio"', f'tasks.path="{tmp_path / "missing.jsonl"}"'], "missing.jsonl"),
        (['tasks.kind="python"', 'tasks.source="json:loads"'], "tasks.source = 'json:loads'"),
        (['engine.model="/no/such/model"'], "engine.model = '/no/such/model'"),
    ):
        cfg = load_config(None, [*overrides, 'sandbox.isolation="best_effort"'])
        with pytest.raises(HarnessRLError, match=named.replace(".", r"\.")):
            run_training(cfg, run_dir)
        assert sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
