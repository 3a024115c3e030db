"""mini-swe-agent's prompt options: the compact example-led templates (default), mini's bundled
ones, explicit templates, and the compact action block mini parses with `action_regex`; its model
client (the direct one shipped into the sandbox, or mini's litellm classes)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from harnessrl.errors import ConfigError
from harnessrl.harness.mini_swe_agent import (COMPACT_ACTION_REGEX, COMPACT_INSTANCE, COMPACT_SYSTEM,
                                              MiniSweAgentConfig, MiniSweAgentHarness, client_source)
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


def test_multiturn_templates_show_look_then_answer_and_set_the_observation_and_stop(tmp_path) -> None:
    """`templates = "multiturn"`: each worked example is a lookup task, a command that reads a
    file, its output in the observation's own `Output: ...` form, then a command that writes
    that output's answer; run with bash on the example's file, both commands do what is shown.
    The observation template and the stop string reach mini's model config; explicit ones win."""
    import json
    import subprocess

    import jinja2

    from harnessrl.harness.mini_swe_agent import (MULTITURN_FORMAT_ERROR, MULTITURN_INSTANCE, MULTITURN_OBSERVATION,
                                                  MULTITURN_STOP, MULTITURN_SYSTEM)
    from harnessrl.rewards.exact_match import parse_answer

    cfg = _config(templates="multiturn", step_limit=3)
    assert cfg["agent"]["system_template"] == MULTITURN_SYSTEM
    assert cfg["agent"]["instance_template"] == MULTITURN_INSTANCE
    assert cfg["model"]["observation_template"] == MULTITURN_OBSERVATION
    assert cfg["model"]["model_kwargs"]["stop"] == MULTITURN_STOP == "Output:"
    assert cfg["model"]["format_error_template"] == MULTITURN_FORMAT_ERROR and len(MULTITURN_FORMAT_ERROR) < 100
    assert "format_error_template" not in _config()["model"]
    assert cfg["model"]["action_regex"] == COMPACT_ACTION_REGEX and cfg["agent"]["step_limit"] == 3
    mine = _config(templates="multiturn", observation_template="out: {{output.output}}",
                   model_kwargs={"stop": "###"})
    assert mine["model"]["observation_template"] == "out: {{output.output}}"
    assert mine["model"]["model_kwargs"]["stop"] == "###"
    assert "observation_template" not in _config()["model"] and "stop" not in _config()["model"]["model_kwargs"]
    assert _config(observation_template="o")["model"]["observation_template"] == "o"

    examples = re.findall(r"Task: (.*?)\n(```bash\n.*?\n```)\n(Output: .*?)\n(```bash\n.*?\n```)",
                          MULTITURN_INSTANCE, re.DOTALL)
    assert len(examples) == 2 and MULTITURN_INSTANCE.rstrip().endswith("Task: {{task}}")
    files = {"kiwi.txt": "64\n", "box.json": json.dumps({"width": 12, "depth": 37}) + "\n"}
    for (question, look, shown, answer), (name, text), expected in zip(examples, files.items(), ["64", "37"]):
        assert name in question and question.endswith("Write the answer to answer.txt.")
        (tmp_path / name).write_text(text)
        [look_cmd] = re.findall(COMPACT_ACTION_REGEX, look, re.DOTALL)
        out = subprocess.run(["bash", "-c", look_cmd], cwd=tmp_path, check=True, timeout=10,
                             capture_output=True, text=True)
        rendered = jinja2.Template(MULTITURN_OBSERVATION).render(output={"output": out.stdout, "returncode": 0})
        assert rendered == shown  # the observation the agent will get is the one the example shows
        [answer_cmd] = re.findall(COMPACT_ACTION_REGEX, answer, re.DOTALL)
        subprocess.run(["bash", "-c", answer_cmd], cwd=tmp_path, check=True, timeout=10)
        assert parse_answer((tmp_path / "answer.txt").read_text(), "int") == expected


def test_default_recipe_is_the_measured_one() -> None:
    """The main job's defaults: repeat tasks through mini-swe-agent's compact prompt, one
    step, temperature 0.4 (docs/benchmarks.md, "Main jobs": held-out 0.44 -> 0.94 in 8 steps)."""
    from harnessrl.config import load_config

    cfg = load_config(None)
    assert (cfg.harness.kind, cfg.tasks.kind, cfg.tasks.kinds) == ("mini-swe-agent", "procedural", ["repeat"])
    assert cfg.sampling.temperature == 0.4 and (cfg.sampling.top_p, cfg.sampling.top_k) == (1.0, 0)
    assert cfg.harness.options["step_limit"] == 1 and cfg.harness.options["templates"] == "compact"


