"""An OpenEnv session as the white-box loop's task: its messages, its tools, or its own agent.

Responsibility: for one rollout of `tasks.kind = "openenv"`, open the session
(`factory.create(task, seed, episode_id)`, `tasks/openenv.py`) and run it in the mode it offers:

  * step session (any `ResourceSession`, e.g. `StepEnvSessionAdapter` over a step/reset
    environment): the white-box loop samples each turn through the shared capture function
    (`WhiteBoxHarness._sample`) with the session's `initial_messages` and its MCP tool manifest
    as chat tools, calls `session.call_tool` for each tool call (reserved names refused, an
    unknown tool or a raising tool is an error message to the model, as OpenEnv's bridge
    answers), and stops at a reply without tool calls, a tool result with `done`, or
    `max_turns` model calls;
  * loop-owning session (`wait_for_completion`): its agent was pointed at the rollout's proxy
    endpoint when `create` takes `base_url`/`api_key`/`model` (the endpoint as the sandbox's
    agents address it); with a `sandbox` keyword `create` started that agent inside the
    rollout's sandbox (`BlockingSandbox.spawn`), so the sandbox's teardown kills it on every
    path (the runner's `kill_processes` before verifying, `close()` at the end). The proxy
    records every call, the loop waits (`wait_for_completion(timeout)` on a worker thread, a
    `TimeoutError` is the rollout's timeout). When
    the proxy saw no call and the session offers `fetch_training_trace` (a `TrainableSession`)
    or `fetch_proxy_trace`, its entries become the rollout's turns, validated like any upstream
    (`harness/openenv_trace.py`).

The transcript and final state (`done`, `metrics`, `tool_trace`, `exit_code`) are recorded on
the live session for the verifier (`rewards/openenv.py`), on every path. A failed `create` is
the agent's failure (`agent_error`); any exception or cancellation closes the session here.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

from harnessrl.harness.base import HarnessResult
from harnessrl.harness.openenv_trace import turn_from_entry
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.openenv import (
    RESERVED_TOOL_NAMES,
    LiveSession,
    is_loop_owning,
    sessions_for,
    tool_specs,
)
from harnessrl.types import Endpoint

if TYPE_CHECKING:
    from harnessrl.harness.python_loop import WhiteBoxHarness


async def run_openenv_session(harness: WhiteBoxHarness, task: Task, sandbox: Sandbox, endpoint: Endpoint,
                              timeout_s: float) -> HarnessResult:
    """Open `task`'s session for this rollout and run it (see the module docstring)."""
    sessions = sessions_for(task)
    episode_id = getattr(sandbox, "sandbox_id", None) or uuid.uuid4().hex[:16]
    try:
        live = await sessions.open(task, sandbox, str(episode_id), endpoint)
    except Exception as exc:  # noqa: BLE001 - a factory failure is this rollout's data
        return HarnessResult(exit_code=1, timed_out=False,
                             error=f"OpenEnv factory.create raised {type(exc).__name__}: {exc}")
    try:
        if is_loop_owning(live.session):
            result = await _wait(live, timeout_s)
            await asyncio.to_thread(_import_own_trace, harness, live, endpoint)
            return result
        return await _drive(harness, live, endpoint)
    except BaseException:
        await asyncio.shield(sessions.close(sandbox))
        raise


async def _wait(live: LiveSession, timeout_s: float) -> HarnessResult:
    # a little under the harness's own limit, so the session's timeout is the one that fires
    try:
        code = await asyncio.to_thread(live.session.wait_for_completion, max(1.0, timeout_s * 0.95))
    except TimeoutError:
        live.final_state = {"done": False, "timed_out": True, "exit_code": None}
        return HarnessResult(exit_code=None, timed_out=True, error="OpenEnv session's agent did not finish")
    live.final_state = {"done": True, "timed_out": False, "exit_code": code}
    error = None if code == 0 else f"OpenEnv session's agent exited with {code}"
    return HarnessResult(exit_code=code, timed_out=False, error=error)


