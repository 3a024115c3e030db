"""OpenEnv sessions as tasks: `tasks.kind = "openenv"`, one `ResourceSession` per rollout.

Responsibility: build the user's `ResourceSessionFactory` (`tasks.factory = "pkg.mod:Class"`,
called with `tasks.kwargs`), hand out one `Task` per group seed (from the optional dataset
`tasks.path`, a JSONL file of task descriptions; without one every task is `None`), and keep
each rollout's live session from `factory.create(task, seed=group seed, episode_id=rollout id)`
until the verifier has called `session.verify(transcript, final_state)` and `close()`.

Who does what (the runner's order stays the rollout's order, DESIGN.md §3.3):
  * the harness (`harness/python_loop.py`) opens the session (`OpenEnvSessions.open`), drives
    it (white-box: `initial_messages`, `list_tools`, `call_tool`; loop-owning:
    `wait_for_completion`) and records the transcript and final state on it;
  * the verifier (`rewards/openenv.py`) runs after the agent is dead and its key revoked,
    calls `verify` and then `close`;
  * any other exit (a harness crash, a cancelled rollout, a kill failure) closes the session
    through `close(sandbox)` in the harness or `close_all()` when the runtime stops.

A factory whose `create` names a `sandbox` keyword starts its agent inside the rollout's
harnessrl sandbox (a `BlockingSandbox` over it, `sandbox/blocking.py`); those processes are
the sandbox's, so `kill_processes` ends them before `verify` and the sandbox's `close()` on
every exit path, whatever the session's own `close` does.

A session is found by the rollout's sandbox (the one object the harness and the verifier both
receive). The `openenv` package is an optional extra (`pip install harnessrl[openenv]`); this
module imports it only to check a loop-owning session.

Errors: a factory path that does not import, a constructor that raises or returns something
without `create`, or an unreadable dataset raise `ConfigError` naming the config key.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.errors import ConfigError
from harnessrl.hooks import load_hook
from harnessrl.sandbox.blocking import BlockingSandbox
from harnessrl.tasks.base import Task

log = logging.getLogger(__name__)

FAMILY = "openenv"
SANDBOX_KEYWORD = "sandbox"
"""The `create` keyword that receives the rollout's sandbox (`OpenEnvSessions.open`)."""
_SOURCES: dict[str, OpenEnvSource] = {}
_SOURCE_IDS = itertools.count()


@dataclass
class LiveSession:
    """One rollout's OpenEnv session and what the harness recorded about it."""

    session: Any
    episode_id: str
    transcript: list[dict[str, Any]] = field(default_factory=list)
    """Messages of the rollout (initial messages, assistant replies, tool results)."""
    final_state: dict[str, Any] = field(default_factory=dict)
    """`done`, `metrics` (turns, tool_calls), `tool_trace`, `exit_code`, `timed_out`."""
    tool_reward: float | None = None
    """The last reward a tool result carried (`metadata["reward"]` or `data["reward"]`)."""


