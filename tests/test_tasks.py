"""Task sources: HumanEval from the bundled data, stdio JSONL files, procedural generators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.errors import TaskError
from harnessrl.tasks.humaneval import HumanEvalSource, load_problems
from harnessrl.tasks.procedural import KINDS, ProceduralSource
from harnessrl.tasks.stdio import StdioSource

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "stdio_tasks.jsonl"


def test_humaneval_loads_all_bundled_problems_deterministically() -> None:
    source = HumanEvalSource()
    assert len(source) == 164
    ids = {source.get(i).task_id for i in range(164)}
    assert len(ids) == 164  # the permutation covers every problem once
    assert source.get(7) == HumanEvalSource().get(7)
    assert source.get(7 + 164) == source.get(7)
    assert [source.get(i).task_id for i in range(3)] != ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_humaneval_task_hides_tests_and_solution() -> None:
    source = HumanEvalSource(limit=5)
    assert len(source) == 5
    problems = load_problems()
    for seed in range(5):
        task = source.get(seed)
        problem = problems[task.task_id]
        assert int(task.task_id.split("/")[1]) < 5
        assert task.family == "humaneval"
        assert task.workspace == {"solution.py": problem["prompt"] + "    raise NotImplementedError\n"}
        assert problem["entry_point"] in task.instruction
        assert task.hidden_tests["test"] == problem["test"]
        workspace_text = "".join(task.workspace.values()) + task.instruction
        assert "def check(" not in workspace_text
        assert problem["canonical_solution"] not in workspace_text + json.dumps(task.metadata)


def test_humaneval_bad_limit() -> None:
    with pytest.raises(TaskError, match="limit must be >= 1, got 0"):
        HumanEvalSource(limit=0)


def test_stdio_example_file_parses_all_formats() -> None:
    source = StdioSource(EXAMPLES)
    assert len(source) == 5
    tasks = {source.get(i).task_id: source.get(i) for i in range(5)}
    assert set(tasks) == {"sum-two", "reverse-words", "count-vowels", "max-of-list", "fizzbuzz-n"}
    vowels = tasks["count-vowels"]  # input_output given as a JSON string
    assert vowels.hidden_tests["inputs"] == ["hello\n", "rhythm\n", "aeiou\n"]
    assert vowels.hidden_tests["outputs"] == ["2\n", "0\n", "5\n"]
    assert vowels.hidden_tests["time_limit_s"] == 6.0
    assert vowels.workspace == {}
    assert tasks["reverse-words"].hidden_tests["time_limit_s"] == 4.0
    assert "4 seconds per test" in tasks["reverse-words"].instruction
    assert tasks["max-of-list"].workspace["solution.py"].startswith("import sys")
    for task in tasks.values():
        assert task.family == "stdio"
        for output in task.hidden_tests["outputs"]:
            assert output not in "".join(task.workspace.values())


def _write(tmp_path: Path, *rows: object) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {"prompt": "p", "inputs": ["1\n"], "outputs": ["1\n"]}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", r":2: not valid JSON"),
        ({"inputs": ["1"], "outputs": ["1"]}, r":2: field 'prompt'"),
        ({"prompt": "p", "inputs": ["1", "2"], "outputs": ["1"]}, r":2: field 'outputs': 1 outputs for 2 inputs"),
        ({"prompt": "p", "inputs": [1], "outputs": ["1"]}, r":2: field 'inputs.0'"),
        ({"prompt": "p", "outputs": ["1"]}, r":2: field 'inputs'"),
        ({"prompt": "p"}, r":2: field 'inputs'"),
        ({"prompt": "p", "inputs": [], "outputs": []}, r":2: field 'inputs': at least one"),
        ({"prompt": "p", "input_output": "{bad"}, r":2: field 'input_output': not valid JSON"),
        ({"prompt": "p", "input_output": {"fn_name": "f", "inputs": [], "outputs": []}},
         r":2: field 'input_output.fn_name'"),
        ({"prompt": "p", "input_output": {"inputs": ["1"], "outputs": [2]}},
         r":2: field 'input_output.outputs'"),
        ({**GOOD, "time_limit_s": -1}, r":2: field 'time_limit_s'"),
        ({**GOOD, "task_id": "tasks/1"}, r":2: field 'task_id': 'tasks/1' already used on line 1"),
    ],
)
def test_stdio_malformed_line_names_file_line_and_field(
    tmp_path: Path, bad: object, message: str
) -> None:
    path = _write(tmp_path, GOOD, bad)
    with pytest.raises(TaskError, match=message) as info:
        StdioSource(path)
    assert str(path) in str(info.value)


def test_stdio_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="cannot read"):
        StdioSource(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TaskError, match="no tasks"):
        StdioSource(tmp_path / "empty.jsonl")


def test_procedural_is_deterministic_and_correct() -> None:
    source = ProceduralSource(size=50)
    assert len(source) == 50
    assert [source.get(i) for i in range(50)] == [ProceduralSource(size=50).get(i) for i in range(50)]
    assert source.get(3) == source.get(53)
    kinds = {source.get(i).metadata["kind"] for i in range(50)}
    assert kinds == set(KINDS)
    for i in range(50):
        task = source.get(i)
        question, answer = task.metadata["question"], task.hidden_tests["answer"]
        assert task.workspace == {} and "answer.txt" in task.instruction
        assert task.instruction.startswith(question)
        _check_answer(task.metadata["kind"], question, answer)


def _check_answer(kind: str, question: str, answer: str) -> None:
    """Recompute each kind's answer from its question text."""
    import re

    numbers = [int(n) for n in re.findall(r"\d+", question)]
    quoted = re.findall(r"'([a-z]+)'", question)
    expected = {
        "add": lambda: str(numbers[0] + numbers[1]),
        "sub": lambda: str(numbers[0] - numbers[1]),
        "mul": lambda: str(numbers[0] * numbers[1]),
        "compare": lambda: str(max(numbers)),
        "reverse": lambda: quoted[0][::-1],
        "count": lambda: str(quoted[1].count(quoted[0])),
        "repeat": lambda: str(numbers[0]),
    }[kind]()
    assert answer == expected, (kind, question, answer)


def test_procedural_difficulty_scales_and_offset_changes_tasks() -> None:
    easy = ProceduralSource(kinds=("add",), difficulty=1, size=20)
    hard = ProceduralSource(kinds=("add",), difficulty=3, size=20)
    assert max(int(easy.get(i).hidden_tests["answer"]) for i in range(20)) <= 2 * 99
    assert max(int(hard.get(i).hidden_tests["answer"]) for i in range(20)) > 2 * 99
    shifted = ProceduralSource(kinds=("add",), size=20, seed_offset=1000)
    assert {easy.get(i).task_id for i in range(20)}.isdisjoint({shifted.get(i).task_id for i in range(20)})


def test_procedural_rejects_bad_arguments() -> None:
    with pytest.raises(TaskError, match="unknown \\['divide'\\]"):
        ProceduralSource(kinds=("add", "divide"))
    with pytest.raises(TaskError, match="difficulty must be >= 1, got 0"):
        ProceduralSource(difficulty=0)
