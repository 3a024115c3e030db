"""Standard-input/standard-output program tasks from a user JSONL file.

Responsibility: load a JSONL file of programming problems judged by running a program on
inputs and comparing its output (DeepCoder / TACO / APPS / MBPP-style) into `Task`s of
family `stdio`; `rewards/stdio_tests.py` scores them.

One JSON object per line (blank lines are skipped); fields:
  * `task_id` (str, optional): defaults to `<file stem>/<line number>`; must be unique.
  * `prompt` or `question` (str, one required): the problem statement.
  * `inputs` and `outputs` (lists of str, same non-zero length): stdin of each hidden test
    and its expected stdout. Instead of these two, `input_output` may hold an object (or a
    JSON string of one, as DeepCoder and APPS ship it) with keys `inputs` and `outputs`.
    Call-based tests (`fn_name` in `input_output`) are rejected.
  * `starter_code` (str, optional): initial content of `solution.py`.
  * `time_limit_s` (number > 0, optional): per-test wall limit, default 6 s.
Other fields are ignored. A malformed line raises `TaskError` naming `file:line` and the field.

The agent writes `solution.py`; it is run as `python3 solution.py < input` per test. The
hidden inputs and outputs stay in `Task.hidden_tests`, never in the workspace.
Order: `get(seed)` is `tasks[order[seed % len]]` with a fixed permutation (random.Random
seeded with "stdio" and the file's task ids).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harnessrl.errors import TaskError
from harnessrl.tasks.base import Task

DEFAULT_TIME_LIMIT_S = 6.0
INSTRUCTION = """\
{statement}

Write a complete Python 3 program in the file `solution.py` in the current directory. It must
read the input from standard input and print the answer to standard output. It will be run as
`python3 solution.py < input` on hidden tests, {time_limit_s:g} seconds per test.
"""


class StdioRecord(BaseModel):
    """One line of a stdio task file (see the module docstring for the fields)."""

    model_config = ConfigDict(extra="ignore")

    task_id: str | None = None
    prompt: str | None = None
    question: str | None = None
    inputs: list[str] | None = None
    outputs: list[str] | None = None
    input_output: str | dict[str, Any] | None = None
    starter_code: str | None = None
    time_limit_s: float | None = Field(default=None, gt=0)


def _tests_of(rec: StdioRecord) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a record; raises ValueError("field: why") when malformed."""
    if rec.inputs is not None or rec.outputs is not None:
        if rec.inputs is None or rec.outputs is None:
            missing = "inputs" if rec.inputs is None else "outputs"
            raise ValueError(f"{missing}: required when the other of inputs/outputs is given")
        return rec.inputs, rec.outputs
    if rec.input_output is None:
        raise ValueError("inputs: required (or input_output)")
    io = rec.input_output
    if isinstance(io, str):
        try:
            io = json.loads(io)
        except json.JSONDecodeError as e:
            raise ValueError(f"input_output: not valid JSON ({e})") from e
    if not isinstance(io, dict):
        raise ValueError("input_output: must be an object with inputs and outputs")
    if "fn_name" in io:
        raise ValueError("input_output.fn_name: call-based tests are not supported, only stdin/stdout")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    for name, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"input_output.{name}: must be a list of strings")
    return inputs, outputs  # type: ignore[return-value]


def parse_line(line: str, where: str, default_id: str) -> Task:
    """The Task of one JSONL line; raises TaskError naming `where` (file:line) and the field."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    try:
        rec = StdioRecord.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise TaskError(f"{where}: field {field!r}: {first['msg']}") from e
    statement = rec.prompt if rec.prompt is not None else rec.question
    if not statement or not statement.strip():
        raise TaskError(f"{where}: field 'prompt': required (or 'question'), non-empty")
    try:
        inputs, outputs = _tests_of(rec)
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        raise TaskError(f"{where}: field {field!r}: {why}") from e
    if not inputs:
        raise TaskError(f"{where}: field 'inputs': at least one test is required")
    if len(inputs) != len(outputs):
        raise TaskError(
            f"{where}: field 'outputs': {len(outputs)} outputs for {len(inputs)} inputs"
        )
    time_limit_s = rec.time_limit_s or DEFAULT_TIME_LIMIT_S
    return Task(
        task_id=rec.task_id or default_id,
        family="stdio",
        instruction=INSTRUCTION.format(statement=statement.strip(), time_limit_s=time_limit_s),
        workspace={"solution.py": rec.starter_code} if rec.starter_code else {},
        hidden_tests={"inputs": inputs, "outputs": outputs, "time_limit_s": time_limit_s},
        metadata={"source": where},
    )


class StdioSource:
    """The tasks of a stdio JSONL file as a `TaskSource`.

    Args:
        path: the JSONL file (format in the module docstring).

    Raises TaskError when the file is missing, empty, has a malformed line or a duplicate id.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise TaskError(f"stdio task file {path}: cannot read: {e}") from e
        tasks: list[Task] = []
        seen: dict[str, int] = {}
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            task = parse_line(line, f"{path}:{lineno}", f"{path.stem}/{lineno}")
            if task.task_id in seen:
                raise TaskError(
                    f"{path}:{lineno}: field 'task_id': {task.task_id!r} already used on line "
                    f"{seen[task.task_id]}"
                )
            seen[task.task_id] = lineno
            tasks.append(task)
        if not tasks:
            raise TaskError(f"stdio task file {path}: no tasks")
        random.Random("stdio:" + ",".join(t.task_id for t in tasks)).shuffle(tasks)
        self._tasks = tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, seed: int) -> Task:
        return self._tasks[seed % len(self._tasks)]
