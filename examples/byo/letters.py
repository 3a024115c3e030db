"""A bring-your-own task family and verifier for harnessrl, in one small module.

Tasks: "How many times does the letter L occur in WORD?"; the agent answers in its reply (or in
`answer.txt`). The verifier gives 1.0 for the right count, 0.0 otherwise, and reports whether a
number was found at all.

Used by `examples/byo/letters.toml`:

    [tasks]
    kind = "python"
    source = "examples/byo/letters.py:make_tasks"      # or "my_pkg.letters:make_tasks"
    kwargs = { words = ["strawberry", "banana"] }
    verifier = "examples/byo/letters.py:LetterCountVerifier"

A task source is any callable returning a list of `Task` (as here) or an object with
`__len__()` and `get(seed) -> Task`. A verifier is any object with
`score(task, sandbox, final_answer) -> Reward` (async or not).
"""

from __future__ import annotations

import re

from harnessrl.rewards.base import Reward
from harnessrl.rewards.submission import read_submission
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task

DEFAULT_WORDS = ("strawberry", "banana", "bookkeeper", "mississippi", "committee", "parallel")


def make_tasks(words: list[str] = list(DEFAULT_WORDS), letter_rank: int = 0) -> list[Task]:
    """One task per word, asking for the count of its `letter_rank`-th most frequent letter."""
    tasks = []
    for word in words:
        letters = sorted(set(word), key=lambda c: (-word.count(c), c))
        letter = letters[min(letter_rank, len(letters) - 1)]
        tasks.append(Task(
            task_id=f"letters/{word}/{letter}",
            family="letters",
            instruction=f"How many times does the letter '{letter}' occur in the word '{word}'? "
                        "Reply with the number only.",
            hidden_tests={"answer": word.count(letter)},
        ))
    return tasks


class LetterCountVerifier:
    """1.0 when the first number of the answer (digits or a word such as "twice") is the right
    count; the answer is `answer.txt` when the agent wrote one, else its reply."""

    def __init__(self, answer_file: str = "answer.txt") -> None:
        self.answer_file = answer_file

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        # read_submission opens the file without following links the agent may have planted
        text = read_submission(sandbox, self.answer_file) or final_answer or ""
        found = first_number(text)
        correct = float(found is not None and found == task.hidden_tests["answer"])
        return Reward(value=correct, parts={"correct": correct, "number_found": float(found is not None)})


_WORDS = {"once": 1, "twice": 2, "thrice": 3, "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4,
          "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
_NUMBER = re.compile(r"-?\d+|\b(?:" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def first_number(text: str) -> int | None:
    """The first number in `text`, as digits or a word ("3", "three", "thrice"), else None."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    token = match.group().lower()
    return _WORDS[token] if token in _WORDS else int(token)
