"""Metrics sinks besides JSONL (`log.sinks`): TensorBoard, trackio and W&B (offline), each read
back with the library's own reader (TensorBoard's EventAccumulator, trackio's SQLiteStorage,
`wandb leet inspect --json` on the run's `.wandb` transaction log); the rollout table sampled
from `rollouts.jsonl`; a missing package refused before start, naming its extra; and a real
`harnessrl train` with all four sinks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.log import TABLE_COLUMNS, RolloutSample, check_sinks, make_sinks, markdown_table

CONFIG = {"train": {"steps": 2, "learning_rate": 1e-3}, "engine": {"model": "tiny-random"}}


def _rollout(i: int, answer: str = "42") -> str:
    return json.dumps({"task_id": f"procedural/repeat-{i}", "status": "ok", "reward": i / 4,
                       "final_answer": answer, "trace": {"turns": [{}] * (i + 1)}}) + "\n"


def _write_two_steps(run: Path, names: list[str]) -> None:
    """Step 0: a held-out evaluation (no rollouts yet); step 1: 5 rollouts appended, then logged."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "rollouts.jsonl").write_text(_rollout(9))  # before the sinks: a resumed run's, not in any table
    sinks = make_sinks(names, run, CONFIG, project="hrl-test", table_rollouts=3)
    for s in sinks:
        s.log(0, {"step": 0, "eval/pass_rate": 0.5, "eval/k": 2.0, "policy_version": 0})
    with (run / "rollouts.jsonl").open("a") as fh:
        for i in range(5):
            fh.write(_rollout(i, "a|b\nc" if i == 2 else "42"))
    for s in sinks:
        s.log(1, {"step": 1, "loss": 0.25, "staleness_mean": math.nan, "skip_reason": "text is skipped"})
    for s in sinks:
        s.close()


TABLE = [[1, "procedural/repeat-0", "ok", 0.0, 1, "42"], [1, "procedural/repeat-2", "ok", 0.5, 3, "a|b\nc"],
         [1, "procedural/repeat-4", "ok", 1.0, 5, "42"]]
"""The table of step 1: 3 of 5 rollouts, every 2nd (ceil(5 / 3))."""


def test_rollout_sample_reads_each_steps_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text(_rollout(9))
    sample = RolloutSample(path, 2)
    assert sample.rows(0) == []  # what was there before is not this run's
    with path.open("a") as fh:
        fh.write(_rollout(0) + "not json\n" + _rollout(1) + '{"task_id": "torn')
    assert [r[1] for r in sample.rows(1)] == ["procedural/repeat-0", "procedural/repeat-1"]  # lines 0 and 2 of 3
    assert sample.rows(1) is sample.rows(1)  # read once per step, shared by every sink
    with path.open("a") as fh:
        fh.write('", "x": 1}\n' + "not json\n" + _rollout(3))
    assert [r[1] for r in sample.rows(2)] == ["procedural/repeat-3"]  # the torn line, read once complete, has no trace: skipped
    long = RolloutSample(path, 0)
    assert long.rows(3) == []


def test_markdown_table_escapes_cells() -> None:
    text = markdown_table([[1, "t", "ok", None, 2, "a|b\nc"]])
    assert text.splitlines() == ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|---|---|---|---|",
                                 "| 1 | t | ok |  | 2 | a\\|b c |"]


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_two_steps(tmp_path / "run", ["tensorboard"])
    ea = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == ["eval/k", "eval/pass_rate", "loss", "policy_version", "staleness_mean"]
    assert [(e.step, e.value) for e in ea.Scalars("eval/pass_rate")] == [(0, 0.5)]
    assert [(e.step, e.value) for e in ea.Scalars("loss")] == [(1, 0.25)]
    assert math.isnan(ea.Scalars("staleness_mean")[0].value)
    (config,) = ea.Tensors("config/text_summary")
    assert json.loads(config.tensor_proto.string_val[0].decode().strip("`\n")) == CONFIG
    (table,) = ea.Tensors("rollouts/text_summary")
    assert table.step == 1
    lines = table.tensor_proto.string_val[0].decode().splitlines()
    assert len(lines) == 5 and lines[3] == "| 1 | procedural/repeat-2 | ok | 0.500 | 3 | a\\|b c |"


def test_trackio_local_store_read_back(tmp_path: Path) -> None:
    pytest.importorskip("trackio")
    # trackio fixes its store ($TRACKIO_DIR) at import: write and read in a fresh interpreter
    script = f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_sinks import _write_two_steps
_write_two_steps(Path({str(tmp_path / 'run')!r}), ["trackio"])
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({{"runs": SQLiteStorage.get_runs("hrl-test"), "logs": SQLiteStorage.get_logs("hrl-test", "run"),
                  "config": SQLiteStorage.get_run_config("hrl-test", "run")}}))
