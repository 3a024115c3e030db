"""Gemini CLI (npm `@google/gemini-cli`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `gemini -p` headless on one task inside a sandbox, pointed at the proxy's
Google route (`POST /v1beta/models/<model>:streamGenerateContent`, `proxy/google.py`), and take
the `response` of its JSON output as the final answer.

How the endpoint reaches the agent: `<home>/.gemini/.env` (which Gemini CLI loads itself) holds
`GEMINI_API_KEY` = the rollout key and `GOOGLE_GEMINI_BASE_URL` = the proxy root (the SDK
appends `/v1beta/models/...`); `<home>/.gemini/settings.json` selects the API-key auth (with a
base URL alone it would pick "gateway" auth, which headless mode refuses), turns off usage
statistics, telemetry and auto-update. The key is not in the agent's environment or argv.
`GEMINI_CLI_TRUST_WORKSPACE=true` lets it run in the (untrusted) sandbox workdir headless.

Behaviour to know (measured with 0.61.0 on the tiny model): one streamed call per turn with
its whole tool set; its system prompt and tool declarations take ~8.7k tokens, so the
engine's context must be larger (`context_tokens`, default 16384); it warns on stderr about
colours and ripgrep, harmlessly.

What this module deliberately does not do: MCP servers, sandboxing of its own (`--sandbox`),
or checkpointing.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentOutcome, AgentPaths, AgentSpec, CliAgentHarness
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "gemini-cli"
_ENV = {"GEMINI_CLI_TRUST_WORKSPACE": "true", "GEMINI_CLI_NO_RELAUNCH": "true", "DO_NOT_TRACK": "1",
        "NO_BROWSER": "true"}


class GeminiCliConfig(BaseModel):
    """Options of the Gemini CLI harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    context_tokens: int = Field(default=16384, ge=12288)
    """Smallest engine context the run needs: Gemini CLI's prompt alone is ~8.7k tokens."""
    output_tokens: int = Field(default=256, ge=1)
    """Smallest reply cap (`sampling.max_tokens`) the run needs."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `gemini` options (e.g. `["--approval-mode", "yolo"]`)."""

    def requirements(self) -> HarnessRequirements:
        return HarnessRequirements(
            protocol="google", min_context_tokens=self.context_tokens, min_reply_tokens=self.output_tokens,
            why="Gemini CLI's system prompt and tool declarations take ~8.7k tokens "
                "(harness.options.context_tokens)")


class GeminiCliHarness(CliAgentHarness):
    """Runs `gemini -p ... --output-format json` in the sandbox workdir; see the module docstring."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: GeminiCliConfig | None = None) -> None:
        self.config = config or GeminiCliConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        argv = [*self.command(paths), "-m", endpoint.model, "--output-format", "json", *self.config.extra_args,
                "-p", task.instruction]
        files = (AgentFile(".gemini/settings.json", json.dumps(settings(), indent=2)),
                 AgentFile(".gemini/.env", dotenv(endpoint)))
        return AgentSpec(argv=argv, env=dict(_ENV), files=files, interpret=interpret_output)


def settings() -> dict[str, Any]:
    """`~/.gemini/settings.json`: API-key auth, no statistics, telemetry or auto-update."""
    return {"security": {"auth": {"selectedType": "gemini-api-key"}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}


def dotenv(endpoint: Endpoint) -> str:
    """`~/.gemini/.env`: the rollout key and the proxy root."""
    return f"GEMINI_API_KEY={endpoint.api_key}\nGOOGLE_GEMINI_BASE_URL={endpoint.base_url.removesuffix('/v1')}\n"


def interpret_output(output: str | None, log_tail: str) -> AgentOutcome:
    """The last JSON object of its output: `response` is the answer, `error.message` a failure."""
    found: dict[str, Any] | None = None
    text = output or ""
    decoder = json.JSONDecoder()
    start = 0
    while (i := text.find("{", start)) != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            start = i + 1
            continue
        if isinstance(value, dict) and ("response" in value or "error" in value):
            found = value
        start = end
    if found is None:
        return AgentOutcome()
    error = found.get("error")
    if isinstance(error, dict):
        return AgentOutcome(failed=True, error_detail=str(error.get("message") or error))
    response = found.get("response")
    return AgentOutcome(final_answer=response if isinstance(response, str) else None)