def test_multiturn_job_config_is_the_lookup_recipe() -> None:
    """`make train-agent`'s config (examples/train_agent.toml): lookup tasks, mini-swe-agent
    with three calls and the multiturn prompt, no shaping, and the Makefile runs it."""
    from pathlib import Path

    from harnessrl.config import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "train_agent.toml")
    assert (cfg.tasks.kind, cfg.tasks.kinds) == ("procedural", ["lookup"])
    assert cfg.harness.options["step_limit"] >= 3 and cfg.harness.options["templates"] == "multiturn"
    assert cfg.hooks.rollout_reward_fn == "" and cfg.sampling.temperature == 0.4
    makefile = (root / "Makefile").read_text()
    assert "AGENT_RECIPE ?= --config examples/train_agent.toml" in makefile
    assert "train-agent-ci:\n\t$(MAKE) train-agent AGENT_STEPS=1 EVAL=" in makefile


class _Paths:
    """The parts of `AgentPaths` `spec` reads (the state dir as the agent sees it: /home/agent/...)."""

    workdir = "/work"
    state_rel = ".harnessrl/mini-swe-agent"

    def state(self, rel_path: str = "") -> str:
        return f"/home/agent/{self.state_rel}/{rel_path}" if rel_path else f"/home/agent/{self.state_rel}"


def _spec(monkeypatch: pytest.MonkeyPatch, **options: object):  # noqa: ANN202
    harness = MiniSweAgentHarness(MiniSweAgentConfig(**options))
    monkeypatch.setattr(harness, "command", lambda paths: ["mini"])
    return harness.spec(SimpleNamespace(instruction="Print 5."), ENDPOINT, _Paths())  # type: ignore[arg-type]


def test_the_direct_client_is_shipped_and_named_as_minis_model_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model client: the classes of `harness/mini_swe_agent_client.py` written
    alone into a directory on the agent's PYTHONPATH, named as mini's model class; the model
    name without litellm's provider prefix; no litellm-only option in the request fields."""
    spec = _spec(monkeypatch)
    files = {f.rel_path: f.content for f in spec.files}
    client = files[".harnessrl/mini-swe-agent/pylib/harnessrl_mini_client.py"]
    assert client == client_source() and "class ProxyTextbasedModel(_AtProxy, OpenRouterTextbasedModel)" in client
    assert spec.env["PYTHONPATH"] == "/home/agent/.harnessrl/mini-swe-agent/pylib"
    assert "LITELLM_LOCAL_MODEL_COST_MAP" not in spec.env
    assert spec.argv[spec.argv.index("-m") + 1] == "m"
    cfg = json.loads(files[".harnessrl/mini-swe-agent/harnessrl.yaml"])
    assert cfg["model"]["model_class"] == "harnessrl_mini_client.ProxyTextbasedModel"
    assert cfg["model"]["model_kwargs"] == {"api_base": ENDPOINT.base_url, "api_key": "k"}
    tools = json.loads({f.rel_path: f.content for f in _spec(monkeypatch, tool_calls=True).files}[
        ".harnessrl/mini-swe-agent/harnessrl.yaml"])
    assert tools["model"]["model_class"] == "harnessrl_mini_client.ProxyToolCallModel"


def test_the_litellm_client_keeps_minis_litellm_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(monkeypatch, model_client="litellm")
    assert [f.rel_path for f in spec.files] == [".harnessrl/mini-swe-agent/harnessrl.yaml"]
    assert "PYTHONPATH" not in spec.env and spec.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert spec.argv[spec.argv.index("-m") + 1] == "openai/m"
    cfg = json.loads(spec.files[0].content)
    assert cfg["model"]["model_class"] == "litellm_textbased" and cfg["model"]["model_kwargs"]["drop_params"] is True
    assert "model_class" not in _config(model_client="litellm", tool_calls=True)["model"]  # mini's default: litellm
    with pytest.raises(ConfigError, match="model_client"):
        validate_options("mini-swe-agent", {"model_client": "openai"})
