"""Bring your own tasks and verifiers: `tasks.kind = "python"` and `tasks.verifier` by dotted
path, and the runnable example in `examples/byo/` through the real `harnessrl rollout`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.rewards.base import Reward
from harnessrl.rewards.select import make_verifier_for, verifier_for
from harnessrl.runtime import make_task_source
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.tasks.python_source import ListSource, load_python_source

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/byo/letters.py"

USER_MODULE = '''
from harnessrl.rewards.base import Reward
from harnessrl.tasks.base import Task

class Source:
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def get(self, seed):
        return Task(task_id=f"mine/{seed % self.n}", family="mine", instruction="say hi")

def not_tasks():
    return 42

def broken(**kw):
    raise RuntimeError("no data here")

class SyncVerifier:
    def __init__(self, value=1.0):
        self.value = value
    def score(self, task, sandbox, final_answer):
        return Reward(value=self.value, parts={"sync": 1.0})

class BadVerifier:
    async def score(self, task, sandbox, final_answer):
        return 0.5

class NoScore:
    pass
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_user_tasks.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_user_tasks", None)
    return "my_user_tasks"


def test_python_source_accepts_a_list_or_a_task_source(user_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # a `.py` path is relative to the working directory
    tasks = load_python_source(f"{EXAMPLE}:make_tasks", {"words": ["banana", "strawberry"]})
    assert isinstance(tasks, ListSource) and len(tasks) == 2
    assert tasks.get(0).task_id == "letters/banana/a" and tasks.get(0).hidden_tests == {"answer": 3}
    assert tasks.get(3).task_id == "letters/strawberry/r"  # seeds cycle
    source = load_python_source(f"{user_module}:Source", {"n": 3})
    assert len(source) == 3 and source.get(4).task_id == "mine/1"


def test_python_source_errors_name_tasks_source(user_module: str) -> None:
    with pytest.raises(ConfigError, match=r"tasks.source = 'my_user_tasks:not_tasks' returned a int"):
        load_python_source(f"{user_module}:not_tasks", {})
    with pytest.raises(ConfigError, match=r"raised RuntimeError: no data here"):
        load_python_source(f"{user_module}:broken", {"x": 1})
    with pytest.raises(ConfigError, match=r"has no attribute 'nothing'"):
        load_python_source(f"{user_module}:nothing", {})
    with pytest.raises(ConfigError, match=r"item 0 is a str, not a harnessrl Task"):
        ListSource(["not a task"])  # type: ignore[list-item]


def test_config_builds_the_python_source_with_limit(user_module: str) -> None:
    cfg = load_config(None, ["tasks.kind=python", f"tasks.source={user_module}:Source", "tasks.kwargs={n = 5}",
                             "tasks.limit=2"])
    source = make_task_source(cfg.tasks)
    assert len(source) == 2 and [source.get(i).task_id for i in range(3)] == ["mine/0", "mine/1", "mine/0"]


def test_named_verifier_scores_every_task(user_module: str, tmp_path: Path) -> None:
    assert make_verifier_for(None) is verifier_for
    task = Task(task_id="mine/0", family="mine", instruction="say hi")
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx"))

    async def score(dotted: str, **kwargs: float) -> Reward:
        sandbox = await backend.create("r1", {})
        try:
            return await make_verifier_for(dotted, kwargs)(task).score(task, sandbox, "hi")
        finally:
            await sandbox.close()

    reward = asyncio.run(score(f"{user_module}:SyncVerifier", value=0.25))
    assert reward == Reward(value=0.25, parts={"sync": 1.0})
    with pytest.raises(TypeError, match="BadVerifier.score returned a float, not a harnessrl Reward"):
        asyncio.run(score(f"{user_module}:BadVerifier"))
    with pytest.raises(ConfigError, match=r"tasks.verifier = 'my_user_tasks:NoScore' returned a NoScore without a score"):
        make_verifier_for(f"{user_module}:NoScore")


def test_example_verifier_reads_answer_file_then_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    tasks = load_python_source(f"{EXAMPLE}:make_tasks", {"words": ["banana"]})
    verifier = make_verifier_for(f"{EXAMPLE}:LetterCountVerifier")(tasks.get(0))
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx"))

    async def score(files: dict[str, str], reply: str | None) -> Reward:
        sandbox = await backend.create("r1", files)
        try:
            return await verifier.score(tasks.get(0), sandbox, reply)
        finally:
            await sandbox.close()

    assert asyncio.run(score({}, "There are 3.")).parts == {"correct": 1.0, "number_found": 1.0}
    assert asyncio.run(score({"answer.txt": "2"}, "3")).value == 0.0
    assert asyncio.run(score({}, "It occurs thrice.")).parts == {"correct": 1.0, "number_found": 1.0}
    assert asyncio.run(score({}, "twice, or 3")).value == 0.0  # the first number counts
    assert asyncio.run(score({}, "no idea")).parts == {"correct": 0.0, "number_found": 0.0}


def test_example_runs_through_harnessrl_rollout(tmp_path: Path) -> None:
    """The documented example, verbatim but for the tiny model and a short run."""
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.cli", "rollout", "--config", "examples/byo/letters.toml",
         "--set", "engine.model=tiny-random", "--set", "sampling.max_tokens=8", "--set", "rollout.group_size=2",
         "--limit", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    words = ["strawberry", "banana", "bookkeeper", "mississippi"]  # as in letters.toml
    assert {r["task_id"].split("/")[1] for r in rollouts} <= set(words)
    assert all(r["task_id"].startswith("letters/") for r in rollouts)
    for r in rollouts:
        assert r["status"] == "ok" and r["harness"] == "white_box"
        assert set(r["reward_parts"]) == {"correct", "number_found"}  # the example's verifier scored it
        assert r["reward"] == r["reward_parts"]["correct"]
        assert len(r["trace"]["turns"]) == 1 and r["trace"]["turns"][0]["completion_ids"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts"] == 4 and summary["scored"] == 4



def test_a_family_without_a_verifier_stops_before_the_model_loads(user_module: str) -> None:
    import asyncio as _asyncio

    from harnessrl.errors import TaskError
    from harnessrl.runtime import start_runtime

    cfg = load_config(None, ["tasks.kind=python", f"tasks.source={user_module}:Source", "tasks.kwargs={n = 2}",
                             "engine.model=/nonexistent/model"])

    async def start() -> None:
        async with start_runtime(cfg):
            pass

    # TaskError (about the family), not ModelLoadError: nothing was loaded yet
    with pytest.raises(TaskError, match=r"no verifier for family 'mine'.*tasks.verifier"):
        _asyncio.run(start())
