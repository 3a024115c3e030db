"""The lookup side-by-side's task and tool (`bench/lookup_env.py`): TRL's environment and
harnessrl's procedural task agree on the tasks, the tool's result and the verifier's outcome."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lookup_env as le  # noqa: E402

from harnessrl.rewards.exact_match import ExactMatchVerifier  # noqa: E402
from harnessrl.tasks.procedural import ProceduralSource  # noqa: E402
from harnessrl.train.evaluation import EVAL_SEED_OFFSET  # noqa: E402


def test_rows_are_harnessrls_tasks_in_order() -> None:
    src = ProceduralSource(kinds=["lookup"], answer_via="reply")
    rows = le.rows(6)
    for k, row in enumerate(rows):
        task = src.get(k)
        assert row["prompt"] == [{"role": "system", "content": task.system_prompt},
                                 {"role": "user", "content": task.instruction}]
        assert json.loads(row["workspace"]) == task.workspace and len(task.workspace) == 3
        assert (row["answer"], row["answer_kind"], row["task_id"]) == (
            task.hidden_tests["answer"], "int", task.task_id)
        assert task.instruction.endswith("Reply with only the number.")
    assert le.HELD_OUT_OFFSET == EVAL_SEED_OFFSET
    held = le.rows(4, seed_offset=le.HELD_OUT_OFFSET)
    assert {r["task_id"] for r in held}.isdisjoint(r["task_id"] for r in le.rows(1000))
    assert le.rows(2, kind="lookup_json", difficulty=2)[0]["task_id"].startswith("procedural/lookup_json/")


def test_environment_tool_reads_the_workspace_and_reset_replaces_it() -> None:
    env = le.LookupEnv()
    rows = le.rows(2)
    assert env.reset(**rows[0]) is None
    task = ProceduralSource(kinds=["lookup"], answer_via="reply").get(0)
    stem = task.metadata["question"].split("the number in ")[1].rstrip("?")
    assert env.bash(f"cat {stem}") == f"exit code 0\n{task.hidden_tests['answer']}\n"
    assert env.bash("ls").splitlines()[1:] == sorted(task.workspace)
    assert env.bash("cat nothing.txt").startswith("exit code 1\ncat: nothing.txt: No such file")
    env.reset(**rows[1])
    assert env.bash("ls").splitlines()[1:] == sorted(json.loads(rows[1]["workspace"]))
    assert le.run_bash("sleep 5", Path("."), timeout_s=0.2).startswith("exit code -9 (timed out)\n")
    assert len(le.run_bash("yes | head -c 10000", Path("."))) == le.MAX_TOOL_OUTPUT_CHARS


@pytest.mark.parametrize("text", ["42", " 42\n", "`42`", "The answer is 42", "4 2", "", None, "looking\n42",
                                  "40 + 2 = 42", "042", "43"])
def test_reward_is_the_exact_match_verifiers_outcome(text: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    import harnessrl.rewards.exact_match as em

    monkeypatch.setattr(em, "read_submission", lambda *_: None)  # no answer.txt: the final answer is scored
    task = dataclasses.replace(ProceduralSource(kinds=["lookup"], answer_via="reply").get(3),
                               hidden_tests={"answer": "42", "answer_kind": "int"})
    expected = asyncio.run(ExactMatchVerifier().score(task, None, text)).value  # type: ignore[arg-type]
    completion = [{"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
                  {"role": "tool", "name": "bash", "content": "exit code 0\n"},
                  {"role": "assistant", "content": text}]
    assert le.reward([completion], answer=["42"], answer_kind=["int"]) == [expected]


def test_final_answer_is_the_last_assistant_message() -> None:
    assert le.final_answer([{"role": "assistant", "content": "7"}, {"role": "tool", "content": "x"}]) == "7"
    assert le.final_answer([{"role": "assistant", "content": None}]) == ""
    assert le.final_answer([]) is None


def test_command_line_parses_the_lookup_flags() -> None:
    import learning

    args = learning.parse_args(["--task", "lookup", "--seeds", "0,1,2", "--max-turns", "2"])
    assert (args.task, args.seeds, args.max_turns, args.max_tokens, args.chat_template) == (
        "lookup", [0, 1, 2], 2, 48, "auto")
    assert learning.parse_args([]).max_tokens == 24
    with pytest.raises(SystemExit):
        learning.parse_args(["--task", "lookup", "--max-turns", "0"])
    assert learning.goal_met("lookup", {"harnessrl": 0.5, "trl": 0.5}, 0.6)
    assert not learning.goal_met("lookup", {"harnessrl": 0.4, "trl": 0.5}, 0.3)
    assert not learning.goal_met("lookup", {"harnessrl": 0.9, "trl": 0.5}, 0.61)
    assert not learning.goal_met("larger", {"harnessrl": 0.89, "trl": 0.5}, 0.5)
