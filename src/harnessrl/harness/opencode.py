"""opencode (npm `opencode-ai`, pinned in `install.py`) as a loop-owning harness.

Responsibility: run `opencode run` headless on one task inside a sandbox, pointed at the
proxy through a provider config file, and pick its last text reply as the final answer.

How the endpoint reaches the agent: `<home>/.harnessrl/opencode/opencode.json`, named by
`OPENCODE_CONFIG`, declares one `@ai-sdk/openai-compatible` provider `harnessrl` with
`baseURL` = the proxy and `apiKey` = the rollout key, and sets both `model` and `small_model`
to it, so opencode's title-generation call also comes to the proxy (and is recorded) instead
of going to some other provider. The key is not in the agent's environment or argv.

Behaviour to know (measured, see the harness-client notes): opencode always streams chat
completions with `stream_options.include_usage`; it generates a title in parallel with the
first turn; it compacts the conversation when the reported usage nears `context_tokens`;
it loops without end on a truncated stream or `choices: []`, which the wall-clock timeout
bounds. Auto-update, sharing, LSP downloads, model-list fetches and default plugins are
disabled through env; HOME and the XDG dirs point inside the sandbox (opencode keeps a SQLite
DB and logs under its data dir).

The prompt reaches `opencode run` on stdin (it reads a non-terminal stdin as the message),
from `<home>/.harnessrl/opencode/instruction.md`, through `sh -c 'exec "$@" < file'` (the
shell replaces itself, so the process tree is just opencode). Not on the command line: an
argument containing a space is wrapped in literal double quotes by `opencode run`, and
passing the words separately breaks on words its argument parser reads as numbers
(`42` -> "G.includes is not a function", exit 1, measured with 1.18.33). Stdin delivers the
instruction byte for byte, newlines and runs of spaces included.

What this module deliberately does not do: pass the endpoint through the environment, or
talk to opencode's server mode.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.cli_agent import AgentFile, AgentOutcome, AgentPaths, AgentSpec, CliAgentHarness
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

AGENT = "opencode"
PROVIDER_ID = "harnessrl"

_OPENCODE_ENV = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "DO_NOT_TRACK": "1",
}

Permission = Literal["allow", "ask", "deny"]

TOOLS = ("bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "write")
"""The tools opencode (1.18) sends a tool-calling model by default (`webfetch` is denied)."""
AGENT_NAME = "harnessrl"
"""The primary agent declared when `system_prompt` is set (run with `--agent harnessrl`)."""


class OpencodeConfig(BaseModel):
    """Options of the opencode harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    context_tokens: int = Field(default=16384, ge=256)
    """Context window declared to opencode (`limit.context`); it compacts when the reported
    prompt usage plus `output_tokens` nears this. opencode's own first prompt is 7,496
    tokens with the SmolLM2 tokenizer (9.6k-character system prompt + 9 tool schemas; 1,712 with
    `tools = ["bash"]` and a one-line `system_prompt`), so
    `context_tokens - output_tokens` must stay well above that or it compacts after every step
    without end (measured: 8192 with 1024 loops at once; 8192 with 512 loops as soon as a reply
    is near 512 tokens, 20 compactions in 90 s; 16384 with 512 does not)."""
    output_tokens: int = Field(default=512, ge=1)
    """Completion cap declared to opencode (`limit.output`); sent as `max_tokens`."""
    tool_call: bool = True
    """Declare the model as tool-calling (opencode then sends its 9 tools)."""
    permission: dict[str, Permission] = Field(
        default_factory=lambda: dict[str, Permission]({"bash": "allow", "edit": "allow", "webfetch": "deny"})
    )
    """opencode's `permission` block; anything left at `ask` would block a headless run."""
    tools: list[str] | None = None
    """The tools opencode sends, from `TOOLS`; the others are denied in `permission` (opencode
    then leaves them out of the request). None: all of them (~4k of the first prompt's tokens
    with the SmolLM2 tokenizer)."""
    system_prompt: str | None = None
    """A system prompt replacing opencode's own (9.6k characters): declared as the `prompt` of
    a primary agent `harnessrl`, which the run uses (`--agent harnessrl`). opencode still adds
    its environment block (working directory, platform, date). None: opencode's `build` agent."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `opencode run` options (e.g. `["--agent", "build"]`)."""

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str] | None) -> list[str] | None:
        unknown = sorted(set(tools or ()) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown opencode tool(s) {unknown}; its tools are {list(TOOLS)}")
        return tools

    def permissions(self) -> dict[str, Permission]:
        """`permission` with every tool outside `tools` denied (`tools` set)."""
        if self.tools is None:
            return dict(self.permission)
        allowed: Permission = "allow"
        denied: Permission = "deny"
        return {**self.permission, **{t: allowed if t in self.tools else denied for t in TOOLS}}

    def requirements(self) -> HarnessRequirements:
        """opencode is told its window is `context_tokens` and asks for `output_tokens` replies."""
        return HarnessRequirements(
            protocol="chat.completions", min_context_tokens=self.context_tokens,
            min_reply_tokens=self.output_tokens,
            why="opencode is told its context window is harness.options.context_tokens and asks for "
                "harness.options.output_tokens per reply (its first prompt is 7,496 tokens, ~1.7k with "
                "harness.options.tools = [\"bash\"] and a short system_prompt)")


class OpencodeHarness(CliAgentHarness):
    """Runs `opencode run --format json` in the sandbox workdir; see the module docstring."""

    name = AGENT
    install_name = AGENT

    def __init__(self, config: OpencodeConfig | None = None) -> None:
        self.config = config or OpencodeConfig()

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """opencode's argv (the prompt on stdin from a file), env and provider config; its
        result is read from the JSON events in its log."""
        command = self.command(paths)
        argv = [
            "/bin/sh", "-c", 'exec "$@" < "$0"', paths.state("instruction.md"),
            *command, "run",
            "-m", f"{PROVIDER_ID}/{endpoint.model}",
            "--format", "json",
            *(["--agent", AGENT_NAME] if self.config.system_prompt is not None else []),
            *self.config.extra_args,
        ]  # fmt: skip
        files = (AgentFile(f"{paths.state_rel}/opencode.json", json.dumps(self.provider_config(endpoint), indent=2)),
                 AgentFile(f"{paths.state_rel}/instruction.md", task.instruction))
        return AgentSpec(argv=argv, env={**_OPENCODE_ENV, "OPENCODE_CONFIG": paths.state("opencode.json")},
                         files=files, interpret=interpret_events)

    def provider_config(self, endpoint: Endpoint) -> dict[str, Any]:
        """The `opencode.json` content for `endpoint` (see the module docstring)."""
        model_ref = f"{PROVIDER_ID}/{endpoint.model}"
        agent = ({} if self.config.system_prompt is None else
                 {"agent": {AGENT_NAME: {"mode": "primary", "prompt": self.config.system_prompt,
                                         "description": "the run's own short system prompt"}}})
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                PROVIDER_ID: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "harnessrl proxy",
                    "options": {"baseURL": endpoint.base_url, "apiKey": endpoint.api_key},
                    "models": {
                        endpoint.model: {
                            "name": endpoint.model,
                            "tool_call": self.config.tool_call,
                            "limit": {"context": self.config.context_tokens, "output": self.config.output_tokens},
                        }
                    },
                }
            },
            "model": model_ref,
            "small_model": model_ref,
            "autoupdate": False,
            "share": "disabled",
            "permission": self.config.permissions(),
            **agent,
        }


def interpret_events(output: str | None, log_tail: str) -> AgentOutcome:
    """The last `text` event as the final answer, the last `error` event as the error detail."""
    events = json_events(output)
    return AgentOutcome(final_answer=last_text(events), error_detail=_last_error(events))


def json_events(text: str | None) -> list[dict[str, Any]]:
    """The JSON event objects `opencode run --format json` printed in `text` (its log's
    end; other lines skipped)."""
    events: list[dict[str, Any]] = []
    for line in (text or "").splitlines():
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events


def last_text(events: list[dict[str, Any]]) -> str | None:
    """Text of the last `text` event (the agent's final reply), or None."""
    for event in reversed(events):
        part = event.get("part")
        if event.get("type") == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
            return part["text"]
    return None


def _last_error(events: list[dict[str, Any]]) -> str | None:
    for event in reversed(events):
        if event.get("type") == "error":
            return json.dumps(event.get("error", event))[:500]
    return None
