"""Your own tasks: `tasks.kind = "python"`, a task source named by a dotted path.

Responsibility: build the `TaskSource` a config names with `tasks.source = "pkg.mod:name"`
(or `"path/to/file.py:name"`) and `tasks.kwargs = {...}`. `name` is any callable (a function
or a class); `name(**kwargs)` must return either

  * a `TaskSource`: an object with `__len__()` and `get(seed) -> Task`, or
  * a non-empty sequence of `Task` (wrapped in `ListSource`: `get(seed) = tasks[seed % len]`).

Each task's `family` picks its verifier unless the config names one (`tasks.verifier`, see
`rewards/select.py`). A runnable example: `examples/byo/`.

Errors: a path that does not import, a callable that raises, or a result of the wrong shape
raise `ConfigError` naming `tasks.source`, before any model loads (`config.check_run` imports
the path; `tasks/select.make_task_source` builds the source).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harnessrl.errors import ConfigError
from harnessrl.hooks import load_hook
from harnessrl.tasks.base import Task, TaskSource


class ListSource:
    """A fixed list of tasks: `get(seed) = tasks[seed % len(tasks)]`.

    Raises:
        ConfigError: `tasks` is empty or holds something that is not a `Task`.
    """

    def __init__(self, tasks: Sequence[Task]) -> None:
        if not tasks:
            raise ConfigError("tasks.source returned no tasks")
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise ConfigError(f"tasks.source: item {i} is a {type(task).__name__}, not a harnessrl Task")
        self._tasks = list(tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, seed: int) -> Task:
        return self._tasks[seed % len(self._tasks)]


def load_python_source(dotted: str, kwargs: dict[str, Any]) -> TaskSource:
    """Call the callable at `dotted` with `kwargs` and return its tasks as a `TaskSource`.

    Raises:
        ConfigError: import failure, the call raised, an empty or wrong-typed result, or a
            source whose first task is not a `Task`; the message names `tasks.source`.
    """
    factory = load_hook(dotted, what="tasks.source")
    try:
        made = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - user code: report it as a config error
        raise ConfigError(f"tasks.source = {dotted!r} with kwargs {kwargs!r} raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if hasattr(made, "get") and hasattr(made, "__len__"):
        if len(made) < 1:
            raise ConfigError(f"tasks.source = {dotted!r} returned an empty task source")
        first = made.get(0)
        if not isinstance(first, Task):
            raise ConfigError(f"tasks.source = {dotted!r}: get(0) returned a {type(first).__name__}, "
                              "not a harnessrl Task")
        return made
    if isinstance(made, Sequence) and not isinstance(made, (str, bytes)):
        return ListSource(made)
    raise ConfigError(f"tasks.source = {dotted!r} returned a {type(made).__name__}; expected a TaskSource "
                      "(with __len__ and get(seed)) or a list of harnessrl Task")
