"""Codex CLI (npm `@openai/codex`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `codex exec` headless on one task inside a sandbox, pointed at the proxy's
Responses API (`POST /v1/responses`; Codex refuses `wire_api = "chat"`), and take the last
message it writes with `-o` as the final answer.

How the endpoint reaches the agent: `<home>/.harnessrl/codex/config.toml` (the directory is
`CODEX_HOME`) declares one model provider `harnessrl` with `wire_api = "responses"` and
`base_url` = the proxy's keyed base URL (`/r/<key>/v1`), so no key travels in the
environment or argv; approvals are off (`approval_policy = "never"`), Codex's own sandbox is
off (the rollout's sandbox isolates it), update checks and analytics are off.

Behaviour to know (measured, see the harness-client notes): Codex always streams; it sends
`x-codex-turn-metadata` with `request_kind` (`turn`, `compaction`), recorded as
`Turn.request_kind`; it compacts when usage passes `auto_compact_tokens`; it sends a hosted
`web_search` tool (dropped by the proxy with a note) unless `web_search = "disabled"`, which
this harness sets. A response cut at the token cap (`response.incomplete`) is a stream error
to Codex: it retries the call up to 5 times, then exits 1. It tries DNS for github.com and
chatgpt.com at start; offline these fail fast.

What this module deliberately does not do: pass the endpoint through the environment, or use
Codex's MCP / app-server modes.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentPaths, AgentSpec, CliAgentHarness, stripped_answer
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "codex"
PROVIDER_ID = "harnessrl"
MIN_REPLY_TOKENS = 1024
"""Reply cap Codex gets by default: a reply cut at the cap (`response.incomplete`) ends its run
(measured: 192 ends the first turn of a rollout with exit code 1)."""


class CodexConfig(BaseModel):
    """Options of the Codex harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    context_tokens: int = Field(default=32000, ge=256)
    """`model_context_window` declared to Codex."""
    auto_compact_tokens: int = Field(default=24000, ge=128)
    """`model_auto_compact_token_limit`: Codex compacts when reported usage passes it."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `codex exec` options."""
    def requirements(self) -> HarnessRequirements:
        """Codex is told its window is `context_tokens`; its first prompt is ~9.3k tokens; a
        reply cut at the cap (`response.incomplete`) makes it exit 1."""
        return HarnessRequirements(
            protocol="responses", min_context_tokens=self.context_tokens, min_reply_tokens=MIN_REPLY_TOKENS,
            why="Codex is told its context window is harness.options.context_tokens and compacts only "
                "past harness.options.auto_compact_tokens (its first prompt is ~9.3k tokens); a reply cut "
                "at sampling.max_tokens is a stream error to it and it exits 1")


class CodexHarness(CliAgentHarness):
    """Runs `codex exec --skip-git-repo-check --ephemeral` in the sandbox workdir."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: CodexConfig | None = None) -> None:
        self.config = config or CodexConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """Codex's argv, env and `config.toml`; its answer is the last message it writes with `-o`."""
        argv = [*self.command(paths), "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never",
                "-c", 'web_search="disabled"', "-o", paths.state("last_message.txt"), *self.config.extra_args,
                task.instruction]
        return AgentSpec(argv=argv, env={"CODEX_HOME": paths.state(), "DO_NOT_TRACK": "1"},
                         files=(AgentFile(f"{paths.state_rel}/config.toml", self.config_toml(endpoint)),),
                         output=("home", f"{paths.state_rel}/last_message.txt"), interpret=stripped_answer)

    def config_toml(self, endpoint: Endpoint) -> str:
        """The `config.toml` content for `endpoint` (see the module docstring)."""
        base_url = endpoint.keyed_base_url or endpoint.base_url
        q = json.dumps  # a JSON string literal is a valid TOML basic string
        return "\n".join([
            f"model = {q(endpoint.model)}",
            f"model_provider = {q(PROVIDER_ID)}",
            'approval_policy = "never"',
            'sandbox_mode = "danger-full-access"',
            "check_for_update_on_startup = false",
            f"model_context_window = {self.config.context_tokens}",
            f"model_auto_compact_token_limit = {self.config.auto_compact_tokens}",
            "",
            f"[model_providers.{PROVIDER_ID}]",
            'name = "harnessrl proxy"',
            f"base_url = {q(base_url)}",
            'wire_api = "responses"',
            "",
            "[analytics]",
            "enabled = false",
            "",
        ])  # fmt: skip
