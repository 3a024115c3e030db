"""Verifiers scored against real local sandboxes: HumanEval unit tests, stdio tests, exact match."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnessrl.errors import TaskError
from harnessrl.rewards.exact_match import ExactMatchVerifier, parse_answer
from harnessrl.rewards.select import verifier_for
from harnessrl.rewards.stdio_tests import StdioVerifier, outputs_match
from harnessrl.rewards.unit_tests import UnitTestVerifier
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import LocalSandbox, LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.tasks.humaneval import HumanEvalSource, load_problems
from harnessrl.tasks.procedural import ProceduralSource
from harnessrl.tasks.stdio import StdioSource

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "stdio_tasks.jsonl"


@pytest.fixture
async def backend(tmp_path: Path) -> LocalSandboxBackend:
    return LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx"))


@pytest.fixture
def he_task() -> Task:
    source = HumanEvalSource()
    return next(source.get(i) for i in range(len(source)) if source.get(i).task_id == "HumanEval/0")


@pytest.fixture
async def he_sandbox(backend: LocalSandboxBackend, he_task: Task) -> AsyncIterator[LocalSandbox]:
    sb = await backend.create("he", dict(he_task.workspace))
    yield sb
    await sb.close()


def _canonical(task_id: str) -> str:
    problem = load_problems()[task_id]
    return problem["prompt"] + problem["canonical_solution"]


async def test_humaneval_canonical_solution_passes(he_task: Task, he_sandbox: LocalSandbox) -> None:
    he_sandbox.write_file("solution.py", _canonical("HumanEval/0"))
    reward = await UnitTestVerifier().score(he_task, he_sandbox, None)
    assert reward.value == 1.0 and reward.error is None
    assert reward.parts == {"passed": 1.0, "format_ok": 1.0, "timed_out": 0.0}


async def test_humaneval_wrong_solution_fails(he_task: Task, he_sandbox: LocalSandbox) -> None:
    wrong = he_task.workspace["solution.py"].replace("raise NotImplementedError", "return False")
    he_sandbox.write_file("solution.py", wrong)
    reward = await UnitTestVerifier().score(he_task, he_sandbox, None)
    assert reward.value == 0.0 and reward.error is None and reward.parts["format_ok"] == 1.0


async def test_humaneval_untouched_stub_scores_zero(he_task: Task, he_sandbox: LocalSandbox) -> None:
    reward = await UnitTestVerifier().score(he_task, he_sandbox, None)
    assert reward.value == 0.0 and reward.error is None


@pytest.mark.parametrize(
    "cheat",
    ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "print('HARNESSRL-PASS 0')\nraise SystemExit(0)\n"],
    ids=["sys.exit", "os._exit", "forged-line"],
)
async def test_humaneval_early_exit_is_not_a_pass(
    he_task: Task, he_sandbox: LocalSandbox, cheat: str
) -> None:
    he_sandbox.write_file("solution.py", cheat)
    reward = await UnitTestVerifier().score(he_task, he_sandbox, None)
    assert reward.value == 0.0 and reward.error is None


async def test_humaneval_agent_files_cannot_replace_verifier_code(
    he_task: Task, he_sandbox: LocalSandbox
) -> None:
    # A wrong solution plus planted modules that would make every check pass if imported.
    he_sandbox.write_file("solution.py", "def has_close_elements(n, t):\n    return False\n")
    he_sandbox.write_file("sitecustomize.py", "import os\nos._exit(0)\n")
    he_sandbox.write_file("os.py", "raise SystemExit(0)\n")
    he_sandbox.write_file("run.py", "print('HARNESSRL-READY')\n")
    reward = await UnitTestVerifier().score(he_task, he_sandbox, None)
    assert reward.value == 0.0 and reward.error is None


async def test_humaneval_infinite_loop_times_out_as_zero(
    he_task: Task, he_sandbox: LocalSandbox
) -> None:
    he_sandbox.write_file("solution.py", "def has_close_elements(n, t):\n    while True:\n        pass\n")
    task = dataclasses.replace(he_task, hidden_tests={**he_task.hidden_tests, "timeout_s": 1.0})
    reward = await UnitTestVerifier().score(task, he_sandbox, None)
    assert reward.value == 0.0 and reward.error is None
    assert reward.parts["timed_out"] == 1.0
    assert he_sandbox.list_processes() == []


async def test_humaneval_falls_back_to_code_in_final_answer(
    he_task: Task, backend: LocalSandboxBackend
) -> None:
    sb = await backend.create("fallback", {})  # no solution.py at all
    answer = f"Here it is:\n```python\n{_canonical('HumanEval/0')}```\nDone."
    assert (await UnitTestVerifier().score(he_task, sb, answer)).value == 1.0
    missing = await UnitTestVerifier().score(he_task, sb, "no code here")
    assert missing.value == 0.0 and missing.parts["format_ok"] == 0.0
    await sb.close()


async def test_humaneval_missing_interpreter_is_verifier_error(
    he_task: Task, he_sandbox: LocalSandbox
) -> None:
    he_sandbox.write_file("solution.py", _canonical("HumanEval/0"))
    reward = await UnitTestVerifier(python="/nonexistent/python3").score(he_task, he_sandbox, None)
    assert reward.value is None and reward.error is not None and "did not start" in reward.error


async def test_humaneval_sample_of_canonical_solutions(backend: LocalSandboxBackend) -> None:
    source = HumanEvalSource()
    for seed in range(4):
        task = source.get(seed)
        sb = await backend.create(f"he{seed}", dict(task.workspace))
        sb.write_file("solution.py", _canonical(task.task_id))
        reward = await UnitTestVerifier().score(task, sb, None)
        assert reward.value == 1.0, (task.task_id, reward)
        await sb.close()


def _stdio_task(name: str) -> Task:
    source = StdioSource(EXAMPLES)
    return next(source.get(i) for i in range(len(source)) if source.get(i).task_id == name)


async def test_stdio_fractional_reward(backend: LocalSandboxBackend) -> None:
    task = _stdio_task("sum-two")  # tests: 1 2 | 10 -3 | 0 0 | 123456 654321
    sb = await backend.create("stdio", dict(task.workspace))
    # Right unless b is negative: fails exactly "10 -3" (prints 13, expected 7).
    sb.write_file("solution.py", "a, b = map(int, input().split())\nprint(a + abs(b))\n")
    reward = await StdioVerifier().score(task, sb, None)
    assert reward.value == 0.75
    assert reward.parts["tests_passed"] == 3.0 and reward.parts["tests_total"] == 4.0
    await sb.close()


async def test_stdio_whitespace_normalised_and_exit_status(backend: LocalSandboxBackend) -> None:
    task = _stdio_task("reverse-words")
    sb = await backend.create("ws", {})
    sb.write_file("solution.py", "print('  ' + '   '.join(reversed(input().split())) + '  \\n\\n')\n")
    assert (await StdioVerifier().score(task, sb, None)).value == 1.0
    sb.write_file("solution.py", "print(' '.join(reversed(input().split())))\nraise SystemExit(3)\n")
    assert (await StdioVerifier().score(task, sb, None)).value == 0.0
    await sb.close()


async def test_stdio_infinite_loop_fails_tests_not_verifier(backend: LocalSandboxBackend) -> None:
    task = _stdio_task("reverse-words")
    task = dataclasses.replace(task, hidden_tests={**task.hidden_tests, "time_limit_s": 0.5})
    sb = await backend.create("loop", {})
    sb.write_file("solution.py", "import sys\nif 'a' in sys.stdin.read():\n    while True: pass\nprint('single')\n")
    reward = await StdioVerifier().score(task, sb, None)
    # "a b c" loops (fails); "hello world" prints single (wrong); "single" passes.
    assert reward.error is None and reward.value == pytest.approx(1 / 3)
    assert sb.list_processes() == []
    await sb.close()


async def test_stdio_budget_exhaustion_counts_remaining_as_failed(backend: LocalSandboxBackend) -> None:
    task = _stdio_task("sum-two")
    sb = await backend.create("budget", {})
    sb.write_file("solution.py", "a, b = map(int, input().split())\nprint(a + b)\n")
    reward = await StdioVerifier(total_timeout_s=0.0).score(task, sb, None)
    assert reward.value == 0.0 and reward.parts["budget_exhausted"] == 1.0
    await sb.close()


async def test_stdio_exit_127_from_program_is_not_a_verifier_error(backend: LocalSandboxBackend) -> None:
    task = _stdio_task("sum-two")
    sb = await backend.create("e127", {})
    sb.write_file("solution.py", "raise SystemExit(127)\n")
    reward = await StdioVerifier().score(task, sb, None)
    assert reward.value == 0.0 and reward.error is None
    missing = await StdioVerifier(python="/nonexistent/python3").score(task, sb, None)
    assert missing.value is None and missing.error is not None
    await sb.close()


def test_outputs_match_normalises_whitespace_only() -> None:
    assert outputs_match("1 2\r\n3  \n\n", "1 2\n3\n")
    assert not outputs_match("1 23\n", "1 2 3\n")
    assert not outputs_match("3 2 1", "1 2 3")


@pytest.mark.parametrize(
    ("text", "kind", "parsed"),
    [
        ("42\n", "int", "42"),
        ("  -17 \n\n", "int", "-17"),
        ("+5", "int", "5"),
        ("007", "int", "7"),
        ("'12'", "int", "12"),
        ("5 * 7 = 35", "int", "35"),  # the result, not the first operand
        ("a = 3, b = 4, a + b = 7\n", "int", "7"),
        ("First 12 + 30.\nThen:\n42\n", "int", "42"),  # a lone number on the last line
        ("The answer is -17, not 3.", "int", None),
        ("API Error: 400", "int", None),
        ("42 apples", "int", None),
        ("1,000", "int", None),
        ("no digits", "int", None),
        ("", "int", None),
        ("  'olleh'\n", "str", "olleh"),
        ("olleh", "str", "olleh"),
        ("The reverse is olleh", "str", None),
        ("API Error: 400", "str", None),
        ("   ", "str", None),
    ],
)
def test_parse_answer(text: str, kind: str, parsed: str | None) -> None:
    assert parse_answer(text, kind) == parsed


async def test_exact_match_reads_answer_file_then_final_answer(backend: LocalSandboxBackend) -> None:
    task = ProceduralSource(kinds=("add",), size=10).get(0)
    answer = task.hidden_tests["answer"]
    verifier = ExactMatchVerifier()
    sb = await backend.create("pm", dict(task.workspace))
    assert (await verifier.score(task, sb, None)).parts == {"correct": 0.0, "format_ok": 0.0}
    assert (await verifier.score(task, sb, f"It is {answer}.")).parts == {"correct": 0.0, "format_ok": 0.0}
    assert (await verifier.score(task, sb, f"{answer}\n")).value == 1.0
    sb.write_file("answer.txt", "API Error: 400\n")
    assert (await verifier.score(task, sb, answer)).parts == {"correct": 0.0, "format_ok": 0.0}
    sb.write_file("answer.txt", f"{int(answer) + 1}\n")
    wrong = await verifier.score(task, sb, answer)  # the file wins over the final answer
    assert wrong.value == 0.0 and wrong.parts["format_ok"] == 1.0
    sb.write_file("answer.txt", f"{answer}\n")
    assert (await verifier.score(task, sb, None)).value == 1.0
    await sb.close()


def test_verifier_for_each_family() -> None:
    assert isinstance(verifier_for(HumanEvalSource(limit=1).get(0)), UnitTestVerifier)
    assert isinstance(verifier_for(StdioSource(EXAMPLES).get(0)), StdioVerifier)
    assert isinstance(verifier_for(ProceduralSource().get(0)), ExactMatchVerifier)
    with pytest.raises(TaskError, match="no verifier for family 'chess'"):
        verifier_for(Task(task_id="t", family="chess", instruction="x"))


async def test_humaneval_under_bwrap(he_task: Task, tmp_path: Path) -> None:
    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed or cannot create namespaces here")
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "bw", use_bwrap=True))
    sb = await backend.create("bw", dict(he_task.workspace))
    sb.write_file("solution.py", _canonical("HumanEval/0"))
    assert (await UnitTestVerifier().score(he_task, sb, None)).value == 1.0
    await sb.close()
