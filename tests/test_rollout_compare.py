"""`harnessrl rollout --compare A B` (tasks fixed / regressed) and resuming an evaluation in an
existing directory (only missing or errored rollouts run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harnessrl.cli import app
from harnessrl.config import load_config
from harnessrl.rollout.compare import compare_dirs
from harnessrl.run_rollouts import resume_plan, run_evaluation
from harnessrl.types import Rollout, Trace


def _rec(task: str, reward: float | None, status: str = "ok", group: int = 0, i: int = 0) -> dict:
    return Rollout(rollout_id=f"{task}-{i}", group_id=group, task_id=task, harness="h", status=status,
                   reward=reward, trace=Trace(session_id=f"{task}-{i}")).model_dump(mode="json")


def _write(d: Path, records: list[dict]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_compare_lists_fixed_and_regressed_tasks(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", [_rec("t1", 0.0), _rec("t1", 0.0, i=1), _rec("t2", 1.0), _rec("t3", 1.0),
                                _rec("t4", None, "agent_error"), _rec("t5", 0.0), _rec("gone", 1.0)])
    b = _write(tmp_path / "b", [_rec("t1", 0.0), _rec("t1", 1.0, i=1), _rec("t2", 0.0), _rec("t3", 1.0),
                                _rec("t4", 1.0), _rec("t5", 0.0), _rec("new", 0.0)])
    cmp = compare_dirs(a, b)
    assert cmp.fixed == ["t1"] and cmp.regressed == ["t2"] and cmp.unscored == ["t4"]
    assert cmp.only_a == ["gone"] and cmp.only_b == ["new"]
    assert cmp.a["t1"].scored == 2 and cmp.b["t1"].passed == 1
    lines = cmp.lines()
    assert lines[0] == "5 tasks in both: solved 2 in A, 3 in B; 1 fixed, 1 regressed, 1 unscored"
    assert "fixed     t1  A 0/2  B 1/2" in lines and "regressed t2  A 1/1  B 0/1" in lines

    result = CliRunner().invoke(app, ["rollout", "--compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "fixed     t1" in result.output and "regressed t2" in result.output
    missing = CliRunner().invoke(app, ["rollout", "--compare", str(a), str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "is not an evaluation directory" in missing.output


def test_resume_plan_keeps_good_rollouts_and_sets_errors_aside(tmp_path: Path) -> None:
    d = _write(tmp_path / "e", [_rec("t0", 1.0, group=0), _rec("t0", 0.0, "infra_error", group=0, i=1),
                                _rec("t1", 0.0, "timeout", group=1), _rec("t1", 1.0, group=1, i=1),
                                _rec("t1", 1.0, group=1, i=2), _rec("t9", 1.0, group=9)])
    with (d / "rollouts.jsonl").open("a") as fh:
        fh.write('{"torn": ')
    kept, needed = resume_plan(d, 3, 2)
    assert {g: [r.rollout_id for r in rs] for g, rs in kept.items()} == {0: ["t0-0"], 1: ["t1-0", "t1-1"]}
    assert needed == {0: 1, 2: 2}
    assert [json.loads(x)["rollout_id"] for x in (d / "rollouts.jsonl").read_text().splitlines()] == ["t0-0", "t1-0", "t1-1"]
    assert [json.loads(x)["rollout_id"] for x in (d / "rollouts.replaced.jsonl").read_text().splitlines()] == [
        "t0-1", "t1-2", "t9-0"]
    assert resume_plan(tmp_path / "fresh", 2, 2) == ({}, {0: 2, 1: 2})


@pytest.mark.e2e
def test_an_interrupted_evaluation_resumes_running_only_what_is_missing(tmp_path: Path, sandbox_root: Path) -> None:
    cfg = load_config(None, ["engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2",
                             "sampling.max_tokens=8", f'sandbox.root_dir="{sandbox_root}"'])
    out = tmp_path / "eval"
    assert run_evaluation(cfg, out, limit=3) == 0
    first = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    # as if interrupted: group 2 never finished, and one rollout of group 0 hit an error
    kept = [r for r in first if r["group_id"] != 2]
    errored = next(r for r in kept if r["group_id"] == 0)
    errored.update(status="agent_error", reward=None)
    (out / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (out / "run.log").unlink()
    assert run_evaluation(cfg, out, limit=3) == 0
    after = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(after) == 6 and sorted(r["group_id"] for r in after) == [0, 0, 1, 1, 2, 2]
    old_ids = {r["rollout_id"] for r in kept if r is not errored}
    assert old_ids <= {r["rollout_id"] for r in after}  # the good ones were not rerun
    assert errored["rollout_id"] not in {r["rollout_id"] for r in after}
    log = (out / "run.log").read_text()
    assert "rollout 3/3 " in log and "rollout 4/" not in log  # 1 + 2 rollouts ran, no more
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"] == 3 and summary["rollouts"] == 6 and summary["errors"] == 0
    replaced = (out / "rollouts.replaced.jsonl").read_text().splitlines()
    assert [json.loads(x)["rollout_id"] for x in replaced] == [errored["rollout_id"]]


@pytest.mark.e2e
def test_ctrl_c_writes_every_finished_rollout_and_resume_fills_its_group(tmp_path: Path, sandbox_root: Path) -> None:
    """Ctrl-C once 3 of 6 rollouts finished (one at a time, group by group): all 3 are written,
    the lone one of the incomplete group marked `group_incomplete`; the resumed run runs only
    the 3 missing and drops the mark (before: only complete groups were written, the rest lost)."""
    import os
    import signal
    import threading
    import time

    cfg = load_config(None, ["engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2",
                             "rollout.max_concurrent_rollouts=1", "sampling.max_tokens=48",
                             f'sandbox.root_dir="{sandbox_root}"'])
    out = tmp_path / "eval"

    def interrupt_after_third() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (out / "run.log").exists() and "rollout 3/6 " in (out / "run.log").read_text():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=interrupt_after_third, daemon=True)
    watcher.start()
    assert run_evaluation(cfg, out, limit=3) == 130
    watcher.join()
    log = (out / "run.log").read_text()
    finished = sum(f"rollout {k}/6 " in log for k in range(1, 7))
    first = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(first) == finished >= 3  # every rollout logged as finished is written
    sizes = {g: sum(r["group_id"] == g for r in first) for g in {r["group_id"] for r in first}}
    assert 1 in sizes.values(), sizes  # one at a time: the third rollout is the lone one of group 1
    for r in first:
        assert r["metadata"].get("group_incomplete", False) == (sizes[r["group_id"]] < 2), r["group_id"]
    assert "incomplete groups written (marked group_incomplete)" in log

    assert run_evaluation(cfg, out, limit=3) == 0
    after = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(after) == 6 and sorted(r["group_id"] for r in after) == [0, 0, 1, 1, 2, 2]
    assert {r["rollout_id"] for r in first} <= {r["rollout_id"] for r in after}
    assert not any("group_incomplete" in r["metadata"] for r in after)
    assert f"rollout {6 - finished}/{6 - finished} " in (out / "run.log").read_text()


def test_a_directory_of_another_config_is_refused_before_anything_is_touched(tmp_path: Path) -> None:
    """Rollouts of one config and a resume with another: a one-line error naming the keys that
    differ, `config.toml` and `rollouts.jsonl` as they were, no `run.log` (before: the old
    rollouts were kept and `config.toml` overwritten)."""
    from harnessrl.config import dump_config
    from harnessrl.errors import ConfigError

    old = load_config(None, ["rollout.group_size=2", "sampling.temperature=0.7"])
    d = _write(tmp_path / "e", [_rec("t0", 1.0)])
    (d / "config.toml").write_text(dump_config(old))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    new = load_config(None, ["rollout.group_size=2", "sampling.temperature=1.0", "log.level=DEBUG"])
    with pytest.raises(ConfigError) as exc:
        run_evaluation(new, d, limit=1)
    assert str(exc.value) == (f"{d} holds rollouts of another config (sampling.temperature: 0.7 -> 1.0): "
                              "use another --out, or move that directory aside")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # a key the older config.toml lacks (added since) is no difference
    from harnessrl.run_rollouts import check_same_config
    (d / "config.toml").write_text("".join(line for line in dump_config(old).splitlines(keepends=True)
                                           if not line.startswith("agent_timeout_s")))
    assert "agent_timeout_s" in dump_config(old) and "agent_timeout_s" not in (d / "config.toml").read_text()
    check_same_config(d, old)
    (d / "config.toml").unlink()
    with pytest.raises(ConfigError, match="holds rollouts.jsonl but no config.toml"):
        run_evaluation(old, d, limit=1)
