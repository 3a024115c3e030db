"""Standard-input/standard-output test verifier: the fraction of hidden tests a program passes.

Responsibility: score a `stdio` task (tasks/stdio.py). Each hidden test runs
`python3 -I solution.py < input_<i>.txt` in a fresh `verify-<hex>/` directory (beside the
workdir, rewards/submission.py) holding a copy of the agent's `solution.py`, the test inputs
(never the expected outputs, which stay in this process) and a link-free workspace copy, as
its own sandbox command with the task's wall limit. A test passes when the program exits 0
within the limit, prints at most `max_output_bytes`, and its stdout equals the expected
output after whitespace normalisation: both are split on runs of whitespace and the token
lists compared (so trailing spaces, blank lines and line-ending differences are ignored,
token order and content are not).

Reward = tests_passed / tests_total, parts `tests_passed`, `tests_total`, `format_ok`
(a submission was found) and `budget_exhausted` (1.0 when the overall `total_timeout_s` ran
out and the remaining tests were counted as failed). A program that loops forever fails its
tests (reward 0 for those), it is not a verifier error. A workspace past the copy bounds
(`CopyLimits`), a filesystem the agent filled, or a sandbox past its `disk_bytes` is the
agent's failure (`Reward.agent_failure`: 0.0, cause recorded). `Reward(value=None, error=...)`
only when the sandbox cannot run commands or the interpreter does not start: a probe
`python3 -I -c pass` runs in the fresh directory before any of the agent's code, so nothing
the submission does can make it fail, and every outcome of a test after it (any exit status,
127 included, a timeout, a directory the submission made unenterable or removed) is the
submission's.

Budget (rewards/base.py): all tests end within the rollout's verify budget (`verify_budget`,
below `rollout.verify_timeout_s`); each test's limit is cut to what is left, and a test cut
short or not started fails (`budget_exhausted`). A submission that sleeps through every test
scores 0, never an unscored rollout.

Because each test is a separate command, nothing the program does can change this
verifier's comparison; the program can only read the test inputs.
"""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path

from harnessrl.errors import SandboxError, SandboxLimitError, SandboxLostError
from harnessrl.rewards.base import Reward, limit_cause, verify_deadline
from harnessrl.rewards.submission import CopyLimits, code_from_answer, read_submission, stage_verify_dir
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.stdio import DEFAULT_TIME_LIMIT_S


log = logging.getLogger(__name__)

