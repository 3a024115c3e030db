"""Verifiers scored against real local sandboxes: HumanEval unit tests, stdio tests, exact match."""

from __future__ import annotations

import dataclasses
import os
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


# ---- submissions that attack the verifier (DESIGN.md §3.5: verifiers the submission cannot read) ----

HOSTILE = {
    # walks the stack to the runner's frame: its nonce, its result stream, its report
    "frame-walk": """
import sys
def has_close_elements(numbers, threshold):
    f = sys._getframe()
    while f is not None:
        loc = f.f_locals
        if "nonce" in loc and "result" in loc:
            loc["result"].write("HARNESSRL-PASS " + loc["nonce"] + "\\n")
            loc["result"].flush()
        for value in list(loc.values()):
            if isinstance(value, int) and not isinstance(value, bool) and 2 < value < 1024:
                try:
                    import os
                    os.write(value, b"READY\\nPASS\\n")
                except OSError:
                    pass
        f = f.f_back
    import os
    os._exit(0)
""",
    # opens every descriptor of every process it can see through /proc and writes a verdict
    "proc-fd": """
import os
def has_close_elements(numbers, threshold):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
                os.write(out, b"READY\\nPASS\\nHARNESSRL-PASS 0\\n")
                os.close(out)
            except OSError:
                pass
    return 7
""",
    # writes a forged verdict to every descriptor number, then leaves
    "every-fd": """
import os
for fd in range(1024):
    try:
        os.write(fd, b"READY\\nPASS\\nHARNESSRL-READY\\nHARNESSRL-PASS 0\\n")
    except OSError:
        pass
os._exit(0)
""",
    # replaces exec so that the hidden tests never run and its own check does
    "monkeypatch": """
import builtins
_exec = builtins.exec
def check(candidate):
    return None
def _skip_tests(code, *args, **kwargs):
    if getattr(code, "co_filename", "") == "tests.py":
        return None
    return _exec(code, *args, **kwargs)
builtins.exec = _skip_tests
def has_close_elements(numbers, threshold):
    raise NotImplementedError
""",
    # answers every comparison with True
    "always-equal": """
class Yes:
    def __eq__(self, other):
        return True
    def __bool__(self):
        return True
    __hash__ = object.__hash__
def has_close_elements(numbers, threshold):
    return Yes()
""",
    "sys-exit": "import sys\nsys.exit(0)\n",
    "os-exit-in-call": "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n",
    "print-markers": ("print('HARNESSRL-READY')\nprint('READY')\nprint('PASS')\nprint('HARNESSRL-PASS 0')\n"
                      "def has_close_elements(numbers, threshold):\n    print('PASS')\n    raise SystemExit(0)\n"),
    "base-exception": ("class Out(BaseException):\n    pass\n"
                       "def has_close_elements(numbers, threshold):\n    raise Out()\n"),
    "keyboard-interrupt": "def has_close_elements(numbers, threshold):\n    raise KeyboardInterrupt\n",
    # kills its parent and every process it may signal
    "kill-parent": ("import os, signal\n"
                    "def has_close_elements(numbers, threshold):\n"
                    "    os.kill(os.getppid(), signal.SIGKILL)\n"
                    "    return True\n"),
    # reads the judge's memory for the tests' expected values
    "proc-mem": """
import os
def has_close_elements(numbers, threshold):
    ppid = os.getppid()
    for what in ("mem", "environ"):
        try:
            with open(f"/proc/{ppid}/{what}", "rb") as f:
                f.read(1)
            return "opened /proc/ppid/" + what
        except OSError:
            pass
    return False
""",
}


@pytest.fixture(params=["bwrap", "podman"])
async def kit_backend(request: pytest.FixtureRequest, sandbox_root: Path) -> AsyncIterator[object]:
    """A sandbox backend of each isolating kind the hostile submissions run against. Not the
    unisolated local one: there a submission runs as host root (without capabilities) and these
    attacks (signals, writes through /proc) would reach the host's own processes."""
    from sandbox_kits import KITS, assert_no_podman_leftovers, kit_available

    kit_available(request.param)
    yield KITS[request.param].backend(sandbox_root)
    if request.param == "podman":
        assert_no_podman_leftovers()


