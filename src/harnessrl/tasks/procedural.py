"""Procedural tasks with exact answers, generated from a seed.

Responsibility: a built-in, dependency-free task family (`procedural`) that a 135M model can
sometimes solve, so the CPU default recipe has a reward signal; its lookup kinds need a look
at the workspace first (multi-turn). `rewards/exact_match.py`
scores it.

Kinds (numbers scale with `difficulty` d >= 1; n_max = 10**(d+1) - 1, so 99 at d=1):
  * `add`: a + b, a, b in [0, n_max];        `sub`: a - b (may be negative);
  * `mul`: a * b, a, b in [2, 10**d - 1 (at least 9)];
  * `compare`: the larger of two distinct numbers in [1, n_max];
  * `reverse`: a string of 2 + 2d lowercase letters, reversed;
  * `count`: occurrences of a letter in a string of 4 + 4d letters from a 4-letter alphabet;
  * `repeat`: a number in [1, n_max], given back (the answer is in the question: what is
    learnt is the agent's action format, the first thing a small model must get right).

Lookup kinds: the answer is only in the task's workspace files, so no one-turn reply can know
it; the agent must observe a file first (one command), then answer (another). At difficulty 1
a task is one lookup; at difficulty d >= 2 it is d lookups of the same kind and the answer is
their sum (`What is the number in fig.txt plus the number in plum.txt?`). File names are
distinct words (`fig.txt`), and each workspace also holds two distractor files of the same form.
  * `lookup`: the number in a named file (`cat fig.txt`): one integer in [10, 99] a file;
  * `lookup_count`: how many lines of a named file contain a word (`grep -c red fig.txt`): the
    count is drawn in [1, 20], the file has 1-10 further lines of other words;
  * `lookup_json`: the value of a key in a small JSON file (`cat fig.json`): 4 keys, integer
    values in [10, 99].
Chance rate (an answer given without looking: the best constant guess, which passes when the
answer happens to equal it): at difficulty 1, 1/90 = 1.1% for `lookup` and `lookup_json` and
1/20 = 5% for `lookup_count`; at difficulty 2 (a sum of two) 1/90 and 1/20 at most again
(`tests/test_tasks.py` measures the best constant guess over 2,000 tasks of each).
The answer must be the whole text the agent gives (an integer, or one word for string
answers; rules in `rewards/exact_match.py`), not a number found somewhere in it.

Determinism: task `get(seed)` uses index i = seed % size and draws everything from
`random.Random(f"procedural:{seed_offset + i}:{difficulty}")` (string seeds hash with SHA-512,
stable across processes and Python versions), so the same (seed, constructor args) always
gives the same task. The agent is asked to write its answer to `answer.txt`
(`INSTRUCTION`: `Which of the two numbers 71 and 27 is larger? Write the answer to answer.txt.`).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Sequence

from harnessrl.errors import TaskError
from harnessrl.tasks.base import Task

ANSWER_FILE = "answer.txt"
INSTRUCTION = "{question} Write the answer to {answer_file}."
"""Instruction when `answer_via="file"` (the default): one short line, the form the compact
mini-swe-agent prompt's worked examples use (a 135M model follows a pattern it has just seen
far better than a paragraph of rules)."""

REPLY_INSTRUCTION = "{question} Reply with only the {what}."
"""Instruction when `answer_via="reply"`: the answer is the assistant's reply itself (the
verifier reads `final_answer`), for single-turn chat harnesses."""

Generator = Callable[[random.Random, int], tuple[str, str, str] | tuple[str, str, str, dict[str, str]]]
"""(rng, difficulty) -> (question, answer, answer kind "int" | "str"), and for the lookup kinds
the workspace files as a fourth item (relative path -> text)."""


def _n_max(d: int) -> int:
    return 10 ** (d + 1) - 1


def _add(rng: random.Random, d: int) -> tuple[str, str, str]:
    a, b = rng.randint(0, _n_max(d)), rng.randint(0, _n_max(d))
    return f"What is {a} + {b}?", str(a + b), "int"


def _sub(rng: random.Random, d: int) -> tuple[str, str, str]:
    a, b = rng.randint(0, _n_max(d)), rng.randint(0, _n_max(d))
    return f"What is {a} - {b}?", str(a - b), "int"


def _mul(rng: random.Random, d: int) -> tuple[str, str, str]:
    hi = max(9, 10**d - 1)
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    return f"What is {a} * {b}?", str(a * b), "int"


def _compare(rng: random.Random, d: int) -> tuple[str, str, str]:
    a, b = rng.sample(range(1, _n_max(d) + 1), 2)
    return f"Which of the two numbers {a} and {b} is larger?", str(max(a, b)), "int"


def _reverse(rng: random.Random, d: int) -> tuple[str, str, str]:
    word = "".join(rng.choices(string.ascii_lowercase, k=2 + 2 * d))
    return f"Reverse the string '{word}'.", word[::-1], "str"


def _count(rng: random.Random, d: int) -> tuple[str, str, str]:
    alphabet = rng.sample(string.ascii_lowercase, 4)
    word = "".join(rng.choices(alphabet, k=4 + 4 * d))
    letter = rng.choice(alphabet)
    return f"How many times does the letter '{letter}' appear in '{word}'?", str(word.count(letter)), "int"


def _repeat(rng: random.Random, d: int) -> tuple[str, str, str]:
    n = rng.randint(1, _n_max(d))
    return f"Repeat the number {n}.", str(n), "int"


_NAMES = ("fig", "plum", "kiwi", "lime", "pear", "date", "oak", "elm", "ash", "fir", "jade", "ruby",
          "onyx", "opal", "wolf", "bear", "hawk", "crow", "frog", "moth", "reef", "dune", "cove", "glen")
"""Workspace file stems (distinct, short, one token or two for SmolLM2)."""
_WORDS = ("red", "blue", "gold", "pink", "gray", "teal")
"""Line words of `lookup_count` files; none contains another."""
_KEYS = ("width", "height", "depth", "speed", "price", "count", "level", "score")
"""Keys of `lookup_json` files."""
DISTRACTORS = 2
"""Extra files of the same form in every lookup workspace (not asked about)."""


def _number_file(rng: random.Random, stem: str) -> tuple[str, int, dict[str, str], str]:
    n = rng.randint(10, 99)
    return f"the number in {stem}.txt", n, {f"{stem}.txt": f"{n}\n"}, ""


def _count_file(rng: random.Random, stem: str) -> tuple[str, int, dict[str, str], str]:
    word = rng.choice(_WORDS)
    k = rng.randint(1, 20)
    lines = [word] * k + rng.choices([w for w in _WORDS if w != word], k=rng.randint(1, 10))
    rng.shuffle(lines)
    return (f"the number of lines of {stem}.txt that contain '{word}'", k,
            {f"{stem}.txt": "\n".join(lines) + "\n"}, word)


def _json_file(rng: random.Random, stem: str) -> tuple[str, int, dict[str, str], str]:
    keys = rng.sample(_KEYS, 4)
    values = {key: rng.randint(10, 99) for key in keys}
    key = rng.choice(keys)
    return f'the value of "{key}" in {stem}.json', values[key], {f"{stem}.json": json.dumps(values) + "\n"}, key


def _lookups(one: Callable[[random.Random, str], tuple[str, int, dict[str, str], str]]) -> Generator:
    """A lookup kind: `d` lookups made by `one` (their sum is the answer) plus `DISTRACTORS`
    files of the same form, all under distinct stems."""

    def generate(rng: random.Random, d: int) -> tuple[str, str, str, dict[str, str]]:
        stems = rng.sample(_NAMES, d + DISTRACTORS)
        phrases, total, workspace = [], 0, {}
        for i, stem in enumerate(stems):
            phrase, value, files, _ = one(rng, stem)
            workspace.update(files)
            if i < d:
                phrases.append(phrase)
                total += value
        question = f"What is {' plus '.join(phrases)}?"
        return question, str(total), "int", dict(sorted(workspace.items()))

    return generate


KINDS: dict[str, Generator] = {
    "add": _add, "sub": _sub, "mul": _mul, "compare": _compare, "reverse": _reverse,
    "count": _count, "repeat": _repeat,
    "lookup": _lookups(_number_file), "lookup_count": _lookups(_count_file),
    "lookup_json": _lookups(_json_file),
}
"""Every kind a `ProceduralSource` can draw from."""
LOOKUP_KINDS = ("lookup", "lookup_count", "lookup_json")
"""The kinds whose answer is only in the workspace (module docstring)."""


class ProceduralSource:
    """Seeded arithmetic, string and lookup tasks as a `TaskSource`.

    Args:
        kinds: which generators to draw from (keys of `KINDS`); each task picks one by seed.
        difficulty: >= 1; scales number sizes and string lengths (module docstring).
        size: number of distinct tasks (`len`); seed i and i + size give the same task.
        seed_offset: shifts the generator seeds, giving a disjoint-looking set (e.g. eval).
        answer_via: `file` asks the agent to write `answer.txt`; `reply` asks for the answer
            as the reply itself (single-turn harnesses).

    Raises TaskError for an unknown kind, difficulty < 1 or size < 1.
    """

    def __init__(
        self, kinds: Sequence[str] = tuple(KINDS), difficulty: int = 1, size: int = 1000,
        seed_offset: int = 0, answer_via: str = "file",
    ) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise TaskError(f"ProceduralSource kinds: unknown {unknown or kinds!r}; known {sorted(KINDS)}")
        if difficulty < 1:
            raise TaskError(f"ProceduralSource difficulty must be >= 1, got {difficulty}")
        if size < 1:
            raise TaskError(f"ProceduralSource size must be >= 1, got {size}")
        self.kinds = tuple(kinds)
        self.difficulty = difficulty
        self.size = size
        self.seed_offset = seed_offset
        if answer_via not in ("file", "reply"):
            raise TaskError(f"ProceduralSource answer_via must be 'file' or 'reply', got {answer_via!r}")
        self.answer_via = answer_via

    def __len__(self) -> int:
        return self.size

    def get(self, seed: int) -> Task:
        index = self.seed_offset + seed % self.size
        rng = random.Random(f"procedural:{index}:{self.difficulty}")
        kind = self.kinds[rng.randrange(len(self.kinds))]
        question, answer, answer_kind, *files = KINDS[kind](rng, self.difficulty)
        workspace: dict[str, str] = files[0] if files else {}
        if self.answer_via == "reply":
            what = "number" if answer_kind == "int" else "resulting text"
            instruction = REPLY_INSTRUCTION.format(question=question, what=what)
        else:
            instruction = INSTRUCTION.format(question=question, answer_file=ANSWER_FILE)
        return Task(
            task_id=f"procedural/{kind}/i={index}/d={self.difficulty}",
            family="procedural",
            instruction=instruction,
            workspace=workspace,
            hidden_tests={"answer": answer, "answer_kind": answer_kind},
            system_prompt="You are a careful assistant. Answer exactly.",
            metadata={"kind": kind, "question": question},
        )
