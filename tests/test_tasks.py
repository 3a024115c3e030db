"""Task sources: HumanEval from the bundled data, stdio JSONL files, procedural generators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.errors import TaskError
from harnessrl.tasks.humaneval import HumanEvalSource, load_problems
from harnessrl.tasks.procedural import KINDS, LOOKUP_KINDS, ProceduralSource
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
        assert "answer.txt" in task.instruction and task.instruction.startswith(question)
        if task.metadata["kind"] in LOOKUP_KINDS:
            assert task.workspace and answer not in task.instruction
        else:
            assert task.workspace == {}
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


# The shell command a lookup phrase asks for (what an agent would run), applied to real files.
_LOOKUP_PHRASES = [
    (r"the number in (\w+\.txt)", lambda m: ["cat", m[1]]),
    (r"the number of lines of (\w+\.txt) that contain '(\w+)'", lambda m: ["grep", "-c", m[2], m[1]]),
    (r'the value of "(\w+)" in (\w+\.json)',
     lambda m: ["python3", "-c", f"import json; print(json.load(open({m[2]!r}))[{m[1]!r}])"]),
]


def _observe(question: str, workdir: Path) -> int:
    """The answer of a lookup question found by running, in `workdir`, the command each of its
    phrases asks for (cat / grep -c / a JSON read), summed over the phrases."""
    import re
    import subprocess

    total, found = 0, 0
    for pattern, argv in _LOOKUP_PHRASES:
        for m in re.finditer(pattern, question):
            out = subprocess.run(argv(m), cwd=workdir, capture_output=True, text=True, timeout=10, check=True)
            total += int(out.stdout.strip())
            found += 1
    assert found, question
    return total


@pytest.mark.parametrize("difficulty", [1, 2])
@pytest.mark.parametrize("kind", LOOKUP_KINDS)
async def test_lookup_answer_is_in_the_workspace_only_and_the_verifier_checks_it(
    tmp_path: Path, kind: str, difficulty: int
) -> None:
    """Each lookup task's answer is found by running the command its question asks for on the
    real workspace files of a real sandbox (d lookups summed at difficulty d), is not in the
    instruction, and the exact-match verifier scores it 1 and a near miss 0."""
    import re

    from harnessrl.rewards.exact_match import ExactMatchVerifier
    from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig

    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx"))
    source = ProceduralSource(kinds=(kind,), difficulty=difficulty, size=100)
    verifier = ExactMatchVerifier()
    for seed in range(6):
        task = source.get(seed)
        assert task.metadata["kind"] == kind and task.task_id.endswith(f"/d={difficulty}")
        assert task.instruction.count(" plus ") == difficulty - 1
        assert len(task.workspace) == difficulty + 2  # the asked files and two distractors
        assert not re.search(rf"\b{task.hidden_tests['answer']}\b", task.instruction)
        sb = await backend.create(f"{kind}-{difficulty}-{seed}", dict(task.workspace))
        try:
            answer = _observe(task.metadata["question"], sb.workdir)
            assert str(answer) == task.hidden_tests["answer"]
            sb.write_file("answer.txt", f"{answer + 1}\n")
            assert (await verifier.score(task, sb, None)).parts == {"correct": 0.0, "format_ok": 1.0}
            sb.write_file("answer.txt", f"{answer}\n")
            assert (await verifier.score(task, sb, None)).value == 1.0
        finally:
            await sb.close()


@pytest.mark.parametrize(("kind", "stated"), [("lookup", 1 / 90), ("lookup_count", 1 / 20), ("lookup_json", 1 / 90)])
@pytest.mark.parametrize("difficulty", [1, 2])
def test_lookup_chance_rate_is_the_stated_one(kind: str, difficulty: int, stated: float) -> None:
    """The best constant answer (a rollout that never looks) passes at most the chance rate the
    module docstring states, measured over 2,000 tasks (+1.5 points of sampling slack)."""
    from collections import Counter

    source = ProceduralSource(kinds=(kind,), difficulty=difficulty, size=2000)
    answers = Counter(source.get(i).hidden_tests["answer"] for i in range(2000))
    best = answers.most_common(1)[0][1] / 2000
    assert best <= stated + 0.015, (kind, difficulty, answers.most_common(3))
    assert len(answers) >= 0.7 / stated  # spread over the range, not a few values


def test_lookup_held_out_tasks_come_from_another_seed_range() -> None:
    """The held-out split of a lookup run draws other seeds: no held-out task id, and no
    held-out workspace, equals a training one."""
    from harnessrl.runtime import make_task_source
    from harnessrl.tasks.config import ProceduralTasks
    from harnessrl.train.evaluation import held_out_split

    cfg = ProceduralTasks(kinds=["lookup"])
    train, held_out = held_out_split(cfg, make_task_source(cfg), 16)
    train_tasks = [train.get(i) for i in range(300)]
    held = [held_out.get(i) for i in range(16)]
    assert len({t.task_id for t in held}) == 16
    assert {t.task_id for t in held}.isdisjoint({t.task_id for t in train_tasks})
    assert all(t.metadata["kind"] == "lookup" and t.workspace for t in held)
    assert not {tuple(t.workspace.items()) for t in held} & {tuple(t.workspace.items()) for t in train_tasks}
