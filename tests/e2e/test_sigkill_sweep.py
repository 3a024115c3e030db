"""`harnessrl train` killed by SIGKILL in its first step, then a new run: nothing of the first
is left (no sandbox directory, cgroup, mount or process), and the new run says what it removed.

Real processes: the CLI on the tiny random model. The first run's agent is `sleep 300` (the
command harness), so the kill lands while every rollout of the first step is in flight, each
with a live agent in its sandbox. Only the trainer's process is killed, as the OOM killer
does; no handler runs. The second run trains one step with the white-box harness in the same
sandbox root (`sandbox/sweep.py` runs at its start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.sandbox import cgroup
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.procs import find_processes

CLI = str(Path(sys.executable).with_name("harnessrl"))


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}


def _sets(root: Path, *pairs: str) -> list[str]:
    common = ["engine.model=tiny-random", "rollout.group_size=2", "sampling.max_tokens=24", "train.steps=1",
              f'sandbox.root_dir="{root}"']
    if bwrap_path() is None:  # train requires isolation by default; this test is about leftovers
        common.append('sandbox.isolation="best_effort"')
    return [a for p in (*common, *pairs) for a in ("--set", p)]


def _sandboxes(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _cgroups(sandbox_id: str) -> list[Path]:
    return [p / sandbox_id for p in {cgroup.available(), cgroup.memory_available()}
            if p is not None and (p / sandbox_id).exists()]


@pytest.mark.e2e
def test_a_sigkilled_train_leaves_nothing_after_the_next_run(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    log1 = (tmp_path / "first.txt").open("wb")
    first = subprocess.Popen(
        [CLI, "train", "--out", str(tmp_path / "run1"),
         *_sets(root, "harness.kind=command", 'harness.options.argv=["sh", "-c", "sleep 300"]',
                "rollout.agent_timeout_s=600")],
        stdout=log1, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (len(ids := _sandboxes(root)) >= 2
                   and all(find_processes(i, root / i, ()) for i in ids)):
            assert first.poll() is None, (tmp_path / "first.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no two sandboxes with live agents within 240 s"
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGKILL)  # the trainer alone, mid-step: no teardown runs
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        log1.close()
    left = _sandboxes(root)
    assert set(ids) <= set(left), "a SIGKILLed run leaves its sandbox directories"
    if cgroup.available() is not None:
        assert all(_cgroups(i) for i in left), "and their cgroups"

    second = subprocess.run([CLI, "train", "--out", str(tmp_path / "run2"),
                             *_sets(root, "harness.kind=white_box")],
                            capture_output=True, text=True, env=_env(), timeout=400)

    assert second.returncode == 0, second.stderr[-3000:]
    assert f"sandboxes of killed run (pid {first.pid})" in second.stderr, second.stderr[-3000:]
    assert _sandboxes(root) == [], "the first run's sandboxes are gone, and the second closed its own"
    mounts = Path("/proc/self/mountinfo").read_text()
    for sandbox_id in left:
        assert _cgroups(sandbox_id) == []
        assert find_processes(sandbox_id, root / sandbox_id, ()) == []
        assert sandbox_id not in mounts
        assert not (root / f".dev-{sandbox_id}").exists()
    assert [p.name for p in (root / ".owners").iterdir()] == [], "no record or lock file is left"
