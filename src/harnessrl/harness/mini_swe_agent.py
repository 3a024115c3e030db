"""mini-swe-agent (PyPI `mini-swe-agent`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `mini` headless on one task inside a sandbox, pointed at the proxy, and
read its trajectory file for the submission and exit status.

How the endpoint reaches the agent: through a YAML config file written under the sandbox home
(`<home>/.harnessrl/mini-swe-agent/harnessrl.yaml`: `model.model_kwargs.api_base` and
`api_key`), given with `-c`. Neither the key nor the base URL is in the agent's environment
or its argv, so the bash commands it runs (which inherit its environment) and the verifier
never see them.

Protocols (mini-swe-agent 2.4 configs):
  * `tool_calls=False` (default): `mini_textbased.yaml`; actions are ```` ```mswea_bash_command ````
    blocks in plain text. For models that do not emit tool calls (the CPU default SmolLM2-135M).
  * `tool_calls=True`: `mini.yaml`, one `bash` tool called through OpenAI tool calls.
Model client (`model_client`): `direct` (default) ships `harness/mini_swe_agent_client.py` as
`pylib/harnessrl_mini_client.py` under the state dir (on the agent's `PYTHONPATH`) and names its
classes as mini's `model.model_class` (mini's OpenRouter classes aimed at the proxy, over
`requests`); `litellm` uses mini's litellm classes (`litellm_textbased` for the text protocol),
whose import costs ~2.9 CPU-s per rollout.
The run ends when a command prints `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (the rest of its
output is the submission), at `step_limit`, or after `max_format_errors` bad replies in a row.
mini runs the action of its last allowed step before it stops at `step_limit`, so a task
checked from the workspace (e.g. `answer.txt`) is scored after one step.

Prompts (`templates`): `bundled` keeps mini's own system and instance templates (~1.2k tokens
of workflow advice for capable models); `compact` (the default) is a short, example-led prompt
for a small model: a one-line system message and two worked examples, each a one-line task
and its one-command reply, followed by the task in the same form (`COMPACT_SYSTEM`,
`COMPACT_INSTANCE`; a 135M model continues a pattern it has just seen, where it ignores a
paragraph of rules), and with the text protocol an action block whose fence may be tagged
`mswea_bash_command`, `bash`, `shell`, `sh` or nothing (`COMPACT_ACTION_REGEX`). `multiturn`
is the compact prompt for tasks that need a look first (the `lookup` procedural kinds): worked
examples of two commands each (`cat kiwi.txt`, its output on an `Output: 64` line, then `echo 64
> answer.txt`), mini's observation shortened to that same `Output: ...` line
(`MULTITURN_OBSERVATION`), a one-line format error (`MULTITURN_FORMAT_ERROR`), and `Output:` as
the request's stop string (`MULTITURN_STOP`). The
compact prompts do not teach mini's submit command: with `step_limit` > 1 a run on it ends at the limit
(a task is scored from the workspace either way). `system_template` / `instance_template` / `action_regex` replace
either (mini's Jinja templates: `{{task}}` is the task's instruction).
`HarnessResult.final_answer` is that submission exactly as mini recorded it (trailing newline
kept; None when empty); mini exits 0 at its limits, so only crashes set `error`.

Environment (measured, see the harness-client notes): `MSWEA_CONFIGURED=true` (no set-up
wizard), `MSWEA_COST_TRACKING=ignore_errors` (unknown model prices abort otherwise),
`MSWEA_GLOBAL_CONFIG_DIR` inside the sandbox, `MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT` from the
config; with litellm also `LITELLM_LOCAL_MODEL_COST_MAP=True` (no price-map download), with the
direct client `PYTHONPATH` (the client's directory, which holds nothing else).

What this module deliberately does not do: parse the model's replies or count steps itself;
the proxy trace is the record of what the model did.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentOutcome, AgentPaths, AgentSpec, CliAgentHarness
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "mini-swe-agent"

COMPACT_SYSTEM = """\
You are a shell agent. You reply with exactly one bash command in a ```bash code block."""
COMPACT_INSTANCE = """\
Task: What is 2 + 3? Write the answer to answer.txt.
```bash
echo 5 > answer.txt
```

Task: Which of the two numbers 14 and 9 is larger? Write the answer to answer.txt.
```bash
echo 14 > answer.txt
```

Task: {{task}}
"""
MULTITURN_SYSTEM = """\
You are a shell agent. You reply with exactly one bash command in a ```bash code block. \
You see its output, then you reply again."""
MULTITURN_INSTANCE = """\
Task: What is the number in kiwi.txt? Write the answer to answer.txt.
```bash
cat kiwi.txt
```
Output: 64
```bash
echo 64 > answer.txt
```

Task: What is the value of "depth" in box.json? Write the answer to answer.txt.
```bash
cat box.json
```
Output: {"width": 12, "depth": 37}
```bash
echo 37 > answer.txt
```

