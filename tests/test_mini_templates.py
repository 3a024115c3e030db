"""mini-swe-agent's prompt options: the compact example-led templates (default), mini's bundled
ones, explicit templates, and the compact action block mini parses with `action_regex`."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from harnessrl.errors import ConfigError
from harnessrl.harness.mini_swe_agent import (COMPACT_ACTION_REGEX, COMPACT_INSTANCE, COMPACT_SYSTEM,
                                              MiniSweAgentConfig, MiniSweAgentHarness)
from harnessrl.harness.options import validate_options
from harnessrl.types import Endpoint

ENDPOINT = Endpoint(base_url="http://127.0.0.1:1/v1", api_key="k", model="m")
PATHS = SimpleNamespace(workdir="/work")


def _config(**options: object) -> dict:
    return MiniSweAgentHarness(MiniSweAgentConfig(**options))._agent_config(ENDPOINT, PATHS)  # type: ignore[arg-type]


def test_compact_templates_are_the_default() -> None:
    cfg = _config()
    assert cfg["agent"]["system_template"] == COMPACT_SYSTEM
    assert cfg["agent"]["instance_template"] == COMPACT_INSTANCE and "{{task}}" in COMPACT_INSTANCE
    assert cfg["model"]["action_regex"] == COMPACT_ACTION_REGEX
    assert len(COMPACT_SYSTEM + COMPACT_INSTANCE) < 600  # mini's bundled pair is ~5k characters
    assert cfg["agent"]["step_limit"] == 1  # one command answers a default task


def test_bundled_keeps_minis_own_prompts_and_explicit_templates_win() -> None:
    bundled = _config(templates="bundled")
    assert "system_template" not in bundled["agent"] and "action_regex" not in bundled["model"]
    mine = _config(templates="bundled", instance_template="Do: {{task}}", action_regex=r"<cmd>(.*?)</cmd>")
    assert mine["agent"]["instance_template"] == "Do: {{task}}" and "system_template" not in mine["agent"]
    assert mine["model"]["action_regex"] == r"<cmd>(.*?)</cmd>"
    assert "action_regex" not in _config(tool_calls=True)["model"]  # tool calls have no text block
    with pytest.raises(ConfigError, match="templates"):
        validate_options("mini-swe-agent", {"templates": "tiny"})


@pytest.mark.parametrize(("reply", "actions"), [
    ("```mswea_bash_command\necho 71 > answer.txt\n```", ["echo 71 > answer.txt"]),
    ("Sure.\n```bash\necho 71 > answer.txt\n```", ["echo 71 > answer.txt"]),
    ("```\necho 71 > answer.txt\n```", ["echo 71 > answer.txt"]),
    ("```python\nprint(71)\n```", []),
    ("71", []),
])
def test_compact_action_block(reply: str, actions: list[str]) -> None:
    # mini's text parser: re.findall(action_regex, content, re.DOTALL), each stripped
    assert [a.strip() for a in re.findall(COMPACT_ACTION_REGEX, reply, re.DOTALL)] == actions


def test_compact_examples_are_actions_that_answer_in_the_procedural_form(tmp_path) -> None:
    """Each worked example is a task line in the procedural tasks' own form followed by one
    action block; run with bash, the action writes an answer.txt the verifier parses."""
    import subprocess

    from harnessrl.rewards.exact_match import parse_answer
    from harnessrl.tasks.procedural import ProceduralSource

    examples = re.findall(r"Task: (.*?)\n(```bash\n.*?\n```)", COMPACT_INSTANCE, re.DOTALL)
    assert [q for q, _ in examples] == ["What is 2 + 3? Write the answer to answer.txt.",
                                        "Which of the two numbers 14 and 9 is larger? Write the answer to answer.txt."]
    for (_, block), expected in zip(examples, ["5", "14"]):
        [action] = re.findall(COMPACT_ACTION_REGEX, block, re.DOTALL)
        subprocess.run(["bash", "-c", action], cwd=tmp_path, check=True, timeout=10)
        assert parse_answer((tmp_path / "answer.txt").read_text(), "int") == expected
    task = ProceduralSource(kinds=["compare"]).get(0)
    assert re.fullmatch(r"Which of the two numbers \d+ and \d+ is larger\? Write the answer to answer\.txt\.",
                        task.instruction)
    assert COMPACT_INSTANCE.rstrip().endswith("Task: {{task}}")


def test_default_recipe_is_the_measured_one() -> None:
    """The main job's defaults: repeat tasks through mini-swe-agent's compact prompt, one
    step, temperature 0.4 (README, "Measured": held-out 0.44 -> 0.94 in 8 steps)."""
    from harnessrl.config import load_config

    cfg = load_config(None)
    assert (cfg.harness.kind, cfg.tasks.kind, cfg.tasks.kinds) == ("mini-swe-agent", "procedural", ["repeat"])
    assert cfg.sampling.temperature == 0.4 and (cfg.sampling.top_p, cfg.sampling.top_k) == (1.0, 0)
    assert cfg.harness.options["step_limit"] == 1 and cfg.harness.options["templates"] == "compact"