"""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["runs"] == ["run"]
    assert {k: v for k, v in got["config"].items() if not k.startswith("_")} == CONFIG
    steps = {}
    for row in got["logs"]:
        steps.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("timestamp", "step")})
    assert steps[0] == {"eval/pass_rate": 0.5, "eval/k": 2.0, "policy_version": 0.0}
    assert steps[1]["loss"] == 0.25 and "skip_reason" not in steps[1]
    table = steps[1]["rollouts"]
    assert table["_type"] == "trackio.table"
    assert [[r[c] for c in TABLE_COLUMNS] for r in table["_value"]] == TABLE
    assert (tmp_path / "store" / "hrl-test.db").is_file() and not (tmp_path / "run" / "trackio").exists()


def _wandb_records(run: Path) -> list[dict]:
    (log,) = run.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # nothing written to ~
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def test_wandb_offline_run_read_back(tmp_path: Path, wandb_env: None) -> None:
    run = tmp_path / "run"
    _write_two_steps(run, ["wandb"])
    records = _wandb_records(run)
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert start["project"] == "hrl-test" and start["display_name"] == "run"
    assert start["telemetry"]["feature"]["offline"] is True
    config = {k: v for k, v in start["config"]["update"].items() if k != "_wandb"}
    assert config == CONFIG
    history = {r["history"]["step"].get("num", 0): r["history"]["item"] for r in records if r["type"] == "history"}
    assert history[0]["eval/pass_rate"] == 0.5 and history[0]["eval/k"] == 2
    assert history[1]["loss"] == 0.25 and "skip_reason" not in history[1]
    assert history[1]["rollouts._type"] == "table-file" and history[1]["rollouts.nrows"] == 3
    table = json.loads((log_dir := next(run.glob("wandb/offline-run-*"))).joinpath(
        "files", history[1]["rollouts.path"]).read_text())
    assert table["columns"] == list(TABLE_COLUMNS) and table["data"] == TABLE
    assert log_dir.parent == run / "wandb"
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


def test_a_failing_sink_is_a_warning_not_the_end_of_the_run(caplog: pytest.LogCaptureFixture) -> None:
    from harnessrl.log import Guarded

    calls = []

    class Broken:
        def log(self, step: int, metrics: dict) -> None:
            calls.append(step)
            raise OSError("wandb-core went away")

        def close(self) -> None:
            calls.append("close")

    sink = Guarded("wandb", Broken())
    with caplog.at_level("WARNING"):
        sink.log(1, {"loss": 1.0})
        sink.log(2, {"loss": 1.0})
        sink.close()
    assert calls == [1, "close"]  # no step after the failure; closed once
    assert [r.getMessage() for r in caplog.records] == [
        "log.sinks: wandb failed (OSError: wandb-core went away); it receives nothing more, metrics.jsonl has every step"]


def test_a_missing_package_is_refused_naming_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.sinks includes 'wandb'.*pip install 'harnessrl\[wandb\]'"):
        check_sinks(["jsonl", "tensorboard", "wandb"])
    check_sinks(["jsonl", "tensorboard", "trackio"])
    with pytest.raises(ConfigError, match="unknown sink 'mlflow'"):
        check_sinks(["mlflow"])
    from harnessrl.train.setup import check_training

    with pytest.raises(ConfigError, match=r"harnessrl\[wandb\]"):  # `harnessrl train` checks it first
        check_training(load_config(None, ['log.sinks=["wandb"]']))
    assert load_config(None, ['log.report_to=["trackio"]']).log.sinks == ["trackio"]  # the old name


@pytest.mark.e2e
def test_a_real_run_writes_all_four_sinks(tmp_path: Path, wandb_env: None) -> None:
    pytest.importorskip("trackio")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    sets = ['engine.model="tiny-random"', 'harness.kind="white_box"', "rollout.group_size=2", "sampling.max_tokens=8",
            "train.learning_rate=1e-3", "engine.num_threads=1", "train.num_threads=1", "train.eval_every=2",
            "train.eval_size=2", 'log.sinks=["jsonl","tensorboard","trackio","wandb"]', 'log.project="hrl-e2e"',
            'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
            f'sandbox.root_dir="{tmp_path / "sandboxes"}"']
    exe = Path(sys.executable).with_name("harnessrl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRACKIO_DIR": str(tmp_path / "store")}
    done = subprocess.run([str(exe), "train", "--steps", "2", "--out", str(run), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in jsonl] == [0, 1, 2]
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("eval/pass_rate")] == [(0, jsonl[0]["eval/pass_rate"]),
                                                                       (2, jsonl[2]["eval/pass_rate"])]
    assert [e.step for e in ea.Scalars("loss")] == [1, 2]
    assert [t.step for t in ea.Tensors("rollouts/text_summary")] == [1, 2]

    records = _wandb_records(run)
    history = {r["history"]["step"].get("num", 0): r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [0, 1, 2]
    assert history[2]["eval/pass_rate"] == pytest.approx(jsonl[2]["eval/pass_rate"])
    assert history[1]["loss"] == pytest.approx(jsonl[1]["loss"]) and history[1]["rollouts.nrows"] == 2
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert start["config"]["update"]["train"]["eval_every"] == 2

    script = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
              "print(json.dumps({'logs': S.get_logs('hrl-e2e', 'run'), 'config': S.get_run_config('hrl-e2e', 'run')}))")
    read = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout.strip().splitlines()[-1])
    assert got["config"]["log"]["sinks"] == ["jsonl", "tensorboard", "trackio", "wandb"]
    losses = {r["step"]: r["loss"] for r in got["logs"] if "loss" in r}
    assert losses == pytest.approx({1: jsonl[1]["loss"], 2: jsonl[2]["loss"]})
    tables = {r["step"]: r["rollouts"]["_value"] for r in got["logs"] if "rollouts" in r}
    assert sorted(tables) == [1, 2]
    assert {row["task"] for row in tables[1]} | {row["task"] for row in tables[2]} <= {r["task_id"] for r in rollouts}
