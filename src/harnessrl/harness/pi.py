"""Pi coding agent (npm `@mariozechner/pi-coding-agent`, pinned in `install.py`) as a
loop-owning harness.

Responsibility: run `pi -p` headless on one task inside a sandbox, pointed at the proxy through
its model registry file, and pick its last assistant text as the final answer.

How the endpoint reaches the agent: `<home>/.harnessrl/pi/models.json` (the directory is named
by `PI_CODING_AGENT_DIR`) declares one provider `harnessrl` with `baseUrl` = the proxy,
`apiKey` = the rollout key and `api` = the wire protocol to speak (`PiConfig.api`):
`openai-completions` (default: streamed chat completions with `stream_options.include_usage`,
user content as a list of parts), `openai-responses` (`POST /v1/responses`) or
`anthropic-messages` (`POST /v1/messages`; the base URL is then the proxy root, as the
Anthropic client appends `/v1/messages`). The key is not in the agent's environment or argv.

Behaviour to know (measured, see the harness-client notes): pi sends no title call; it
auto-compacts after a turn when the context nears `context_tokens - reserve` (one more
streamed call with no tools, recorded like any other); a truncated stream or `choices: []`
exits 0. `PI_OFFLINE=1` turns off update checks and telemetry (loopback only, no DNS);
`--no-session` keeps it from writing session files.

What this module deliberately does not do: pass the endpoint through the environment, or use
pi's RPC mode.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentOutcome, AgentPaths, AgentSpec, CliAgentHarness
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "pi"
PROVIDER_ID = "harnessrl"
_PI_ENV = {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0", "DO_NOT_TRACK": "1"}

PiApi = Literal["openai-completions", "openai-responses", "anthropic-messages"]


class PiConfig(BaseModel):
    """Options of the pi harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    api: PiApi = "openai-completions"
    """Wire protocol pi speaks to the proxy."""
    context_tokens: int = Field(default=32000, ge=256)
    """Context window declared to pi (`contextWindow`); it compacts near this."""
    output_tokens: int = Field(default=1024, ge=1)
    """Completion cap declared to pi (`maxTokens`), sent as `max_completion_tokens`."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `pi` options (e.g. `["--thinking", "high"]`)."""
    def requirements(self) -> HarnessRequirements:
        """pi is told its window is `context_tokens` and asks for `output_tokens` replies."""
        protocol = {"openai-completions": "chat.completions", "openai-responses": "responses",
                    "anthropic-messages": "messages"}[self.api]
        return HarnessRequirements(
            protocol=protocol, min_context_tokens=self.context_tokens, min_reply_tokens=self.output_tokens,
            why="pi is told its context window is harness.options.context_tokens (it compacts near it) "
                "and asks for harness.options.output_tokens per reply")


class PiHarness(CliAgentHarness):
    """Runs `pi -p --mode json --no-session` in the sandbox workdir; see the module docstring."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: PiConfig | None = None) -> None:
        self.config = config or PiConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """pi's argv, env and model registry; its answer is read from the JSON lines in its log."""
        argv = [*self.command(paths), "--model", f"{PROVIDER_ID}/{endpoint.model}", "--mode", "json", "--no-session",
                *self.config.extra_args, "-p", task.instruction]
        files = (AgentFile(f"{paths.state_rel}/models.json", json.dumps(self.models_config(endpoint), indent=2)),
                 AgentFile(f"{paths.state_rel}/settings.json", json.dumps({"enableInstallTelemetry": False})))
        return AgentSpec(argv=argv, env={**_PI_ENV, "PI_CODING_AGENT_DIR": paths.state()}, files=files,
                         interpret=lambda output, log_tail: AgentOutcome(final_answer=last_assistant_text(output)))

    def models_config(self, endpoint: Endpoint) -> dict[str, Any]:
        """The `models.json` content for `endpoint` (see the module docstring)."""
        base_url = endpoint.base_url
        if self.config.api == "anthropic-messages":
            base_url = base_url.removesuffix("/v1")
        model = {"id": endpoint.model, "contextWindow": self.config.context_tokens,
                 "maxTokens": self.config.output_tokens}
        return {"providers": {PROVIDER_ID: {"baseUrl": base_url, "api": self.config.api,
                                            "apiKey": endpoint.api_key, "models": [model]}}}


def last_assistant_text(text: str | None) -> str | None:
    """Text of the last assistant message in pi's JSON event lines `text`, or None."""
    found: str | None = None
    for line in (text or "").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        message = event.get("message") if isinstance(event, dict) else None
        if isinstance(message, dict) and message.get("role") == "assistant":
            texts = [p.get("text", "") for p in message.get("content") or []
                     if isinstance(p, dict) and p.get("type") == "text"]
            if texts:
                found = "".join(texts)
    return found