@pytest.mark.parametrize("attack", sorted(HOSTILE))
async def test_hostile_submission_scores_zero(kit_backend, he_task: Task, attack: str) -> None:  # noqa: ANN001
    sb = await kit_backend.create("hostile", dict(he_task.workspace))
    try:
        sb.write_file("solution.py", HOSTILE[attack])
        reward = await UnitTestVerifier().score(he_task, sb, None)
        assert reward.error is None, reward
        assert (reward.value, reward.parts["passed"]) == (0.0, 0.0), reward
    finally:
        await sb.close()


LEAK_PROBE = """
import glob, os
MARK = "HIDDEN-" + "CHECK-7f3e"
found = []
for path in glob.glob("**", recursive=True) + glob.glob("../**", recursive=True):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        continue
    if MARK in text:
        found.append(path)
for pid in os.listdir("/proc"):
    for what in ("mem", "environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                if MARK.encode() in f.read(1 << 20):
                    found.append(f"/proc/{pid}/{what}")
        except OSError:
            pass
with open("leak.txt", "w") as f:
    f.write("\\n".join(found))
def f():
    return 1
"""


async def test_submission_cannot_read_the_hidden_tests(kit_backend) -> None:  # noqa: ANN001
    """While it runs, the submission finds the test code nowhere: not in its directory, not in
    any process it can read. (It still passes: `f` is right.)"""
    task = Task("t/0", "humaneval", "", workspace={"solution.py": "def f():\n    pass\n"},
                hidden_tests={"test": "MARK = 'HIDDEN-CHECK-7f3e'\ndef check(c):\n    assert c() == 1\n",
                              "entry_point": "f"})
    sb = await kit_backend.create("leak", dict(task.workspace))
    try:
        sb.write_file("solution.py", LEAK_PROBE)
        reward = await UnitTestVerifier().score(task, sb, None)
        assert reward.value == 1.0, reward
        [leak] = [p for p in sb.root.rglob("leak.txt") if p.parent.name.startswith("verify-")]
        assert leak.read_text() == "", leak.read_text()
    finally:
        await sb.close()


async def test_plain_values_cross_and_prints_do_not_matter(kit_backend) -> None:  # noqa: ANN001
    """Results of every plain type reach the judge exactly (subclasses as their base type: a
    Counter compares as the dict it is), whatever the submission prints."""
    values = ("[None, True, 0, -(10 ** 5000), 2.5, float('inf'), 1 + 2j, 'é\\ud800', b'\\x00\\xff', "
              "[1, [2, (3,)]], (1, 'a'), {'k': [1], 2: None}, {1, 2}, frozenset({'x'})]")
    test = (f"import math\ndef check(c):\n    for i, v in enumerate({values}):\n        got = c(i)\n"
            "        assert got == v and type(got) is type(v), (i, got)\n"
            "    assert math.copysign(1.0, c(-1)) == -1.0\n"
            "    assert c(99) == {'a': 2} and type(c(99)) is dict\n")
    source = (f"from collections import Counter\nVALUES = {values}\n"
              "def f(i):\n    print('PASS')\n    if i == -1:\n        return -0.0\n"
              "    return Counter('aa') if i == 99 else VALUES[i]\n")
    task = Task("t/0", "humaneval", "", hidden_tests={"test": test, "entry_point": "f"})
    sb = await kit_backend.create("values", {})
    try:
        sb.write_file("solution.py", source)
        reward = await UnitTestVerifier().score(task, sb, None)
        assert reward.value == 1.0, reward
    finally:
        await sb.close()


async def test_workspace_names_reach_the_log_without_terminal_escapes(
        backend: LocalSandboxBackend, caplog: pytest.LogCaptureFixture) -> None:
    """A file name holding an OSC 52 clipboard write and a screen clear, skipped by the verify
    copy (a FIFO), is logged with its control characters escaped, never raw."""
    import logging

    from harnessrl.rewards.submission import new_verify_dir

    name = "x\x1b]52;c;aGk=\x07\x1b[2J\nFAKE LINE"
    sb = await backend.create("escapes", {"solution.py": "print(1)\n"})
    try:
        os.mkfifo(sb.workdir / name)
        with caplog.at_level(logging.INFO, logger="harnessrl.rewards.submission"):
            new_verify_dir(sb, {"a.txt": "a"})
    finally:
        await sb.close()
    logged = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert logged, caplog.records
    assert "\x1b" not in logged[0] and "\x07" not in logged[0] and "\n" not in logged[0], logged
    assert "\\x1b]52;c;aGk=\\x07\\x1b[2J\\nFAKE LINE" in logged[0], logged
