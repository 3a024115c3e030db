"""The white-box harness: a Python tool loop we own, sampling the engine with no HTTP hop.

Responsibility: run a short agent loop (messages → engine → tool calls → tool results) for one
rollout. Each turn goes through `proxy.capture.complete_chat`, the same function that serves the
proxy's HTTP route, so it is rendered, sampled, parsed and recorded on the rollout's session
exactly as a loop-owning agent's call would be (DESIGN.md §2, style rule 6): same trace format,
same sampling enforcement, same faithfulness checks.

Tools (hermes `<tool_call>` convention, described to the model by the chat layer):
  * `bash(command)`: runs in the sandbox with `command_timeout_s`; result is exit code + output;
  * `write_file(path, content)`: writes a file in the workspace;
  * `submit(answer)`: ends the rollout with `answer` as the final answer.
With `tools = []` the loop is a single-turn chat: the assistant's text is the final answer.
An OpenEnv task (`tasks.kind = "openenv"`) brings its own messages and tools instead: its
session's, driven by `harness/openenv_loop.py` through the same `_sample`.

What it does not do: retry failed calls, or hide anything from the trace. The session is looked
up by the rollout's key, so a revoked key ends the loop like it ends an HTTP agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.harness.base import HarnessRequirements, HarnessResult
from harnessrl.harness.openenv_loop import run_openenv_session
from harnessrl.proxy.capture import CaptureDeps, complete_chat
from harnessrl.proxy.sessions import SessionStore
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

log = logging.getLogger(__name__)

ToolName = Literal["bash", "write_file", "submit"]

_TOOL_SPECS: dict[str, dict[str, Any]] = {
    "bash": {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the working directory.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    "write_file": {"type": "function", "function": {
        "name": "write_file", "description": "Write text to a file in the working directory.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    "submit": {"type": "function", "function": {
        "name": "submit", "description": "Submit the final answer and stop.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                       "required": ["answer"]}}},
}


class WhiteBoxConfig(BaseModel):
    """Options of the white-box Python tool loop."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_turns: int = Field(default=4, ge=1)
    """Most model calls per rollout."""
    tools: list[ToolName] = Field(default_factory=lambda: list[ToolName](["bash", "write_file", "submit"]))
    """Tools offered; empty for a single-turn chat whose text is the answer."""
    command_timeout_s: float = Field(default=20.0, gt=0)
    """Limit of one `bash` call."""
    max_tool_output_chars: int = Field(default=4000, ge=100)
    """Tool results longer than this are cut (head kept) before going back to the model."""
    system_prompt: str | None = None
    """System message; default: the task's own `system_prompt`, else none."""

    def requirements(self) -> HarnessRequirements:
        """The loop's own prompts are the task, three tool schemas and the tool results."""
        return HarnessRequirements(protocol="white_box", min_context_tokens=1024,
                                   why="the task, three tool schemas and up to max_turns replies and tool results")


class WhiteBoxHarness:
    """Runs `WhiteBoxConfig`'s loop against the engine through the shared capture function."""

    name = "white_box"

    def __init__(self, deps: CaptureDeps, store: SessionStore, config: WhiteBoxConfig | None = None) -> None:
        self._deps = deps
        self._store = store
        self._config = config or WhiteBoxConfig()

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        try:
            return await asyncio.wait_for(self._loop(task, sandbox, endpoint, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            return HarnessResult(exit_code=None, timed_out=True, error=f"white-box loop exceeded {timeout_s:.0f} s")

    async def _sample(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], endpoint: Endpoint
                      ) -> tuple[dict[str, Any] | None, str | None]:
        """One model call through the shared capture function: `(assistant message, None)`, or
        `(None, why)` when the key is revoked or the call failed."""
        session = self._store.lookup(endpoint.api_key)
        if session is None:
            return None, "session key revoked during the loop"
        body: dict[str, Any] = {"model": endpoint.model, "messages": list(messages)}
        if tools:
            body["tools"] = tools
        outcome = await complete_chat(self._deps, session, body, {"user-agent": "harnessrl-white-box"})
        if outcome.status_code != 200:
            message = outcome.body.get("error", {}).get("message", str(outcome.body))
            return None, f"model call failed ({outcome.status_code}): {message}"
        return outcome.body["choices"][0]["message"], None

    async def _loop(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        if task.family == "openenv":  # the session's own messages and tools (tasks/openenv.py)

            return await run_openenv_session(self, task, sandbox, endpoint, timeout_s)
        cfg = self._config
        messages: list[dict[str, Any]] = []
        system = cfg.system_prompt or task.system_prompt
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": task.instruction})
        tools = [_TOOL_SPECS[name] for name in cfg.tools]
        last_text: str | None = None
        for _ in range(cfg.max_turns):
            # 1) one model call, recorded on the rollout's session
            reply, failure = await self._sample(messages, tools, endpoint)
            if reply is None:
                return HarnessResult(exit_code=1, timed_out=False, final_answer=last_text, error=failure)
            last_text = reply.get("content")
            messages.append(_assistant_message(reply))
            calls = reply.get("tool_calls") or []
            # 2) no tool call: the reply is the answer
            if not calls:
                return HarnessResult(exit_code=0, timed_out=False, final_answer=last_text)
            # 3) run the tools, feed results back
            for call in calls:
                result, submitted = await self._run_tool(call, sandbox)
                if submitted is not None:
                    return HarnessResult(exit_code=0, timed_out=False, final_answer=submitted)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return HarnessResult(exit_code=0, timed_out=False, final_answer=last_text,
                             log_tail=f"stopped after max_turns={cfg.max_turns}")

    async def _run_tool(self, call: dict[str, Any], sandbox: Sandbox) -> tuple[str, str | None]:
        """Returns (tool result text, submitted answer or None)."""
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            return f"error: arguments are not valid JSON ({exc.msg})", None
        if not isinstance(args, dict):
            return "error: arguments must be a JSON object", None
        match name:
            case "bash" if "bash" in self._config.tools:
                res = await sandbox.exec(str(args.get("command", "")), timeout_s=self._config.command_timeout_s)
                text = f"exit code {res.returncode}{' (timed out)' if res.timed_out else ''}\n{res.stdout}{res.stderr}"
                return text[: self._config.max_tool_output_chars], None
            case "write_file" if "write_file" in self._config.tools:
                try:
                    sandbox.write_file(str(args.get("path", "")), str(args.get("content", "")))
                except (OSError, ValueError) as exc:
                    return f"error: {exc}", None
                return f"wrote {args.get('path')}", None
            case "submit" if "submit" in self._config.tools:
                return "submitted", str(args.get("answer", ""))
            case _:
                return f"error: unknown tool {name!r}; available: {', '.join(self._config.tools)}", None


def _assistant_message(reply: dict[str, Any]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        msg["tool_calls"] = reply["tool_calls"]
    return msg
