"""No opting out of a reward (DESIGN.md §3.5): an outcome the agent caused scores as a failure with
its cause recorded on the rollout, never None; only infrastructure faults are unscored.

Each cause runs as a real rollout: a command agent in a real local sandbox writes a correct
submission and then does the damage (an answer of 5,000 digits, a write past `disk_bytes`, every
inode of a small tmpfs, a workspace past the verifier's copy bounds); the verifiers are the real
ones. A rollout the agent took out of the baseline (reward None) would raise its own advantage
by hiding its failure, so each must be `reward == 0.0`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes import FakeBackend, FakeSessions
from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.base import Reward, limit_cause
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rewards.select import verifier_for
from harnessrl.rewards.stdio_tests import StdioVerifier
from harnessrl.rewards.submission import CopyLimits, new_verify_dir, stage_verify_dir
from harnessrl.rewards.unit_tests import UnitTestVerifier
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import Rollout

UNIT = Task("add/0", "humaneval", "Write add(a, b).", workspace={"solution.py": "def add(a, b):\n    pass\n"},
            hidden_tests={"test": "def check(c):\n    assert c(2, 3) == 5\n", "entry_point": "add"})
STDIO = Task("sum/0", "stdio", "Print a + b.", hidden_tests={"inputs": ["2 3\n"], "outputs": ["5\n"]})
EXACT = Task("n/0", "procedural", "Write 42.", hidden_tests={"answer": "42", "answer_kind": "int"})
SUBMIT = {
    "humaneval": "open('solution.py', 'w').write('def add(a, b):\\n    return a + b\\n')\n",
    "stdio": "open('solution.py', 'w').write('a, b = map(int, input().split())\\nprint(a + b)\\n')\n",
    "procedural": "open('answer.txt', 'w').write('42\\n')\n",
}


async def _rollout(task: Task, script: str, backend: object, verifier: object | None = None) -> Rollout:
    harness = CommandHarness(CommandHarnessConfig(argv=["python3", "{state_dir}/agent.py"],
                                                  files={"agent.py": script}))
    return await run_rollout(task, 0, harness, backend, FakeSessions(), verifier or verifier_for(task),  # type: ignore[arg-type]
                             RolloutLimits(agent_timeout_s=60, verify_timeout_s=60))


def _backend(root: Path, **config: object) -> LocalSandboxBackend:
    return LocalSandboxBackend(SandboxConfig(root_dir=root, use_bwrap=False, kill_grace_s=0.2, **config))  # type: ignore[arg-type]


def _failed_by_agent(rollout: Rollout, *words: str) -> None:
    assert rollout.reward == 0.0, (rollout.status, rollout.reward, rollout.error)
    assert rollout.reward_parts.get("agent_fault") == 1.0, rollout.reward_parts
    cause = rollout.metadata.get("failure_cause", "")
    assert all(w in cause for w in words), cause
    assert rollout.status != "verifier_error"


@pytest.mark.parametrize("task", [UNIT, STDIO, EXACT], ids=lambda t: t.family)
async def test_a_correct_submission_still_scores(task: Task, sandbox_root: Path) -> None:
    rollout = await _rollout(task, SUBMIT[task.family], _backend(sandbox_root))
    assert (rollout.status, rollout.reward) == ("ok", 1.0), rollout.error
    assert "failure_cause" not in rollout.metadata


async def test_a_5000_digit_answer_is_scored_not_a_crash(sandbox_root: Path) -> None:
    long = "9" * 5000
    rollout = await _rollout(EXACT, f"open('answer.txt', 'w').write('{long}\\n')\n", _backend(sandbox_root))
    assert (rollout.status, rollout.reward, rollout.reward_parts) == ("ok", 0.0, {"correct": 0.0, "format_ok": 1.0})
    right = Task("n/1", "procedural", "", hidden_tests={"answer": long, "answer_kind": "int"})
    rollout = await _rollout(right, f"open('answer.txt', 'w').write('+000{long}')\n", _backend(sandbox_root))
    assert (rollout.status, rollout.reward) == ("ok", 1.0), rollout.error


def _kit_backend(kit: str, root: Path, **config: object) -> object:
    """A backend of kind `kit` ("plain", "bwrap", "podman"); skipped where it cannot run."""
    from sandbox_kits import KITS, kit_available

    kit_available(kit)
    return KITS[kit].backend(root, kill_grace_s=0.2, **config)


KITS_UNDER_TEST = ["plain", "bwrap", "podman"]


@pytest.mark.parametrize("kit", KITS_UNDER_TEST)
@pytest.mark.parametrize("task", [UNIT, STDIO, EXACT], ids=lambda t: t.family)
async def test_writing_past_disk_bytes_after_submitting_scores_zero(task: Task, kit: str, sandbox_root: Path) -> None:
    script = SUBMIT[task.family] + ("import time\nwith open('big.bin', 'wb') as f:\n"
                                    "    for _ in range(64):\n        f.write(b'x' * (1 << 16))\n        f.flush()\n"
                                    "time.sleep(30)\n")
    rollout = await _rollout(task, script, _kit_backend(kit, sandbox_root, disk_bytes=1 << 20, disk_poll_s=0.05))
    _failed_by_agent(rollout, "disk_bytes")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 120 inodes (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=120", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kit", KITS_UNDER_TEST)
@pytest.mark.parametrize("task", [UNIT, STDIO], ids=lambda t: t.family)
async def test_exhausting_inodes_after_submitting_scores_zero(task: Task, kit: str, small_fs: Path) -> None:
    script = SUBMIT[task.family] + ("import itertools, os\nos.mkdir('many')\n"
                                    "for i in itertools.count():\n    try:\n"
                                    "        open(f'many/{i}', 'w').close()\n    except OSError:\n        break\n")
    rollout = await _rollout(task, script, _kit_backend(kit, small_fs / "sbx"))
    _failed_by_agent(rollout, "full")


@pytest.mark.parametrize("task", [UNIT, STDIO], ids=lambda t: t.family)
async def test_a_workspace_past_the_copy_bounds_scores_zero(task: Task, sandbox_root: Path) -> None:
    limits = CopyLimits(max_entries=50)
    verifier = UnitTestVerifier(copy_limits=limits) if task.family == "humaneval" else StdioVerifier(copy_limits=limits)
    script = SUBMIT[task.family] + "import os\nos.mkdir('d')\nfor i in range(60):\n    open(f'd/{i}', 'w').close()\n"
    rollout = await _rollout(task, script, _backend(sandbox_root), verifier)
    _failed_by_agent(rollout, "max_entries=50")
    deep = SUBMIT[task.family] + "import os\nos.makedirs('/'.join(['d'] * 40))\n"
    rollout = await _rollout(task, deep, _backend(sandbox_root), type(verifier)())
    _failed_by_agent(rollout, "max_depth=32")


class Raising:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        raise self.exc


@pytest.mark.parametrize(("exc", "agents"), [
    (SandboxLimitError("sandbox s exceeded max_inodes=100"), True),
    (SandboxError("sandbox s exceeded max_inodes=100; cannot run 'python3'"), True),
    (SandboxError("sandbox s exceeded disk_bytes=1048576; cannot run 'python3'"), True),
    (SandboxError("cannot write the verify directory"), False),
    (RuntimeError("verifier bug"), False),
], ids=["limit-error", "inode-message", "disk-message", "other-sandbox-error", "crash"])
async def test_only_infrastructure_faults_are_unscored(tmp_path: Path, exc: Exception, agents: bool) -> None:
    harness = CommandHarness(CommandHarnessConfig(argv=["true"]))
    rollout = await run_rollout(UNIT, 0, harness, FakeBackend(tmp_path), FakeSessions(), Raising(exc))
    if agents:
        _failed_by_agent(rollout, str(exc).split(";")[0])
    else:
        assert (rollout.status, rollout.reward) == ("verifier_error", None), rollout
    full = OSError(28, "No space left on device")
    assert limit_cause(full) is not None and limit_cause(SandboxError("x")) is None


def test_a_wrapped_verifier_gives_its_own_failure_value() -> None:
    from harnessrl.rewards.base import failure_value
    from harnessrl.rewards.select import UserVerifier

    class Signed:
        failure_value = -1.0

        def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
            return Reward(value=1.0)

    assert failure_value(UserVerifier(Signed())) == -1.0 and failure_value(UnitTestVerifier()) == 0.0
    assert failure_value(object()) == 0.0


async def test_a_sandbox_recording_a_bound_is_not_verified(tmp_path: Path) -> None:
    class Counting(ExactMatchVerifier):
        failure_value = -1.0
        calls = 0

        async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
            Counting.calls += 1
            return await super().score(task, sandbox, final_answer)  # type: ignore[arg-type]

    class Over(FakeBackend):
        async def create(self, rollout_id: str, workspace: dict[str, str]):  # noqa: ANN201
            sandbox = await super().create(rollout_id, workspace)
            sandbox.limit_exceeded = "max_inodes=10 exceeded"  # type: ignore[attr-defined]
            return sandbox

    harness = CommandHarness(CommandHarnessConfig(argv=["true"]))
    rollout = await run_rollout(EXACT, 0, harness, Over(tmp_path), FakeSessions(), Counting())
    assert rollout.reward == -1.0 and Counting.calls == 0  # the verifier's own failure value
    assert "max_inodes=10" in rollout.metadata["failure_cause"] and rollout.error == rollout.metadata["failure_cause"]


async def test_the_workspace_copy_runs_off_the_event_loop(sandbox_root: Path) -> None:
    """While a large workspace is copied for verification, a sibling coroutine keeps its pace:
    the longest gap between its 5 ms ticks stays far below the copy's duration (on the loop,
    one gap would be the whole copy)."""
    backend = _backend(sandbox_root)
    sb = await backend.create("big", {})
    try:
        made = await sb.exec("mkdir -p w && cd w && for d in $(seq 40); do mkdir $d && (cd $d && touch $(seq 240)); "
                             "done", 120)
        assert made.returncode == 0, made
        loop_thread = threading.get_ident()
        copier: list[int] = []
        real = new_verify_dir

        def recording(*args: object, **kwargs: object) -> Path:
            copier.append(threading.get_ident())
            return real(*args, **kwargs)  # type: ignore[arg-type]

        ticks: list[float] = []
        stop = asyncio.Event()

        async def sibling() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        import harnessrl.rewards.submission as submission

        ticking = asyncio.ensure_future(sibling())
        await asyncio.sleep(0.05)
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, submission, "new_verify_dir", real)
            submission.new_verify_dir = recording
            t0 = time.monotonic()
            path = await stage_verify_dir(sb, {"run.py": ""})
            copy_s = time.monotonic() - t0
        stop.set()
        await ticking
        assert copier and copier[0] != loop_thread
        assert len(os.listdir(path / "w")) == 40
        during = [t for t in ticks if t0 <= t <= t0 + copy_s]
        gaps = [b - a for a, b in zip(during, during[1:])] or [copy_s]
        assert copy_s > 0.2, f"the copy took {copy_s:.3f} s: too small a workspace to tell"
        assert max(gaps) < copy_s / 4, (max(gaps), copy_s)
    finally:
        await sb.close()


class Returning:
    def __init__(self, value: float) -> None:
        self.value = value

    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        return Reward(value=self.value, parts={"tests_passed": 1.0})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
async def test_a_non_finite_verdict_is_a_verifier_error_naming_it(tmp_path: Path, value: float) -> None:
    harness = CommandHarness(CommandHarnessConfig(argv=["true"]))
    rollout = await run_rollout(EXACT, 0, harness, FakeBackend(tmp_path), FakeSessions(), Returning(value))
    assert (rollout.status, rollout.reward) == ("verifier_error", None), rollout
    assert rollout.error == f"verifier returned reward {value!r}, which is not finite"
    assert rollout.reward_parts == {"tests_passed": 1.0}
