"""mini-swe-agent (PyPI `mini-swe-agent`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `mini` headless on one task inside a sandbox, pointed at the proxy, and
read its trajectory file for the submission and exit status.

How the endpoint reaches the agent: through a YAML config file written under the sandbox home
(`<home>/.harnessrl/mini-swe-agent/harnessrl.yaml`: `model.model_kwargs.api_base` and
`api_key`), given with `-c`. Neither the key nor the base URL is in the agent's environment
or its argv, so the bash commands it runs (which inherit its environment) and the verifier
never see them.

Protocols (mini-swe-agent 2.4 configs):
  * `tool_calls=False` (default): `mini_textbased.yaml` with the `litellm_textbased` model
    class; actions are ```` ```mswea_bash_command ```` blocks in plain text. For models that do
    not emit tool calls (the CPU default SmolLM2-135M).
  * `tool_calls=True`: `mini.yaml`, one `bash` tool called through OpenAI tool calls.
The run ends when a command prints `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (the rest of its
output is the submission), at `step_limit`, or after `max_format_errors` bad replies in a row.
`HarnessResult.final_answer` is that submission exactly as mini recorded it (trailing newline
kept; None when empty); mini exits 0 at its limits, so only crashes set `error`.

Environment (measured, see the harness-client notes): `MSWEA_CONFIGURED=true` (no set-up
wizard), `MSWEA_COST_TRACKING=ignore_errors` (unknown model prices abort otherwise),
`LITELLM_LOCAL_MODEL_COST_MAP=True` (no price-map download), `MSWEA_GLOBAL_CONFIG_DIR` inside
the sandbox, `MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT` from the config.

What this module deliberately does not do: parse the model's replies or count steps itself;
the proxy trace is the record of what the model did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements, HarnessResult
from harnessrl.harness.cli_agent import (
    agent_log_path,
    agent_state_dir,
    base_env,
    read_agent_file,
    run_agent_process,
)
from harnessrl.harness.install import agent_executable
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "mini-swe-agent"
TRAJECTORY_BYTES = 64 << 20
"""Largest trajectory file read back (a larger one reads as missing: truncated JSON)."""


class MiniSweAgentConfig(BaseModel):
    """Options of the mini-swe-agent harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tool_calls: bool = False
    """Use the tool-call protocol (`mini.yaml`); False uses the text protocol
    (`mini_textbased.yaml`, ```` ```mswea_bash_command ```` blocks) for models without tool calls."""
    step_limit: int = Field(default=4, ge=1)
    """Most model calls per rollout (mini's `agent.step_limit`). Kept small by default: every
    call's tokens are generated and then trained on; raise it for capable models."""
    cost_limit: float = Field(default=0.0, ge=0.0)
    """mini's dollar cost limit; 0 disables it (a local model has no price)."""
    max_format_errors: int = Field(default=3, ge=0)
    """Stop after this many replies in a row without exactly one action (0 = never)."""
    command_timeout_s: int = Field(default=30, ge=1)
    """Wall-clock limit of each bash command the agent runs (mini's `environment.timeout`)."""
    model_retry_attempts: int = Field(default=2, ge=1)
    """Attempts per model call before mini gives up (mini retries failed calls with backoff)."""
    model_kwargs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra fields sent with every request (e.g. `{"temperature": 1.0}`); the proxy's run
    sampling parameters take precedence anyway."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `mini` arguments, appended last (e.g. `["-c", "agent.wall_time_limit_seconds=60"]`)."""
    kill_grace_s: float = Field(default=2.0, ge=0.0)
    """Seconds between SIGTERM and SIGKILL when the agent's tree is killed."""

    def requirements(self) -> HarnessRequirements:
        """mini-swe-agent's prompts are short (~0.7k tokens at the second step)."""
        return HarnessRequirements(
            protocol="chat.completions", min_context_tokens=2048,
            why="mini-swe-agent's prompts are short (~0.7k tokens at the second step); "
                "each step adds a reply and the command's output")


class MiniSweAgentHarness:
    """Runs `mini -y --exit-immediately` in the sandbox workdir; see the module docstring."""

    name = AGENT

    def __init__(self, config: MiniSweAgentConfig | None = None) -> None:
        self.config = config or MiniSweAgentConfig()

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        """Run mini-swe-agent on `task` for at most `timeout_s` wall seconds.

        Raises:
            HarnessInstallError: mini-swe-agent is not installed (the message gives the
                `harnessrl harness install mini-swe-agent` command). Agent failures never raise.
        """
        executable = agent_executable(AGENT)
        state = agent_state_dir(sandbox, AGENT)
        config_path = state / "harnessrl.yaml"
        traj_path = state / "traj.json"
        # JSON is valid YAML; mini requires the `.yaml` suffix.
        config_path.write_text(json.dumps(self._agent_config(endpoint, sandbox), indent=2))
        argv = [
            str(executable), "-y", "--exit-immediately",
            "-m", f"openai/{endpoint.model}",
            "-c", "mini.yaml" if self.config.tool_calls else "mini_textbased.yaml",
            "-c", str(config_path),
            "-o", str(traj_path),
            "-t", task.instruction,
            *self.config.extra_args,
        ]  # fmt: skip
        env = base_env(
            sandbox,
            {
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": str(state / "global"),
                "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(self.config.model_retry_attempts),
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            },
        )
        run = await run_agent_process(
            sandbox, argv, env, agent_log_path(sandbox, AGENT), timeout_s, self.config.kill_grace_s
        )
        info = read_trajectory_info(sandbox, traj_path)
        submission = info.get("submission")
        exit_status = info.get("exit_status") or "unknown"
        error = None
        if not run.timed_out and run.exit_code != 0:
            detail = info.get("exception_str") or exit_status
            error = f"mini-swe-agent exited with code {run.exit_code}: {detail}"
        return HarnessResult(
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            final_answer=submission if isinstance(submission, str) and submission else None,
            error=error,
            log_tail=run.log_tail,
        )

    def _agent_config(self, endpoint: Endpoint, sandbox: Sandbox) -> dict[str, Any]:
        """The config merged over mini's bundled one (mini merges `-c` specs recursively)."""
        cfg = self.config
        model: dict[str, Any] = {
            "model_kwargs": {
                **cfg.model_kwargs,
                "api_base": endpoint.base_url,
                "api_key": endpoint.api_key,
                "drop_params": True,
            },
        }
        if not cfg.tool_calls:
            model["model_class"] = "litellm_textbased"
        return {
            "agent": {
                "step_limit": cfg.step_limit,
                "cost_limit": cfg.cost_limit,
                "max_consecutive_format_errors": cfg.max_format_errors,
                "mode": "yolo",
                "confirm_exit": False,
            },
            "environment": {"cwd": str(sandbox.workdir), "timeout": cfg.command_timeout_s},
            "model": model,
        }


def read_trajectory_info(sandbox: Sandbox, traj_path: Path) -> dict[str, Any]:
    """`info` of a mini trajectory (`exit_status`, `submission`, ...) plus `exception_str` of
    the exit message when present; {} when the file is missing, unreadable, larger than
    `TRAJECTORY_BYTES`, or a symlink (read with `read_agent_file`, never followed)."""
    text = read_agent_file(sandbox, traj_path, TRAJECTORY_BYTES)
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
