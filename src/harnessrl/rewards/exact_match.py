"""Exact-answer verifier for `procedural` tasks (tasks/procedural.py).

Responsibility: compare the agent's answer to the hidden one. The answer is the text of
`answer.txt` in the workdir when it exists and is non-empty, else the `final_answer` string
the harness passes (text-only harnesses). Integer answers: the first integer in that text
(`-?\\d+`, thousands separators not understood) must equal the hidden one. String answers: the
text stripped of whitespace and of one pair of surrounding quotes must equal it exactly.

Reward 1.0 / 0.0; parts `correct` (same value) and `format_ok` (1.0 when an answer was found:
a non-empty text, and for integer answers an integer in it). Nothing the agent wrote is run,
so this verifier has no timeout and no error path besides a malformed task (KeyError).
"""

from __future__ import annotations

import re

from harnessrl.rewards.base import Reward
from harnessrl.rewards.submission import read_submission
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.procedural import ANSWER_FILE

_INT = re.compile(r"-?\d+")


def parse_answer(text: str | None, answer_kind: str) -> str | None:
    """The answer found in `text` as a normalised string, or None when there is none.

    `answer_kind` "int": the first integer, normalised by int() ("007" -> "7", "-0" -> "0").
    "str": the stripped text with one pair of matching surrounding quotes removed.
    """
    if text is None or not text.strip():
        return None
    if answer_kind == "int":
        match = _INT.search(text)
        return str(int(match.group())) if match else None
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"`":
        stripped = stripped[1:-1]
    return stripped


class ExactMatchVerifier:
    """Scores `procedural` tasks; see the module docstring.

    Args:
        answer_file: the file the agent writes, relative to the workdir.
    """

    def __init__(self, answer_file: str = ANSWER_FILE) -> None:
        self.answer_file = answer_file

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """1.0 when the parsed answer equals `task.hidden_tests["answer"]`, else 0.0.

        Expects `task.hidden_tests` = {"answer": str, "answer_kind": "int" | "str"}.
        """
        kind: str = task.hidden_tests["answer_kind"]
        text = read_submission(sandbox, self.answer_file)
        if text is None or not text.strip():
            text = final_answer
        found = parse_answer(text, kind)
        correct = float(found is not None and found == task.hidden_tests["answer"])
        return Reward(value=correct, parts={"correct": correct, "format_ok": float(found is not None)})
