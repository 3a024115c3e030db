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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentOutcome, AgentPaths, AgentSpec, CliAgentHarness
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
    def requirements(self) -> HarnessRequirements:
        """Claude Code's prompts are 12-20k tokens; it gives up on a reply cut below `output_tokens`."""
        return HarnessRequirements(
            protocol="messages", min_context_tokens=CONTEXT_FLOOR_TOKENS + self.output_tokens,
            min_reply_tokens=self.output_tokens,
            why="Claude Code's prompts measured 12-20k tokens, and it stops when a reply is cut below "
                "the harness.options.output_tokens it asked for")


class ClaudeCodeHarness(CliAgentHarness):
    """Runs `claude -p --output-format json` in the sandbox workdir; see the module docstring."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: ClaudeCodeConfig | None = None) -> None:
        self.config = config or ClaudeCodeConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """Claude Code's argv, env and `settings.json`; its result is its last JSON `result` line."""
        argv = [*self.command(paths), "-p", "--output-format", "json", "--dangerously-skip-permissions",
                "--max-turns", str(self.config.max_turns), "--model", endpoint.model,
                "--settings", paths.state("settings.json"), *self.config.extra_args, task.instruction]
        settings = AgentFile(f"{paths.state_rel}/settings.json", json.dumps(self.settings(endpoint), indent=2))
        return AgentSpec(argv=argv, env={**_QUIET_ENV, "CLAUDE_CONFIG_DIR": paths.state()}, files=(settings,),
                         interpret=interpret_result, label="claude")

    def settings(self, endpoint: Endpoint) -> dict[str, Any]:
        """The `settings.json` content for `endpoint` (see the module docstring)."""
        env = {"ANTHROPIC_BASE_URL": endpoint.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": endpoint.api_key,
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.config.output_tokens)}
        env.update({slot: endpoint.model for slot in _MODEL_SLOTS})
        return {"env": env, "includeCoAuthoredBy": False, "cleanupPeriodDays": 1}


def interpret_result(output: str | None, log_tail: str) -> AgentOutcome:
    """The `result` of Claude Code's last result line as the final answer; `is_error` marks the
    run failed (the detail is its `result` or `subtype`)."""
    result = read_result(output) or {}
    answer = result.get("result")
    detail = result.get("result") or result.get("subtype")
    return AgentOutcome(final_answer=answer if isinstance(answer, str) else None,
                        error_detail=str(detail) if detail is not None else None, failed=bool(result.get("is_error")))


def read_result(text: str | None) -> dict[str, Any] | None:
    """The last `{"type": "result", ...}` JSON line in `text` (Claude Code's log), or None."""
    for line in reversed((text or "").splitlines()):
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "result":
                return obj
    return None
