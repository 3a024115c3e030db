"""The task source's configuration: one typed model per `tasks.kind`, a discriminated union.

Responsibility: the `[tasks]` table validated at config load without importing any task code
(`tasks/select.make_task_source` builds the source from it). Each kind accepts only its own keys, so
e.g. `difficulty` under `kind = "stdio"` fails at load, naming the key. Keys common to every
kind: `limit`, `verifier`, `verifier_kwargs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _TasksBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int | None = Field(default=None, ge=1)
    """Use only the first N tasks (after the source's seeded order)."""
    verifier: str | None = None
    """`pkg.module:name` (or `path/to/file.py:name`) of a callable that, called with
    `verifier_kwargs`, returns a verifier (an object with `score(task, sandbox, final_answer)`,
    async or not, returning `Reward`); it scores every task. Unset: the verifier of each
    task's family (humaneval, stdio, procedural)."""
    verifier_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `verifier` (only with `verifier`: the built-in verifiers take none)."""

    @model_validator(mode="after")
    def _kwargs_need_a_verifier(self) -> _TasksBase:
        if self.verifier_kwargs and not self.verifier:
            raise ValueError("tasks.verifier_kwargs is set but tasks.verifier is not: the built-in "
                             "verifiers take no arguments (name your verifier with tasks.verifier)")
        return self


class ProceduralTasks(_TasksBase):
    """Generated tasks with exact answers (arithmetic, comparisons, strings)."""

    kind: Literal["procedural"] = "procedural"
    kinds: list[str] | None = Field(default_factory=lambda: ["repeat"])
    """Procedural task kinds (None: the generator's own set). The default, `repeat` (give a
    number back through `answer.txt`), is a family SmolLM2-135M can start to solve through
    mini-swe-agent: what it has to learn is the agent's action. With the compact prompt at
    temperature 0.4 it answered 7 of 16 held-out `repeat` tasks before any training, and
    `make train` raised the verifier's reward to 0.88; `compare` replies stayed prose (0 of
    40 solved in a mixed run), so a mix of the two trains on half its groups only. The
    `lookup` kinds (`lookup`, `lookup_count`, `lookup_json`) need a look at the workspace before
    the answer: the multi-turn family (`make train-agent`)."""
    difficulty: int = Field(default=1, ge=1)
    """Difficulty knob of the generator."""
    seed_offset: int = 0
    """Shifts the generator's seeds (a held-out set uses another offset)."""
    answer_via: Literal["file", "reply"] = "file"
    """The agent writes `answer.txt` (`file`) or replies with the answer (`reply`)."""


class HumanEvalTasks(_TasksBase):
    """The HumanEval problems (bundled), scored by their hidden tests."""

    kind: Literal["humaneval"] = "humaneval"


class StdioTasks(_TasksBase):
    """Stdin/stdout coding tasks from a JSONL file."""

    kind: Literal["stdio"] = "stdio"
    path: str
    """JSONL file of stdin/stdout tasks."""


class PythonTasks(_TasksBase):
    """Your own tasks: a callable named by a dotted path."""

    kind: Literal["python"] = "python"
    source: str
    """`pkg.module:name` (or `path/to/file.py:name`) of a callable (function or class) that,
    called with `kwargs`, returns a `TaskSource` (`__len__`, `get(seed)`) or a list of `Task`s
    (e.g. `source = "my_pkg.tasks:make_tasks"`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `source`."""


class OpenEnvTasks(_TasksBase):
    """OpenEnv sessions: one `ResourceSession` per rollout from your factory (`tasks/openenv.py`;
    needs `pip install harnessrl[openenv]` only for the factory's own imports)."""

    kind: Literal["openenv"] = "openenv"
    factory: str
    """`pkg.module:Class` (or `path/to/file.py:Class`) of a `ResourceSessionFactory`, built once
    with `kwargs`; each rollout gets `create(task, seed=group seed, episode_id=...)`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `factory`."""
    path: str | None = None
    """Optional JSONL file of task descriptions (one JSON value a line) passed to `create` as
    `task`; unset: `task=None`."""


TasksConfig = Annotated[ProceduralTasks | HumanEvalTasks | StdioTasks | PythonTasks | OpenEnvTasks,
                        Field(discriminator="kind")]
"""`[tasks]`: the source named by `kind` (default `procedural`) with its own keys."""
