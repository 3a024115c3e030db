"""Ctrl-C and SIGTERM stop `harnessrl train` and `harnessrl rollout` (the real CLI, a real agent).

Each test starts the CLI in its own session on the tiny model with mini-swe-agent, lets the first
group finish (its agents run into a short timeout, so it is scored and, for `train`, trained on),
then signals the whole process group, as a terminal's Ctrl-C does, while the next group's agents
are alive. Checked: the exit code (130 / 143), the time to exit, that no process the run started
is left (its children, and every process carrying a sandbox marker) and no sandbox directory;
that `rollouts.jsonl` holds only rollouts finished before the signal (none cut by the stop, no
`agent_error` caused by it); for `train`, that `metrics.jsonl` has exactly the completed steps,
each with its checkpoint, and nothing of the step the signal cut.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harnessrl.harness.install import agent_executable
from harnessrl.sandbox.procs import leftover_processes
from proc_checks import assert_nothing_left, signal_group

pytestmark = [pytest.mark.e2e, pytest.mark.agents]

AGENT_TIMEOUT_S = 8
"""Each rollout's agent runs into this timeout (it never submits), so a group takes ~8 s."""
EXIT_WITHIN_S = 15.0
"""Bound on signal -> exit; measured 2-5 s on the 2-core development machine under load."""


@pytest.fixture(autouse=True)
def _needs_mini_swe_agent() -> None:
    try:
        agent_executable("mini-swe-agent")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"mini-swe-agent not installed ({exc}); run `harnessrl harness install mini-swe-agent`")


def _overrides(sandboxes: Path) -> list[str]:
    sets = [
        'engine.model="tiny-random"',
        "rollout.group_size=2",
        "rollout.max_concurrent_rollouts=2",
        f"rollout.agent_timeout_s={AGENT_TIMEOUT_S}",
        "sampling.max_tokens=16",
        # the agent keeps asking the model until it times out: there is always a call to cut
        "harness.options={step_limit = 50, max_format_errors = 50}",
        f"sandbox.root_dir={json.dumps(str(sandboxes))}",
    ]
    return [arg for s in sets for arg in ("--set", s)]


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "cli.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "harnessrl.cli", *args], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_for(condition, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()}"
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _signal_and_wait(proc: subprocess.Popen[bytes], sig: signal.Signals, log: Path) -> tuple[float, float, list[psutil.Process]]:
    """Signal the CLI's process group; returns (wall time of the signal, seconds to exit, the
    processes the run had started)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    t_signal = time.time()
    return t_signal, signal_group(proc, sig), children


def _assert_finished_before(rollouts: list[dict], t_signal: float) -> None:
    for r in rollouts:
        assert r["status"] != "agent_error", f"a rollout broken by the stop was recorded: {r['error']}"
        for turn in r["trace"]["turns"]:
            assert turn["started_at"] + turn["latency_s"] <= t_signal, "a turn after the signal was recorded"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_stops_rollout(sig: signal.Signals, tmp_path: Path) -> None:
    sandboxes, out = tmp_path / "sandboxes", tmp_path / "eval"
    proc, log = _start(["rollout", "--out", str(out), "--limit", "3", *_overrides(sandboxes)], tmp_path)
    # group 0 written; group 1's agents running
    _wait_for(lambda: len(_lines(out / "rollouts.jsonl")) >= 2 and len(leftover_processes(sandboxes)) >= 2,
              proc, log, "the first group and live agents of the next")
    t_signal, exit_s, children = _signal_and_wait(proc, sig, log)
    text = log.read_text()
    assert proc.returncode == 128 + sig, text
    assert exit_s < EXIT_WITHIN_S, f"took {exit_s:.1f} s to exit"
    assert_nothing_left(children, sandboxes, grace_s=2.0)
    rollouts = _lines(out / "rollouts.jsonl")
    assert [r["group_id"] for r in rollouts][:2] == [0, 0], "the group finished before the signal"
    # rollouts of group 1 that finished before the signal are written too, marked incomplete
    assert all(r["group_id"] == 1 and r["metadata"]["group_incomplete"] for r in rollouts[2:]), rollouts[2:]
    assert not any("group_incomplete" in r["metadata"] for r in rollouts[:2])
    _assert_finished_before(rollouts, t_signal)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by_signal"] == sig and summary["tasks"] == 1 and summary["rollouts"] == 2
    assert f"stopped by {sig.name}" in (out / "run.log").read_text()
    print(f"harnessrl rollout, {sig.name}: exit {proc.returncode} after {exit_s:.2f} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_stops_train(sig: signal.Signals, tmp_path: Path) -> None:
    sandboxes, run_dir = tmp_path / "sandboxes", tmp_path / "run"
    args = ["train", "--out", str(run_dir), "--steps", "4", *_overrides(sandboxes),
            "--set", "train.checkpoint_every=1",
            # rewards 0, 1 within each group: a step whose agents made a model call trains
            "--set", 'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"']
    proc, log = _start(args, tmp_path)
    _wait_for(lambda: len(_lines(run_dir / "metrics.jsonl")) >= 1 and len(leftover_processes(sandboxes)) >= 2,
              proc, log, "step 1 and live agents of the next group")
    t_signal, exit_s, children = _signal_and_wait(proc, sig, log)
    text = log.read_text()
    assert proc.returncode == 128 + sig, text
    assert exit_s < EXIT_WITHIN_S, f"took {exit_s:.1f} s to exit"
    assert_nothing_left(children, sandboxes, grace_s=2.0)

    metrics = _lines(run_dir / "metrics.jsonl")
    done = len(metrics)
    assert 1 <= done < 4
    assert [m["step"] for m in metrics] == list(range(1, done + 1)), "only completed steps, 1-based"
    versions = [m["policy_version"] for m in metrics]
    assert versions == sorted(versions) and versions[-1] <= done
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{k}" for k in range(1, done + 1)], "no checkpoint of the cut step"
    state = json.loads((run_dir / "checkpoints" / f"step-{done}" / "state.json").read_text())
    assert state["step"] == done and state["policy_version"] == versions[-1]
    rollouts = _lines(run_dir / "rollouts.jsonl")
    assert len(rollouts) == 2 * done, "the rollouts of the completed steps only"
    _assert_finished_before(rollouts, t_signal)
    trained = {r["group_id"] for r in rollouts}
    assert trained.isdisjoint(state["replay_group_ids"]) and state["next_group_id"] > max(trained)
    run_log = (run_dir / "run.log").read_text()
    assert f"stopped by {sig.name}" in run_log
    # said what it did, off a terminal too: a line per rollout and per step
    assert "rollout 1 (group 0) procedural/" in run_log and "step 1/4 v" in run_log
    print(f"harnessrl train, {sig.name}: exit {proc.returncode} after {exit_s:.2f} s, {done} steps kept")