DEFAULT_TOTAL_TIMEOUT_S = 50.0
"""Wall budget of all tests of a task when the verifier is called outside a rollout (no
`verify_budget` set), seconds: the default `rollout.verify_timeout_s` (60) less its margin."""
PROBE_LIMIT_S = 30.0
"""Wall limit of the interpreter probe, seconds (cut to the budget left, down to `PROBE_MIN_S`)."""
PROBE_MIN_S = 5.0
"""Least wall seconds the probe is given: it is the verifier's own work, not the submission's."""
MIN_TEST_S = 0.05
"""A test is not started with less than this many seconds of the budget left (it fails)."""


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-normalised equality: same tokens after splitting on whitespace."""
    return actual.split() == expected.split()


class StdioVerifier:
    """Scores `stdio` tasks; see the module docstring.

    Args:
        python: interpreter run inside the sandbox (looked up on the sandbox's PATH).
        solution_file: the agent's program, relative to the workdir.
        max_output_bytes: stdout above this fails the test.
        total_timeout_s: wall budget for all tests of one task, seconds. None (the default): the
            rollout's verify budget (`rewards/base.verify_budget`, `DEFAULT_TOTAL_TIMEOUT_S` when
            called outside a rollout); a value is cut to that budget too. Tests not run within it
            fail, and so does a test cut short by it.
        copy_limits: bounds of the workspace copy; past them the rollout is the agent's failure.
    """

    failure_value = 0.0

    def __init__(
        self, python: str = "python3", solution_file: str = "solution.py",
        max_output_bytes: int = 1 << 16, total_timeout_s: float | None = None,
        copy_limits: CopyLimits = CopyLimits(),
    ) -> None:
        self.python = python
        self.solution_file = solution_file
        self.max_output_bytes = max_output_bytes
        self.total_timeout_s = total_timeout_s
        self.copy_limits = copy_limits

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """Fraction of hidden tests passed.

        Expects `task.hidden_tests` = {"inputs": [str], "outputs": [str], "time_limit_s": float?}.
        """
        inputs: list[str] = task.hidden_tests["inputs"]
        outputs: list[str] = task.hidden_tests["outputs"]
        total = len(outputs)
        source = read_submission(sandbox, self.solution_file) or code_from_answer(final_answer)
        if source is None:
            parts = {"tests_passed": 0.0, "tests_total": float(total), "format_ok": 0.0}
            return Reward(value=0.0, parts=parts | {"budget_exhausted": 0.0})
        limit_s = float(task.hidden_tests.get("time_limit_s", DEFAULT_TIME_LIMIT_S))
        files = {"solution.py": source} | {f"input_{i}.txt": text for i, text in enumerate(inputs)}
        deadline = verify_deadline(self.total_timeout_s or DEFAULT_TOTAL_TIMEOUT_S)
        if self.total_timeout_s is not None:
            deadline = min(deadline, time.monotonic() + self.total_timeout_s)
        try:
            run_dir = await stage_verify_dir(sandbox, files, limits=self.copy_limits)
            # before any of the agent's code runs: nothing it does can make this fail
            probe = await self._python_fails(sandbox, run_dir, deadline)
        except SandboxLimitError as e:
            parts = {"tests_passed": 0.0, "tests_total": float(total), "format_ok": 1.0, "budget_exhausted": 0.0}
            return Reward.agent_failure(f"stdio verifier refused the workspace: {e}", parts=parts)
        except SandboxError as e:
            return Reward(value=None, error=f"stdio verifier could not run: {e}")
        if probe is not None:
            return Reward(value=None, error=f"stdio verifier: the interpreter does not start: {probe}")
        passed, exhausted = await self._run_tests(sandbox, run_dir, outputs, limit_s, deadline)
        parts = {
            "tests_passed": float(passed), "tests_total": float(total), "format_ok": 1.0,
            "budget_exhausted": float(exhausted),
        }
        return Reward(value=passed / total, parts=parts)

    async def _run_tests(self, sandbox: Sandbox, run_dir: Path, outputs: list[str], limit_s: float,
                         deadline: float) -> tuple[int, bool]:
        """(tests passed, whether the budget ran out). Every outcome of a test is the
        submission's: a timeout, any exit status (127 included: the interpreter started for the
        probe), a command that cannot start in a directory the submission took away."""
        passed = 0
        for i, expected in enumerate(outputs):
            left = deadline - time.monotonic()
            if left < MIN_TEST_S:
                return passed, True
            cmd = f"exec {shlex.quote(self.python)} -I solution.py < input_{i}.txt"
            try:
                result = await sandbox.exec(cmd, min(limit_s, left), cwd=run_dir)
            except (SandboxError, OSError) as e:
                if isinstance(e, SandboxLostError) or limit_cause(e) is not None:
                    raise  # a lost machine is unscored; a bound the agent filled, its failure
                log.info("stdio test %d did not start after the submission ran (counted failed): %s", i, e)
                continue
            if result.timed_out and left < limit_s:
                return passed, True
            passed += (
                result.returncode == 0
                and not result.timed_out
                and len(result.stdout.encode()) <= self.max_output_bytes
                and outputs_match(result.stdout, expected)
            )
        return passed, False

    async def _python_fails(self, sandbox: Sandbox, run_dir: Path, deadline: float) -> str | None:
        """Why the interpreter does not start in `run_dir` (None: it does). Run before the
        submission, so a missing interpreter is told from a program failing in any way."""
        limit = max(PROBE_MIN_S, min(PROBE_LIMIT_S, deadline - time.monotonic()))
        probe = await sandbox.exec([self.python, "-I", "-c", "pass"], limit, cwd=run_dir)
        if probe.returncode == 0 and not probe.timed_out:
            return None
        return f"returncode={probe.returncode} timed_out={probe.timed_out}: {probe.stderr[-300:]}"