def _import_own_trace(harness: WhiteBoxHarness, live: LiveSession, endpoint: Endpoint) -> int:
    """When the proxy recorded none of the agent's calls and the session offers
    `fetch_proxy_trace`, its entries become this rollout's turns, validated
    (`harness/openenv_trace.py`). Returns how many were imported."""
    recorder = harness._store.lookup(endpoint.api_key)
    training = getattr(live.session, "fetch_training_trace", None)  # OpenEnv's TrainableSession
    fetch = getattr(live.session, "fetch_proxy_trace", None)
    if recorder is None or recorder.trace.turns or not (callable(training) or callable(fetch)):
        return 0
    try:
        if callable(training):
            entries = list(training().to_trace_entries())
        else:
            entries = list(fetch() or []) if callable(fetch) else []
    except Exception as exc:  # noqa: BLE001 - a failed fetch leaves the trace empty; say why
        name = "fetch_training_trace" if callable(training) else "fetch_proxy_trace"
        live.final_state["trace_error"] = f"{name} raised {type(exc).__name__}: {exc}"
        return 0
    version = harness._deps.engine.policy_version
    imported = 0
    for entry in entries:
        try:
            index = recorder.reserve_turn_index()
        except Exception:  # noqa: BLE001 - max_turns_per_session reached: the rest is not kept
            break
        imported += recorder.record(turn_from_entry(entry, index, version))
    return imported


async def _drive(harness: WhiteBoxHarness, live: LiveSession, endpoint: Endpoint) -> HarnessResult:
    session = live.session
    messages: list[dict[str, Any]] = list(await asyncio.to_thread(session.initial_messages))
    manifest = await asyncio.to_thread(session.list_tools)
    tools = tool_specs(manifest)  # ValueError for a reserved name: a broken environment
    tool_trace: list[dict[str, Any]] = []
    done, turns, last_text = False, 0, None
    live.transcript = messages
    try:
        for _ in range(harness._config.max_turns):
            reply, failure = await harness._sample(messages, tools, endpoint)
            if reply is None:
                return HarnessResult(exit_code=1, timed_out=False, final_answer=last_text, error=failure)
            turns += 1
            last_text = reply.get("content")
            message: dict[str, Any] = {"role": "assistant", "content": last_text or ""}
            if reply.get("tool_calls"):
                message["tool_calls"] = reply["tool_calls"]
            messages.append(message)
            calls = reply.get("tool_calls") or []
            if not calls:
                done = True
                break
            for call in calls:
                name = call["function"]["name"]
                text, result = await _call_tool(session, name, call["function"].get("arguments"))
                if result is not None:
                    tool_trace.append({"tool_name": name, "arguments": result["arguments"], "result": result["result"]})
                    reward = _reward_of(result["result"])
                    if reward is not None:
                        live.tool_reward = reward
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": text})
                if result is not None and result["result"]["done"]:
                    done = True
                    break
            if done:
                break
        return HarnessResult(exit_code=0, timed_out=False, final_answer=last_text,
                             log_tail="" if done else f"stopped after max_turns={harness._config.max_turns}")
    finally:
        live.final_state = {"done": done, "metrics": {"turns": turns, "tool_calls": len(tool_trace)},
                            "tool_trace": tool_trace}


async def _call_tool(session: Any, name: str, raw_args: Any) -> tuple[str, dict[str, Any] | None]:
    """`(text for the model, trace record or None when the tool was not called)`."""
    try:
        args = json.loads(raw_args or "{}") if isinstance(raw_args, str) else dict(raw_args or {})
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        return f"error: arguments are not a JSON object ({exc})", None
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object", None
    if name in RESERVED_TOOL_NAMES:
        return f"error: reserved orchestration tool: {name}", None
    try:
        result = await asyncio.to_thread(session.call_tool, name, dict(args))
    except KeyError as exc:
        return f"error: {exc.args[0] if exc.args else 'unknown tool ' + name}", None
    except Exception as exc:  # noqa: BLE001 - a tool fault goes back to the model, as OpenEnv's bridge does
        return f"error: tool {name} raised {type(exc).__name__}: {exc}", None
    record = {"data": getattr(result, "data", None), "done": bool(getattr(result, "done", False)),
              "metadata": dict(getattr(result, "metadata", {}) or {}), "error": getattr(result, "error", None)}
    data = record["data"]
    text = "" if data is None else data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    if record["error"]:
        text = f"error: {record['error']}\n{text}".rstrip()
    return text, {"arguments": dict(args), "result": record}


def _reward_of(result: dict[str, Any]) -> float | None:
    reward = result["metadata"].get("reward")
    if reward is None and isinstance(result["data"], dict):
        reward = result["data"].get("reward")
    try:
        return None if reward is None else float(reward)
    except (TypeError, ValueError):
        return None
