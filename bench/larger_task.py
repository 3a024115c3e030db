"""The learning benchmark's task, shared by both arms (no harnessrl import at module level, so
the TRL arm's own venv imports it too).

Prompt i of a set with seed s: `a, b = rng.sample(range(1, 100), 2)` drawing in turn from one
`rng = random.Random(f"larger-{s}")`; the user message is `Which number is larger, {a} or {b}?
Reply with only the number.` with no system message of ours (the chat template adds its
default). Training seed 1234, held-out seed 987654.

Rewards: `lenient` is 1 when the first integer in the reply equals the larger number; `strict`
is 1 when the whole reply (stripped) is that number; `format_aware` is 1 when strict, 0.5 when
only lenient, else 0 (the format-aware variant).
"""

from __future__ import annotations

import random
import re
from typing import Any

TRAIN_SEED = 1234
HELD_OUT_SEED = 987654
PROMPT = "Which number is larger, {a} or {b}? Reply with only the number."
_INT = re.compile(r"-?\d+")


def pairs(seed: int, n: int) -> list[tuple[int, int]]:
    """The first `n` (a, b) pairs of the set with `seed`."""
    rng = random.Random(f"larger-{seed}")
    return [tuple(rng.sample(range(1, 100), 2)) for _ in range(n)]  # type: ignore[misc]


def prompt(a: int, b: int) -> str:
    return PROMPT.format(a=a, b=b)


def lenient(text: str, answer: int) -> float:
    m = _INT.search(text or "")
    return float(bool(m) and int(m.group()) == answer)


def strict(text: str, answer: int) -> float:
    return float((text or "").strip() == str(answer))


def format_aware(text: str, answer: int) -> float:
    return 1.0 if strict(text, answer) else 0.5 * lenient(text, answer)


REWARDS = {"lenient": lenient, "format_aware": format_aware}


class LargerSource:
    """harnessrl `TaskSource` of the training set: seed k is prompt k % size."""

    def __init__(self, seed: int = TRAIN_SEED, size: int = 10_000) -> None:
        self._pairs = pairs(seed, size)

    def __len__(self) -> int:
        return len(self._pairs)

    def get(self, seed: int) -> Any:
        from harnessrl.tasks.base import Task

        a, b = self._pairs[seed % len(self._pairs)]
        return Task(task_id=f"larger/{a}-{b}", family="larger", instruction=prompt(a, b),
                    hidden_tests={"answer": max(a, b)})


def make_source(seed: int = TRAIN_SEED) -> LargerSource:
    return LargerSource(seed)


class LargerVerifier:
    """Scores the reply (`final_answer`) with one of `REWARDS`."""

    def __init__(self, reward: str = "lenient") -> None:
        self._fn = REWARDS[reward]

    async def score(self, task: Any, sandbox: Any, final_answer: str | None) -> Any:
        from harnessrl.rewards.base import Reward

        text, answer = final_answer or "", task.hidden_tests["answer"]
        return Reward(self._fn(text, answer), parts={"lenient": lenient(text, answer), "strict": strict(text, answer)})


def make_verifier(reward: str = "lenient") -> LargerVerifier:
    return LargerVerifier(reward)