Task: {{task}}
"""
MULTITURN_STOP = "Output:"
"""The `multiturn` prompt's stop string (sent as the request's `stop` unless `model_kwargs` sets
one): its examples show `Output:` after each command, and a small model goes on to write the
output and a next command itself, two actions in one reply, which mini rejects."""
MULTITURN_FORMAT_ERROR = "Format error: reply with exactly one bash command in a ```bash code block."
"""The `multiturn` prompt's reply to a reply without exactly one action (mini's
`model.format_error_template`; mini's own is ~300 tokens of advice, context every later call
and every trained row carries)."""
MULTITURN_OBSERVATION = "Output: {{ output.output | trim }}"
"""The `multiturn` prompt's observation (mini's `model.observation_template`): the command's
output after `Output: `, the form its worked examples show (mini's own wraps it in
`<returncode>` / `<output>` tags)."""
COMPACT_ACTION_REGEX = r"```(?:mswea_bash_command|bash|shell|sh)?[ \t]*\n(.*?)\n```"
"""The compact prompt's action block: a fence tagged `mswea_bash_command`, `bash`, `shell`,
`sh` or untagged (mini's own only accepts `mswea_bash_command`)."""
CLIENT_MODULE = "harnessrl_mini_client"
"""The name mini imports `harness/mini_swe_agent_client.py` under in the sandbox."""
CLIENT_DIR = "pylib"
"""Its directory under the agent's state dir (on the agent's `PYTHONPATH`)."""
TRAJECTORY_BYTES = 64 << 20
"""Largest trajectory file read back (a larger one reads as missing: truncated JSON)."""


class MiniSweAgentConfig(BaseModel):
    """Options of the mini-swe-agent harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tool_calls: bool = False
    """Use the tool-call protocol (`mini.yaml`); False uses the text protocol
    (`mini_textbased.yaml`, ```` ```mswea_bash_command ```` blocks) for models without tool calls."""
    step_limit: int = Field(default=1, ge=1)
    """Most model calls per rollout (mini's `agent.step_limit`). 1 by default: the default
    procedural tasks are answered by one command writing `answer.txt` (mini runs the last
    step's action, then stops), every call's tokens are generated and then trained on, and a
    135M model's later replies are noise; raise it for tasks that need several commands."""
    cost_limit: float = Field(default=0.0, ge=0.0)
    """mini's dollar cost limit; 0 disables it (a local model has no price)."""
    max_format_errors: int = Field(default=3, ge=0)
    """Stop after this many replies in a row without exactly one action (0 = never)."""
    command_timeout_s: int = Field(default=30, ge=1)
    """Wall-clock limit of each bash command the agent runs (mini's `environment.timeout`)."""
    model_client: Literal["direct", "litellm"] = "direct"
    """How mini calls the proxy. `direct`: mini's own model classes over `requests`, aimed at the
    proxy (`harness/mini_swe_agent_client.py`, shipped into the sandbox): mini starts in ~0.3 s.
    `litellm`: mini's litellm classes (its default with a local endpoint), whose `import litellm`
    costs ~2.9 CPU-s more in every rollout. The messages, action parsing, format errors,
    observations, retries and trajectory are mini's own code either way."""
    model_retry_attempts: int = Field(default=2, ge=1)
    """Attempts per model call before mini gives up (mini retries failed calls with backoff)."""
    model_kwargs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra fields sent with every request (e.g. `{"temperature": 1.0}`); the proxy's run
    sampling parameters take precedence anyway."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `mini` arguments, appended last (e.g. `["-c", "agent.wall_time_limit_seconds=60"]`)."""
    templates: Literal["compact", "multiturn", "bundled"] = "compact"
    """`compact`: a short example-led prompt for small models; `multiturn`: the same with
    worked two-command examples (look, then answer) and a one-line observation; `bundled`:
    mini's own (module docstring)."""
    system_template: str | None = None
    """mini's `agent.system_template` (Jinja); unset: the one `templates` picks."""
    instance_template: str | None = None
    """mini's `agent.instance_template` (Jinja, `{{task}}` is the instruction); unset: the one
    `templates` picks."""
    observation_template: str | None = None
    """mini's `model.observation_template` (Jinja, `output.output` / `output.returncode`): the
    message that carries a command's output to the next call; unset: the one `templates` picks
    (mini's own with `compact` and `bundled`)."""
    action_regex: str | None = None
    """Text protocol only: mini's `model.action_regex` (one group: the command); unset: the one
    `templates` picks (mini's own with `bundled`)."""

    def requirements(self) -> HarnessRequirements:
        """mini-swe-agent's prompts are short (~0.7k tokens at the second step)."""
        return HarnessRequirements(
            protocol="chat.completions", min_context_tokens=2048,
            why="mini-swe-agent's prompts are short (~0.7k tokens at the second step); "
                "each step adds a reply and the command's output")


class MiniSweAgentHarness(CliAgentHarness):
    """Runs `mini -y --exit-immediately` in the sandbox workdir; see the module docstring."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: MiniSweAgentConfig | None = None) -> None:
        self.config = config or MiniSweAgentConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """mini's argv, env and files (its config, and with `model_client = "direct"` the model
        classes it imports); its result is read from its trajectory file."""
        command = self.command(paths)
        direct = self.config.model_client == "direct"
        argv = [
            *command, "-y", "--exit-immediately",
            "-m", endpoint.model if direct else f"openai/{endpoint.model}",  # litellm's provider prefix
            "-c", "mini.yaml" if self.config.tool_calls else "mini_textbased.yaml",
            "-c", paths.state("harnessrl.yaml"),
            "-o", paths.state("traj.json"),
            "-t", task.instruction,
            *self.config.extra_args,
        ]  # fmt: skip
        env = {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": paths.state("global"),
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(self.config.model_retry_attempts),
        }
        # JSON is valid YAML; mini requires the `.yaml` suffix.
        files = [AgentFile(f"{paths.state_rel}/harnessrl.yaml", json.dumps(self._agent_config(endpoint, paths), indent=2))]
        if direct:
            # alone in its directory: the agent's commands inherit PYTHONPATH, not the config's key
            files.append(AgentFile(f"{paths.state_rel}/{CLIENT_DIR}/{CLIENT_MODULE}.py", client_source()))
            env["PYTHONPATH"] = paths.state(CLIENT_DIR)
        else:
            env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        return AgentSpec(argv=argv, env=env, files=tuple(files), output=("home", f"{paths.state_rel}/traj.json"),
                         output_bytes=TRAJECTORY_BYTES, interpret=interpret_trajectory)

    def _agent_config(self, endpoint: Endpoint, paths: AgentPaths) -> dict[str, Any]:
        """The config merged over mini's bundled one (mini merges `-c` specs recursively)."""
        cfg = self.config
        direct = cfg.model_client == "direct"
        model: dict[str, Any] = {
            "model_kwargs": {
                **cfg.model_kwargs,
                "api_base": endpoint.base_url,
                "api_key": endpoint.api_key,
                **({} if direct else {"drop_params": True}),
            },
        }
        if direct:
            model["model_class"] = f"{CLIENT_MODULE}.{'ProxyToolCallModel' if cfg.tool_calls else 'ProxyTextbasedModel'}"
        elif not cfg.tool_calls:
            model["model_class"] = "litellm_textbased"
        if not cfg.tool_calls:
            regex = cfg.action_regex or (COMPACT_ACTION_REGEX if cfg.templates != "bundled" else None)
            if regex is not None:
                model["action_regex"] = regex
        templates: dict[str, str] = {}
        if cfg.templates == "compact":
            templates = {"system_template": COMPACT_SYSTEM, "instance_template": COMPACT_INSTANCE}
        elif cfg.templates == "multiturn":
            templates = {"system_template": MULTITURN_SYSTEM, "instance_template": MULTITURN_INSTANCE}
        if cfg.templates == "multiturn":
            model["model_kwargs"].setdefault("stop", MULTITURN_STOP)
            if not cfg.tool_calls:
                model["format_error_template"] = MULTITURN_FORMAT_ERROR
        observation = cfg.observation_template or (MULTITURN_OBSERVATION if cfg.templates == "multiturn" else None)
        if observation is not None:
            model["observation_template"] = observation
        if cfg.system_template is not None:
            templates["system_template"] = cfg.system_template
        if cfg.instance_template is not None:
            templates["instance_template"] = cfg.instance_template
        return {
            "agent": {
                **templates,
                "step_limit": cfg.step_limit,
                "cost_limit": cfg.cost_limit,
                "max_consecutive_format_errors": cfg.max_format_errors,
                "mode": "yolo",
                "confirm_exit": False,
            },
            "environment": {"cwd": paths.workdir, "timeout": cfg.command_timeout_s},
            "model": model,
        }


def client_source() -> str:
    """The source of `harness/mini_swe_agent_client.py`, the model classes shipped to mini."""
    return resources.files("harnessrl.harness").joinpath("mini_swe_agent_client.py").read_text(encoding="utf-8")


def interpret_trajectory(output: str | None, log_tail: str) -> AgentOutcome:
    """The submission of mini's trajectory as the final answer (None when empty), and its
    exit status / exception as the error detail (mini exits 0 at its limits)."""
    info = trajectory_info(output)
    submission = info.get("submission")
    detail = info.get("exception_str") or info.get("exit_status") or "unknown"
    return AgentOutcome(final_answer=submission if isinstance(submission, str) and submission else None,
                        error_detail=str(detail))


def trajectory_info(text: str | None) -> dict[str, Any]:
    """`info` of a mini trajectory's text (`exit_status`, `submission`, ...) plus
    `exception_str` of the exit message when present; {} when missing or not valid JSON."""
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    info = dict(data.get("info") or {})
    messages = data.get("messages") or []
    if messages and isinstance(messages[-1], dict):
        extra = messages[-1].get("extra") or {}
        if isinstance(extra, dict) and extra.get("exception_str"):
            info["exception_str"] = str(extra["exception_str"])[-500:]
    return info
