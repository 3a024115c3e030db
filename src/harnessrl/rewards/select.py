"""Which verifier scores a task: one `match` on the task's family, or the config's own.

Responsibility: the single place mapping `Task.family` to its `Verifier` (DESIGN.md §2: one
implementation per seam picked with one `match`), and building the verifier a config names by
dotted path (`tasks.verifier = "pkg.mod:name"`, `tasks.verifier_kwargs = {...}`), which then
scores every task. Built-in verifiers are built with their defaults; construct one directly
for other settings.

A named verifier is `name(**verifier_kwargs)`: any object with a method
`score(task, sandbox, final_answer) -> Reward`, a coroutine function or a plain one (a plain
one runs on a worker thread). It is built once, before any model loads.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from harnessrl.errors import ConfigError, TaskError
from harnessrl.hooks import load_hook
from harnessrl.rewards.base import Reward, Verifier
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rewards.openenv import OpenEnvVerifier
from harnessrl.rewards.stdio_tests import StdioVerifier
from harnessrl.rewards.unit_tests import UnitTestVerifier
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task


def verifier_for(task: Task) -> Verifier:
    """The verifier of `task.family`. Raises TaskError for a family without one."""
    match task.family:
        case "humaneval":
            return UnitTestVerifier()
        case "stdio":
            return StdioVerifier()
        case "procedural":
            return ExactMatchVerifier()
        case "openenv":
            return OpenEnvVerifier()
        case other:
            raise TaskError(
                f"task {task.task_id!r}: no verifier for family {other!r} "
                "(known: humaneval, stdio, procedural; name your own with tasks.verifier)"
            )


def make_verifier_for(dotted: str | None, kwargs: dict[str, Any] | None = None) -> Callable[[Task], Verifier]:
    """The run's task -> verifier mapping: `verifier_for` when `dotted` is None, else the
    verifier `dotted(**kwargs)` for every task.

    Raises:
        ConfigError: the path does not import, the call raises, or the result has no
            `score` method; the message names `tasks.verifier`.
    """
    if dotted is None:
        return verifier_for

    factory = load_hook(dotted, what="tasks.verifier")
    try:
        made = factory(**(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - user code: report it as a config error
        raise ConfigError(f"tasks.verifier = {dotted!r} with kwargs {kwargs!r} raised "
                          f"{type(exc).__name__}: {exc}") from exc
    score = getattr(made, "score", None)
    if not callable(score):
        raise ConfigError(f"tasks.verifier = {dotted!r} returned a {type(made).__name__} without a "
                          "score(task, sandbox, final_answer) method")
    verifier = UserVerifier(made)
    return lambda task: verifier


class UserVerifier:
    """A config-named verifier: awaits an async `score`, runs a plain one on a worker thread
    (so it does not block the event loop), and checks that it returned a `Reward`.

    Raises (from `score`): TypeError when the result is not a `Reward`; the rollout runner
    records that, like any verifier crash, as status `verifier_error`.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._is_async = inspect.iscoroutinefunction(inner.score)

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        if self._is_async:
            reward = await self.inner.score(task, sandbox, final_answer)
        else:
            reward = await asyncio.to_thread(self.inner.score, task, sandbox, final_answer)
        if not isinstance(reward, Reward):
            raise TypeError(f"{type(self.inner).__name__}.score returned a {type(reward).__name__}, "
                            "not a harnessrl Reward")
        return reward
