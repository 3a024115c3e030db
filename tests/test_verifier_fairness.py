"""No opting out, by construction (DESIGN.md §3.5): whatever a submission does, a rollout of every
verifier kind the project ships scores the verifier's failure value, never None.

Each case is a real rollout in a real bubblewrap sandbox: a command agent writes a submission
(or does the damage itself), the real verifier scores it under a `verify_timeout_s` far below
what the hidden tests would take at their own limits. The ways a submission fails: it sleeps
through every test, crashes, makes its directories unenterable (and exits 127, the status a
missing interpreter gives), removes its own run directory, is missing, prints 64 MiB, or kills
its own interpreter. A rollout scored None would leave its group's baseline and raise its own
advantage: each must be `reward == 0.0` with a status other than `verifier_error`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import FakeSessions
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.select import make_verifier_for, verifier_for
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.tasks.base import Task
from harnessrl.types import Rollout
from sandbox_kits import KITS, kit_available

N_TESTS = 10
STDIO = Task("sum/0", "stdio", "Print a + b.",
             hidden_tests={"inputs": [f"{i} 1\n" for i in range(N_TESTS)],
                           "outputs": [f"{i + 1}\n" for i in range(N_TESTS)], "time_limit_s": 2.0})
"""Ten tests of 2 s each: a sleeper takes 20 s at their limits, the rollout's budget is 6 s."""
UNIT = Task("add/0", "humaneval", "Write add(a, b).", workspace={"solution.py": "def add(a, b):\n    pass\n"},
            hidden_tests={"test": "def check(c):\n    assert c(2, 3) == 5\n", "entry_point": "add",
                          "timeout_s": 20.0})
EXACT = Task("n/0", "procedural", "Write 42.", hidden_tests={"answer": "42", "answer_kind": "int"})
LIMITS = RolloutLimits(agent_timeout_s=30, verify_timeout_s=6)

SUBMISSIONS = {
    "slow": "import time\ntime.sleep(600)\n",
    "crash": "raise SystemExit(3)\n",
    "unenterable": "import os\nos.chmod('.', 0)\nos.chmod('..', 0)\nos._exit(127)\n",
    "removes_its_directory": "import os, shutil\nshutil.rmtree(os.getcwd())\nos._exit(127)\n",
    "huge_output": "import sys\nsys.stdout.write('x' * (64 << 20))\n",
    "killed_interpreter": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
}
"""Submission sources: each runs where the verifier runs the agent's code."""

AGENT_DAMAGE = {
    "missing": "",
    "unenterable_workspace": "import os\nos.chmod('.', 0)\nos.chmod(os.environ['HARNESSRL_SANDBOX_DIR'], 0)\n",
}
"""What an agent does to its sandbox after writing (or without writing) a submission."""


def _agent(files: dict[str, str], damage: str = "") -> str:
    writes = "".join(f"open({name!r}, 'w').write({text!r})\n" for name, text in files.items())
    return writes + damage


async def _rollout(task: Task, script: str, root: Path, verifier: object | None = None) -> Rollout:
    kit_available("bwrap")
    backend = KITS["bwrap"].backend(root, kill_grace_s=0.2)
    harness = CommandHarness(CommandHarnessConfig(argv=["python3", "{state_dir}/agent.py"],
                                                  files={"agent.py": script}))
    return await run_rollout(task, 0, harness, backend, FakeSessions(), verifier or verifier_for(task),  # type: ignore[arg-type]
                             LIMITS)


def _scored_failure(rollout: Rollout) -> None:
    assert rollout.reward == 0.0, (rollout.status, rollout.reward, rollout.error, rollout.reward_parts)
    assert rollout.status != "verifier_error", rollout.error


CODE_CASES = [(kind, mode) for kind in ("stdio", "humaneval", "named") for mode in sorted(SUBMISSIONS)]


@pytest.mark.parametrize(("kind", "mode"), CODE_CASES, ids=[f"{k}-{m}" for k, m in CODE_CASES])
async def test_a_failing_submission_scores_the_failure_value(kind: str, mode: str, sandbox_root: Path) -> None:
    source = SUBMISSIONS[mode]
    if kind == "humaneval":
        rollout = await _rollout(UNIT, _agent({"solution.py": source}), sandbox_root)
    elif kind == "stdio":
        rollout = await _rollout(STDIO, _agent({"solution.py": source}), sandbox_root)
    else:  # a config-named verifier (`tasks.verifier`), the route of `kind = "python"` task sources
        named = make_verifier_for("harnessrl.rewards.stdio_tests:StdioVerifier")(STDIO)
        rollout = await _rollout(STDIO, _agent({"solution.py": source}), sandbox_root, named)
    _scored_failure(rollout)


DAMAGE_CASES = [(task, mode) for task in (STDIO, UNIT, EXACT) for mode in sorted(AGENT_DAMAGE)]


@pytest.mark.parametrize(("task", "mode"), DAMAGE_CASES, ids=[f"{t.family}-{m}" for t, m in DAMAGE_CASES])
async def test_an_agent_that_damages_its_sandbox_scores_the_failure_value(
        task: Task, mode: str, sandbox_root: Path) -> None:
    wrong = {"stdio": {"solution.py": "print(0)\n"}, "humaneval": {"solution.py": "def add(a, b):\n    return 0\n"},
             "procedural": {"answer.txt": "41\n"}}[task.family]
    files = {} if mode == "missing" else wrong
    _scored_failure(await _rollout(task, _agent(files, AGENT_DAMAGE[mode]), sandbox_root))


ANSWERS = {
    "huge": "open('answer.txt', 'w').write('4' * (8 << 20))\n",
    "directory": "import os\nos.mkdir('answer.txt')\n",
    "fifo": "import os\nos.mkfifo('answer.txt')\n",
    "link_out": "import os\nos.symlink('/etc/passwd', 'answer.txt')\n",
    "unreadable": "import os\nopen('answer.txt', 'w').write('41')\nos.chmod('answer.txt', 0)\n",
}


@pytest.mark.parametrize("mode", sorted(ANSWERS))
async def test_a_malformed_answer_file_scores_the_failure_value(mode: str, sandbox_root: Path) -> None:
    _scored_failure(await _rollout(EXACT, ANSWERS[mode], sandbox_root))


async def test_an_honest_slow_partly_right_solution_is_scored(sandbox_root: Path) -> None:
    """Right on the even inputs at once, slow (past each test's limit) on the odd ones: 10 tests
    at 2 s would take 10 s, the rollout's budget is 6 s; the passed tests count."""
    source = ("import time\na, b = map(int, input().split())\n"
              "if a % 2:\n    time.sleep(600)\nprint(a + b)\n")
    rollout = await _rollout(STDIO, _agent({"solution.py": source}), sandbox_root)
    assert rollout.status != "verifier_error", rollout.error
    assert rollout.reward is not None and 0.0 < rollout.reward <= 0.5, (rollout.reward, rollout.reward_parts)
    assert rollout.reward_parts["tests_passed"] >= 1.0
    assert json.dumps(rollout.reward_parts)
