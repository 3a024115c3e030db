"""The multi-turn task of `bench/learning.py --task lookup`, as both of its arms see it.

Tasks: harnessrl's own procedural `lookup` family (`harnessrl.tasks.procedural`: the number in a
named file of a workspace holding it and two distractor files; at difficulty d the sum of d such
numbers), built by the same `ProceduralSource` for both arms with `answer_via = "reply"`, so the
answer is the assistant's last reply (`What is the number in oak.txt? Reply with only the
number.`, the task's system message `You are a careful assistant. Answer exactly.`). Training
task k is `ProceduralSource(...).get(k)`, which is what harnessrl's orchestrator draws for group k
(TRL's dataset holds the same tasks in the same order and is not shuffled); held-out tasks are
those of seed offset `HELD_OUT_OFFSET` (harnessrl's own held-out shift, `EVAL_SEED_OFFSET`).

One tool, `bash(command)`: the command runs with `bash -c` in a directory holding the task's
workspace files, and its result is `exit code N\\n` + stdout + stderr, cut at 4,000 characters,
as harnessrl's white-box loop (`harness/python_loop.py`) returns it. The verifier's outcome is
harnessrl's `ExactMatchVerifier` rule (`rewards/exact_match.py:parse_answer`) on the final
answer: the content of the last assistant message (the reply without a tool call that ends the
loop, or the last reply when the turn budget ran out).

For TRL (`environment_factory`, trl 1.16): `LookupEnv` is the environment, one instance per
rollout; its public method `bash` is the tool (TRL renders its schema from the signature and
docstring, so the tool's description matches harnessrl's and its parameter carries one more
description line); `reset(**row)` writes the row's workspace and returns None (the prompt is the
dataset row's own); the reward is `reward` below, a reward function over the final messages
(`get_reward` takes no arguments, and the environment does not see the final reply). This module
imports harnessrl lazily (with `src/` on the path) so the TRL arm's own venv can use it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
KINDS = ("lookup", "lookup_count", "lookup_json")
HELD_OUT_OFFSET = 1_000_000
"""Seed offset of the held-out tasks (harnessrl's `train/evaluation.py:EVAL_SEED_OFFSET`)."""
SIZE = 1000
"""Distinct training tasks (`ProceduralSource.size`, harnessrl's procedural default)."""
COMMAND_TIMEOUT_S = 20.0
MAX_TOOL_OUTPUT_CHARS = 4000
"""harnessrl's white-box defaults (`command_timeout_s`, `max_tool_output_chars`)."""


def _harnessrl() -> None:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))


def source(kind: str = "lookup", difficulty: int = 1, seed_offset: int = 0) -> Any:
    """harnessrl's `ProceduralSource` of the family: one kind, answers as the reply."""
    _harnessrl()
    from harnessrl.tasks.procedural import ProceduralSource

    return ProceduralSource(kinds=[kind], difficulty=difficulty, size=SIZE, seed_offset=seed_offset,
                            answer_via="reply")


def rows(n: int, kind: str = "lookup", difficulty: int = 1, seed_offset: int = 0) -> list[dict[str, Any]]:
    """Tasks 0..n-1 of `source(...)` as TRL dataset rows: the conversational prompt (system +
    user), the workspace as JSON, the answer and its kind."""
    src = source(kind, difficulty, seed_offset)
    out = []
    for k in range(n):
        task = src.get(k)
        out.append({"prompt": [{"role": "system", "content": task.system_prompt},
                               {"role": "user", "content": task.instruction}],
                    "workspace": json.dumps(task.workspace), "answer": task.hidden_tests["answer"],
                    "answer_kind": task.hidden_tests["answer_kind"], "task_id": task.task_id})
    return out


def run_bash(command: str, cwd: Path, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """`command` under `bash -c` in `cwd`, formatted as harnessrl's white-box `bash` tool result."""
    try:
        res = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        code, timed_out, out, err = res.returncode, False, res.stdout, res.stderr
    except subprocess.TimeoutExpired as exc:
        code, timed_out, out, err = -9, True, exc.stdout or b"", exc.stderr or b""
    text = (f"exit code {code}{' (timed out)' if timed_out else ''}\n"
            f"{out.decode('utf-8', 'replace')}{err.decode('utf-8', 'replace')}")
    return text[:MAX_TOOL_OUTPUT_CHARS]


class LookupEnv:
    """TRL environment (`GRPOTrainer(environment_factory=LookupEnv)`): one workspace directory,
    rewritten by every `reset`; its one tool is `bash`."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="lookup-env-"))

    def reset(self, **row: Any) -> None:
        """Write the row's workspace files (and nothing else) into the directory."""
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True)
        for rel, text in json.loads(row["workspace"]).items():
            path = self._dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return None

    def bash(self, command: str) -> str:
        """Run a bash command in the working directory.

        Args:
            command: The command to run.
        """
        return run_bash(command, self._dir)


def final_answer(messages: list[dict[str, Any]]) -> str | None:
    """The content of the last assistant message of a completion (TRL's list of messages)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return m.get("content") or ""
    return None


def outcome(text: str | None, answer: str, answer_kind: str = "int") -> float:
    """harnessrl's exact-match verifier outcome for `text` given as the final answer."""
    _harnessrl()
    from harnessrl.rewards.exact_match import parse_answer

    found = parse_answer(text, answer_kind)
    return float(found is not None and found == answer)


def reward(completions: list[list[dict[str, Any]]], answer: list[str], answer_kind: list[str],
           **_: Any) -> list[float]:
    """TRL reward function: the verifier's outcome on each completion's final answer."""
    return [outcome(final_answer(c), a, k) for c, a, k in zip(completions, answer, answer_kind)]


reward.__name__ = "lookup_exact_match"
