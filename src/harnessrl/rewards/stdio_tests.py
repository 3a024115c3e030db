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
only when the sandbox cannot run commands or the interpreter does not start (a test exits
with status 127 and a probe `python3 -I -c pass` fails too).

Because each test is a separate command, nothing the program does can change this
verifier's comparison; the program can only read the test inputs.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.rewards.base import Reward
from harnessrl.rewards.submission import CopyLimits, code_from_answer, read_submission, stage_verify_dir
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.stdio import DEFAULT_TIME_LIMIT_S


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-normalised equality: same tokens after splitting on whitespace."""
    return actual.split() == expected.split()


class StdioVerifier:
    """Scores `stdio` tasks; see the module docstring.

    Args:
        python: interpreter run inside the sandbox (looked up on the sandbox's PATH).
        solution_file: the agent's program, relative to the workdir.
        max_output_bytes: stdout above this fails the test.
        total_timeout_s: wall budget for all tests of one task (keep it below the rollout
            runner's verify timeout); tests not started within it fail.
        copy_limits: bounds of the workspace copy; past them the rollout is the agent's failure.
    """

    failure_value = 0.0

    def __init__(
        self, python: str = "python3", solution_file: str = "solution.py",
        max_output_bytes: int = 1 << 16, total_timeout_s: float = 90.0,
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
        deadline = time.monotonic() + self.total_timeout_s
        passed, exhausted = 0, False
        try:
            run_dir = await stage_verify_dir(sandbox, files, limits=self.copy_limits)
            for i, expected in enumerate(outputs):
                if time.monotonic() >= deadline:
                    exhausted = True
                    break
                cmd = f"exec {shlex.quote(self.python)} -I solution.py < input_{i}.txt"
                result = await sandbox.exec(cmd, limit_s, cwd=run_dir)
                if result.returncode == 127 and not await self._python_runs(sandbox, run_dir):
                    return Reward(value=None, error=f"stdio verifier: {result.stderr[-300:]}")
                ok = (
                    result.returncode == 0
                    and not result.timed_out
                    and len(result.stdout.encode()) <= self.max_output_bytes
                    and outputs_match(result.stdout, expected)
                )
                passed += ok
        except SandboxLimitError as e:
            parts = {"tests_passed": 0.0, "tests_total": float(total), "format_ok": 1.0, "budget_exhausted": 0.0}
            return Reward.agent_failure(f"stdio verifier refused the workspace: {e}", parts=parts)
        except SandboxError as e:
            return Reward(value=None, error=f"stdio verifier could not run: {e}")
        parts = {
            "tests_passed": float(passed), "tests_total": float(total), "format_ok": 1.0,
            "budget_exhausted": float(exhausted),
        }
        return Reward(value=passed / total, parts=parts)

    async def _python_runs(self, sandbox: Sandbox, run_dir: Path) -> bool:
        """Whether the interpreter starts at all (tells a missing python from a program that
        exits with status 127 itself)."""
        probe = await sandbox.exec([self.python, "-I", "-c", "pass"], 30, cwd=run_dir)
        return probe.returncode == 0
