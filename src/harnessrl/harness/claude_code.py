"""Claude Code (npm `@anthropic-ai/claude-code`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `claude -p --output-format json` headless on one task inside a sandbox,
pointed at the proxy's Anthropic Messages API (`POST /v1/messages`), and take the `result`
of its final JSON line as the final answer.

How the endpoint reaches the agent: `<home>/.harnessrl/claude-code/settings.json` (the
directory is `CLAUDE_CONFIG_DIR`) carries an `env` block with `ANTHROPIC_BASE_URL` = the
proxy root (Claude Code appends `/v1/messages`) and `ANTHROPIC_API_KEY` = the rollout key
(sent as `x-api-key`), and points every model slot (main, small/fast, haiku/sonnet/opus
defaults) at the policy model, so background calls (topic detection, titles, summaries)
also come to the proxy and are recorded. Claude Code applies that `env` block to its own
process, so the commands it runs may see it: the proxy key is revoked before verification.

Headless flags: `-p` (print and exit), `--output-format json`, `--dangerously-skip-permissions`
(with `IS_SANDBOX=1`, which it needs to accept that flag as root), `--max-turns`.
Telemetry, error reporting, the auto-updater and non-essential traffic are disabled through
env (`DISABLE_TELEMETRY`, `DISABLE_ERROR_REPORTING`, `DISABLE_AUTOUPDATER`,
`CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`).

What this module deliberately does not do: log in to an Anthropic account, or use MCP servers.
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

AGENT = "claude-code"
_QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "IS_SANDBOX": "1",
    "DO_NOT_TRACK": "1",
}
CONTEXT_FLOOR_TOKENS = 24576
"""Prompt room Claude Code needs: its prompts measured 12-20k tokens (system prompt + tools)."""
_MODEL_SLOTS = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL")


class ClaudeCodeConfig(BaseModel):
    """Options of the Claude Code harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_turns: int = Field(default=20, ge=1)
    """`--max-turns`: agentic turns before Claude Code stops."""
    output_tokens: int = Field(default=1024, ge=1)
    """`CLAUDE_CODE_MAX_OUTPUT_TOKENS`: the `max_tokens` it sends."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `claude` options."""
    kill_grace_s: float = Field(default=2.0, ge=0.0)
    """Seconds between SIGTERM and SIGKILL when the agent's tree is killed."""

    def requirements(self) -> HarnessRequirements:
        """Claude Code's prompts are 12-20k tokens; it gives up on a reply cut below `output_tokens`."""
        return HarnessRequirements(
            protocol="messages", min_context_tokens=CONTEXT_FLOOR_TOKENS + self.output_tokens,
            min_reply_tokens=self.output_tokens,
            why="Claude Code's prompts measured 12-20k tokens, and it stops when a reply is cut below "
                "the harness.options.output_tokens it asked for")


class ClaudeCodeHarness:
    """Runs `claude -p --output-format json` in the sandbox workdir; see the module docstring."""

    name = AGENT

    def __init__(self, config: ClaudeCodeConfig | None = None) -> None:
        self.config = config or ClaudeCodeConfig()

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        """Run Claude Code on `task` for at most `timeout_s` wall seconds.

        Raises:
            HarnessInstallError: Claude Code is not installed (the message gives the install
                command). Agent failures never raise.
        """
        executable = agent_executable(AGENT)
        state = agent_state_dir(sandbox, AGENT)
        settings_path = state / "settings.json"
        settings_path.write_text(json.dumps(self.settings(endpoint), indent=2))
        argv = [str(executable), "-p", "--output-format", "json", "--dangerously-skip-permissions",
                "--max-turns", str(self.config.max_turns), "--model", endpoint.model,
                "--settings", str(settings_path), *self.config.extra_args, task.instruction]
        env = base_env(sandbox, {**_QUIET_ENV, "CLAUDE_CONFIG_DIR": str(state)})
        log_path = agent_log_path(sandbox, AGENT)
        run = await run_agent_process(sandbox, argv, env, log_path, timeout_s, self.config.kill_grace_s)
        result = read_result(sandbox, log_path)
        error = None
        if not run.timed_out and (run.exit_code != 0 or (result or {}).get("is_error")):
            detail = (result or {}).get("result") or (result or {}).get("subtype")
            if detail is None:
                lines = [ln for ln in run.log_tail.splitlines() if ln.strip()]
                detail = lines[-1][:500] if lines else "no output"
            error = f"claude exited with code {run.exit_code}: {str(detail)[:500]}"
        answer = (result or {}).get("result")
        return HarnessResult(exit_code=run.exit_code, timed_out=run.timed_out,
                             final_answer=answer if isinstance(answer, str) else None, error=error,
                             log_tail=run.log_tail)

    def settings(self, endpoint: Endpoint) -> dict[str, Any]:
        """The `settings.json` content for `endpoint` (see the module docstring)."""
        env = {"ANTHROPIC_BASE_URL": endpoint.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": endpoint.api_key,
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.config.output_tokens)}
        env.update({slot: endpoint.model for slot in _MODEL_SLOTS})
        return {"env": env, "includeCoAuthoredBy": False, "cleanupPeriodDays": 1}


def read_result(sandbox: Sandbox, log_path: Path) -> dict[str, Any] | None:
    """The last `{"type": "result", ...}` JSON line Claude Code printed, or None (also when the
    log is missing or a symlink: `read_agent_file`)."""
    text = read_agent_file(sandbox, log_path, tail=True)
    if text is None:
        return None
    lines = text.splitlines()
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "result":
                return obj
    return None
