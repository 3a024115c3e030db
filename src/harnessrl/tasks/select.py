"""Choosing the task source of a run from `[tasks]` (`tasks.kind`).

Responsibility: one place that maps a validated tasks config to its `TaskSource`, used by the
runtime when a run starts, by the held-out split of training, and by the checks a command runs
before it makes a run directory (`preflight.py`). torch-free.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.tasks.base import Task, TaskSource
from harnessrl.tasks.config import (
    HumanEvalTasks,
    OpenEnvTasks,
    ProceduralTasks,
    PythonTasks,
    StdioTasks,
    TasksConfig,
)
from harnessrl.tasks.humaneval import HumanEvalSource
from harnessrl.tasks.openenv import OpenEnvSource
from harnessrl.tasks.procedural import KINDS, ProceduralSource
from harnessrl.tasks.python_source import load_python_source
from harnessrl.tasks.stdio import StdioSource


def make_task_source(cfg: TasksConfig) -> TaskSource:
    """The source `cfg.kind` names, cut to `cfg.limit` tasks when set.

    Raises:
        TaskError: a stdio task file that is missing or malformed.
        ConfigError: a python source or OpenEnv factory that fails to import, raises or
            returns no tasks (named by its config key).
    """
    match cfg:
        case ProceduralTasks():
            source: TaskSource = ProceduralSource(kinds=tuple(cfg.kinds) if cfg.kinds else tuple(KINDS),
                                                  difficulty=cfg.difficulty, seed_offset=cfg.seed_offset,
                                                  answer_via=cfg.answer_via)
        case HumanEvalTasks():
            source = HumanEvalSource()
        case StdioTasks():
            source = StdioSource(Path(cfg.path))
        case PythonTasks():
            source = load_python_source(cfg.source, dict(cfg.kwargs))
        case OpenEnvTasks():
            source = OpenEnvSource(cfg.factory, dict(cfg.kwargs), cfg.path)
    if cfg.limit is not None:
        source = LimitedSource(source, cfg.limit)
    return source


class LimitedSource:
    """The first `limit` seeds of a source, cycled: `get(seed) = inner.get(seed % limit)`."""

    def __init__(self, inner: TaskSource, limit: int) -> None:
        self._inner = inner
        self._limit = min(limit, len(inner))

    def __len__(self) -> int:
        return self._limit

    def get(self, seed: int) -> Task:
        return self._inner.get(seed % self._limit)
