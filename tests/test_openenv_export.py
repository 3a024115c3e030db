"""`harnessrl export --format openenv`: rollouts as OpenEnv `TrainingTrace` files, read back with
OpenEnv's own model; ids, masks and logprobs equal the rows `harnessrl train` builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv.core.harness")

from openenv.core.harness import TrainingTrace  # noqa: E402

from harnessrl.errors import ConfigError  # noqa: E402
from harnessrl.export import export_run, load_openenv_export  # noqa: E402
from harnessrl.train.samples import build_rows  # noqa: E402
from harnessrl.types import Rollout, Trace, Turn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _turn(i: int, prompt: list[int], completion: list[int], lps: list[float], **kw) -> Turn:  # noqa: ANN003
    return Turn(turn_index=i, request={"messages": [{"role": "user", "content": "q"}]}, prompt_ids=prompt,
                completion_ids=completion, completion_logprobs=lps, policy_version=3, finish_reason="stop", **kw)


def _rollouts() -> list[Rollout]:
    # two turns, the second continuing the first (a tool result 40, 41 between): one row
    t0 = _turn(0, [1, 2, 3], [10, 11], [-0.5, -0.25])
    t1 = _turn(1, [1, 2, 3, 10, 11, 40, 41], [12, 13, 2], [-1.0, -0.125, -2.0])
    ok = Rollout(rollout_id="r-ok", group_id=0, task_id="openenv/0", harness="white_box", status="ok",
                 reward=1.0, train_reward=0.5, trace=Trace(session_id="s1", turns=[t0, t1]))
    # an unfaithful turn (logprob count off) never trains: no row
    bad = _turn(0, [1, 2], [5, 6], [-0.1])
    unfaithful = Rollout(rollout_id="r-bad", group_id=0, task_id="openenv/0", harness="white_box",
                         status="verifier_error", reward=None, trace=Trace(session_id="s2", turns=[bad]))
    return [ok, unfaithful]


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    with (run / "rollouts.jsonl").open("w") as fh:
        for r in _rollouts():
            fh.write(r.model_dump_json() + "\n")
        fh.write('{"torn": ')  # a torn last line is skipped
    return run


def test_export_round_trips_ids_masks_and_logprobs(tmp_path: Path) -> None:
    run, out = _run_dir(tmp_path), tmp_path / "out"
    report = export_run(run, out, "openenv")
    assert (report.rollouts, report.rows, report.tokens_trained, report.skipped_lines) == (2, 1, 5, 1)
    traces = load_openenv_export(out)
    assert list(traces) == ["r-ok", "r-bad"]
    assert all(isinstance(t, TrainingTrace) for t in traces.values())
    (row,), _ = build_rows(_rollouts()[0])
    (turn,) = traces["r-ok"].turns
    assert turn.node_id == "r-ok/row0"
    assert turn.prompt_token_ids == [1, 2, 3]
    assert turn.prompt_token_ids + turn.completion_token_ids == list(row.input_ids) == [1, 2, 3, 10, 11, 40, 41, 12, 13, 2]
    assert turn.loss_mask == list(row.completion_mask) == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert turn.per_token_logps == [-0.5, -0.25, 0.0, 0.0, -1.0, -0.125, -2.0]
    assert turn.metadata["reward"] == 1.0 and turn.metadata["train_reward"] == 0.5
    assert turn.metadata["policy_versions"] == [3, 3, -1, -1, 3, 3, 3]
    # the unscored rollout: no trainable row, reward None (unscored, never 0.0)
    assert traces["r-bad"].turns == []
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert index[1] == {"rollout_id": "r-bad", "group_id": 0, "task_id": "openenv/0", "status": "verifier_error",
                        "reward": None, "train_reward": None, "file": "r-bad.json", "rows": 0, "tokens_trained": 0}
    # OpenEnv's validation runs on what was written: a trainable prompt position is refused
    doc = json.loads((out / "r-ok.json").read_text())
    doc["turns"][0]["loss_mask"][0] = 1
    with pytest.raises(ValueError, match="prompt tokens must remain context"):
        TrainingTrace.model_validate_json(json.dumps(doc))


def test_export_errors_and_cli(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no rollouts.jsonl"):
        export_run(tmp_path, tmp_path / "o")
    with pytest.raises(ConfigError, match="--format 'parquet' is unknown"):
        export_run(tmp_path, tmp_path / "o", "parquet")
    run, out = _run_dir(tmp_path), tmp_path / "cli-out"
    res = subprocess.run([sys.executable, "-m", "harnessrl.cli", "export", str(run), "--format", "openenv",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exported 2 rollouts (1 rows, 5 trained tokens)" in res.stdout
    assert load_openenv_export(out)["r-ok"].turns[0].loss_mask[-3:] == [1, 1, 1]
