"""Exact-answer verifier for `procedural` tasks (tasks/procedural.py).

Responsibility: compare the agent's answer to the hidden one. The answer text is the content of
`answer.txt` in the workdir when it exists and is non-empty, else the `final_answer` string the
harness passes (text-only harnesses, `answer_via = "reply"`).

The answer is the text the task asks for, not a number found somewhere in it. After stripping
surrounding whitespace (a trailing newline included) and one pair of matching quotes or
backticks:
  * integer answers: the whole text is one integer (`-?\\d+`, a leading `+` allowed, no
    thousands separators), or its last non-empty line is, or its last line ends in `= N`
    (`5 * 7 = 35` gives 35). Anything else (`The answer is 35`, `API Error: 400`) is not an
    answer. Compared as integers (`007` = `7`, `-0` = `0`), on the digits, so an answer of any
    length is compared (a 5,000-digit one included), never a crash.
  * string answers: the whole text is one word (no whitespace inside); compared exactly.

Reward 1.0 / 0.0; parts `correct` (same value) and `format_ok` (1.0 when the text is a
well-formed answer of the expected kind by the rules above, right or wrong). Nothing the agent
wrote is run, so this verifier has no timeout and no error path besides a malformed task
(KeyError): whatever the agent wrote is a score.
"""

from __future__ import annotations

import re

from harnessrl.rewards.base import Reward
from harnessrl.rewards.submission import read_submission
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.procedural import ANSWER_FILE

_INT = re.compile(r"[+-]?\d+")
_ENDS_IN_EQUALS_INT = re.compile(r"=\s*([+-]?\d+)\Z")
_WORD = re.compile(r"\S+")


def parse_answer(text: str | None, answer_kind: str) -> str | None:
    """The answer `text` gives as a normalised string, or None when it is not a well-formed
    answer of `answer_kind` ("int" or "str"); the rules are in the module docstring.

    Examples: "42\\n" -> "42"; "007" -> "7"; "work\\n12" -> "12"; "5 * 7 = 35" -> "35";
    "The answer is 35" -> None; "'olleh'" -> "olleh" (str); "two words" -> None (str).
    """
    if text is None:
        return None
    stripped = _unquote(text.strip())
    if not stripped:
        return None
    if answer_kind == "int":
        if _INT.fullmatch(stripped):
            return _canonical_int(stripped)
        last = _unquote(stripped.splitlines()[-1].strip())
        if _INT.fullmatch(last):
            return _canonical_int(last)
        equals = _ENDS_IN_EQUALS_INT.search(last)
        if equals is not None:
            return _canonical_int(equals.group(1))
        return None
    return stripped if _WORD.fullmatch(stripped) else None


def _canonical_int(text: str) -> str:
    """`str(int(text))` for a `[+-]?\\d+` string, computed on the digits: `int()` refuses more
    than `sys.get_int_max_str_digits()` (4,300) digits, and an answer of any length must score."""
    sign = "-" if text[0] == "-" else ""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"`":
        return text[1:-1].strip()
    return text


class ExactMatchVerifier:
    """Scores `procedural` tasks; see the module docstring.

    Args:
        answer_file: the file the agent writes, relative to the workdir.
    """

    failure_value = 0.0

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