class OpenEnvSessions:
    """Live sessions of one source, keyed by the rollout's sandbox. Thread-safe."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self._live: dict[int, LiveSession] = {}
        self._lock = threading.Lock()
        params = inspect.signature(factory.create).parameters
        self._create_takes = {name for name in ("base_url", "api_key", "model") if name in params} | (
            {"base_url", "api_key", "model"} if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set())
        if SANDBOX_KEYWORD in params:  # named explicitly only: a `**kwargs` factory never gets it
            self._create_takes.add(SANDBOX_KEYWORD)

    async def open(self, task: Task, sandbox: Any, episode_id: str, endpoint: Any = None) -> LiveSession:
        """`factory.create(task, seed=..., episode_id=...)` on a worker thread; the session is
        registered for `sandbox`. When `create` accepts `base_url`, `api_key` or `model`
        keywords they are the rollout's proxy endpoint (a loop-owning session points its agent
        there, as it would at OpenEnv's capture server with the session id as the key). When
        it names a `sandbox` keyword it gets the rollout's sandbox as a `BlockingSandbox`
        (`sandbox/blocking.py`: the seam's `spawn`, `exec`, `write_file`, `agent_path`,
        `agent_endpoint` as blocking calls for its worker thread); the processes it spawns
        there are the sandbox's, killed and released by the sandbox's own teardown. The
        endpoint offered is always the one the sandbox's agents address
        (`Sandbox.agent_endpoint`, applied by the runner), so an agent spawned in the sandbox
        reaches the proxy (under bubblewrap through the forwarder in its network namespace).

        Raises: whatever `create` raises (the harness reports it as the agent's failure).
        """
        item = task.metadata.get("openenv_task")
        kwargs: dict[str, Any] = {"seed": task.metadata.get("openenv_seed"), "episode_id": episode_id}
        if endpoint is not None:
            offered = {"base_url": endpoint.base_url, "api_key": endpoint.api_key, "model": endpoint.model}
            kwargs.update({k: v for k, v in offered.items() if k in self._create_takes})
        if SANDBOX_KEYWORD in self._create_takes:
            kwargs[SANDBOX_KEYWORD] = BlockingSandbox(sandbox, asyncio.get_running_loop())
        session = await asyncio.to_thread(self.factory.create, item, **kwargs)
        live = LiveSession(session=session, episode_id=episode_id)
        with self._lock:
            old = self._live.pop(id(sandbox), None)
            self._live[id(sandbox)] = live
        if old is not None:
            await asyncio.to_thread(_close_quietly, old)
        return live

    def get(self, sandbox: Any) -> LiveSession | None:
        with self._lock:
            return self._live.get(id(sandbox))

    def pop(self, sandbox: Any) -> LiveSession | None:
        """Remove and return the session of `sandbox` (the caller closes it)."""
        with self._lock:
            return self._live.pop(id(sandbox), None)

    async def close(self, sandbox: Any) -> None:
        """Close and forget the session of `sandbox`, if any; never raises."""
        live = self.pop(sandbox)
        if live is not None:
            await asyncio.to_thread(_close_quietly, live)

    def close_all(self) -> int:
        """Close every session still open; returns how many there were."""
        with self._lock:
            leftover, self._live = list(self._live.values()), {}
        for live in leftover:
            _close_quietly(live)
        return len(leftover)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


def _close_quietly(live: LiveSession) -> None:
    try:
        live.session.close()
    except Exception:  # noqa: BLE001 - teardown goes on
        log.exception("closing OpenEnv session %s failed", live.episode_id)


class OpenEnvSource:
    """A `TaskSource` over an OpenEnv factory: `get(seed)` is the task of group `seed`.

    Args:
        factory: `pkg.mod:Class` (or `path/to/file.py:Class`) of a `ResourceSessionFactory`,
            built once with `kwargs`.
        path: optional JSONL file, one task description per line (any JSON value); task
            `seed % len` goes to `factory.create` as `task`. None: one task, `None`.

    Raises:
        ConfigError: the factory does not import, raises, or has no `create`; the dataset is
            missing, empty or has a line that is not JSON (named with its line number).
    """

    def __init__(self, factory: str, kwargs: dict[str, Any] | None = None, path: str | None = None) -> None:
        cls = load_hook(factory, what="tasks.factory")
        try:
            made = cls(**(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - user code: report it as a config error
            raise ConfigError(f"tasks.factory = {factory!r} with kwargs {kwargs!r} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if not callable(getattr(made, "create", None)):
            raise ConfigError(f"tasks.factory = {factory!r} built a {type(made).__name__} without a "
                              "create(task, seed=None, episode_id=None) method")
        self.name = factory
        self.sessions = OpenEnvSessions(made)
        self.items: list[Any] = _read_dataset(Path(path)) if path else [None]
        self.key = f"{factory}#{next(_SOURCE_IDS)}"
        _SOURCES[self.key] = self

    def __len__(self) -> int:
        return len(self.items)

    def get(self, seed: int) -> Task:
        index = seed % len(self.items)
        item = self.items[index]
        instruction = _describe(item)
        return Task(task_id=f"openenv/{index}", family=FAMILY, instruction=instruction,
                    metadata={"openenv_source": self.key, "openenv_task": item, "openenv_seed": seed})


def sessions_for(task: Task) -> OpenEnvSessions:
    """The live-session registry of the source that made `task`.

    Raises:
        KeyError: `task` is not an OpenEnv task of a source built in this process.
    """
    key = task.metadata.get("openenv_source")
    if task.family != FAMILY or key not in _SOURCES:
        raise KeyError(f"task {task.task_id!r} is not an OpenEnv task of this process")
    return _SOURCES[key].sessions


def close_all_sessions() -> int:
    """Close every OpenEnv session any source still holds (runtime teardown)."""
    return sum(source.sessions.close_all() for source in list(_SOURCES.values()))


def is_loop_owning(session: Any) -> bool:
    """The session runs its own agent: it has `wait_for_completion` (OpenEnv's
    `LoopOwningSession` / `TrainableSession`)."""
    return callable(getattr(session, "wait_for_completion", None))


def tool_specs(tools: list[Any]) -> list[dict[str, Any]]:
    """OpenEnv MCP tool manifest (`name`, `description`, `input_schema`) as chat tool schemas.

    Raises:
        ValueError: a tool named after a reserved orchestration control (reset, step, state,
            close), as OpenEnv refuses them.
    """
    specs = []
    for tool in tools:
        name = tool.name if hasattr(tool, "name") else tool["name"]
        if name in RESERVED_TOOL_NAMES:
            raise ValueError(f"session tool {name!r} uses a reserved name ({', '.join(sorted(RESERVED_TOOL_NAMES))})")
        description = getattr(tool, "description", None) if hasattr(tool, "name") else tool.get("description")
        schema = getattr(tool, "input_schema", None) if hasattr(tool, "name") else (
            tool.get("input_schema") or tool.get("inputSchema"))
        specs.append({"type": "function", "function": {
            "name": name, "description": description or "",
            "parameters": schema or {"type": "object", "properties": {}}}})
    return specs


RESERVED_TOOL_NAMES = frozenset({"reset", "step", "state", "close"})
"""As `openenv.core.harness.RESERVED_TOOL_NAMES`: never offered to the model nor called."""


def _describe(item: Any) -> str:
    if item is None:
        return ""
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and isinstance(item[-1], dict):  # chat messages
        return str(item[-1].get("content", ""))
    if isinstance(item, dict):
        for key in ("instruction", "prompt", "question", "task"):
            if isinstance(item.get(key), str):
                return item[key]
    return json.dumps(item, sort_keys=True, default=str)


def _read_dataset(path: Path) -> list[Any]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"tasks.path {str(path)!r} cannot be read: {exc}") from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"tasks.path {str(path)!r} line {number} is not JSON: {exc.msg}") from exc
    if not items:
        raise ConfigError(f"tasks.path {str(path)!r} holds no task descriptions")
    return items
