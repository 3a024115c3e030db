"""A generic loop-owning harness: any CLI agent described by a command template.

Responsibility: let users run their own agent program without writing a harness class. The
config gives an `argv` template, extra env, and config files to write before the start; all
are templated with these placeholders (single pass, so text substituted in is never expanded
again; unknown `{...}` text is left as is, so JSON braces need no escaping):

  `{base_url}` proxy base URL ending in `/v1`; `{keyed_base_url}` the same with the key as a
  path prefix (`/r/<key>/v1`); `{api_key}` the rollout key; `{model}` the model name;
  `{instruction}` the task text; `{instruction_file}` a file holding it; `{workdir}` the
  sandbox workdir; `{home}` the sandbox home; `{state_dir}` this agent's private directory
  (`<home>/.harnessrl/<name>`).

The endpoint reaches the agent only where the user's templates put it: in argv, in a config
file, or in env (an env entry is inherited by everything the agent spawns; prefer a file).

Invariants: config files are written only inside the sandbox (home or workdir; a relative
path is relative to `{state_dir}`), else `ConfigError`. The agent's stdout+stderr go to
`<home>/.harnessrl/<name>.log`. The process tree is killed at `timeout_s` like every CLI agent.

What this module deliberately does not do: install the program (it must exist in the
sandbox's view of the filesystem), or parse its output beyond an optional answer file.
"""

from __future__ import annotations

import posixpath
import re

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.errors import ConfigError
from harnessrl.harness.cli_agent import (
    AgentFile,
    AgentOutcome,
    AgentPaths,
    AgentSpec,
    CliAgentHarness,
    no_answer,
)
from harnessrl.sandbox.base import Base
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

PLACEHOLDERS = (
    "base_url", "keyed_base_url", "api_key", "model", "instruction",
    "instruction_file", "workdir", "home", "state_dir",
)  # fmt: skip
_PLACEHOLDER_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


class CommandHarnessConfig(BaseModel):
    """Options of the generic command harness."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    argv: list[str] = Field(min_length=1)
    """Command template, e.g. `["python3", "agent.py", "--base-url", "{base_url}", "{instruction}"]`."""
    name: str = Field(default="command", pattern=r"^[A-Za-z0-9_.-]+$")
    """Harness name recorded on rollouts; also names the log file and the state directory."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment entries (templated), applied over the sandbox's base environment."""
    files: dict[str, str] = Field(default_factory=dict)
    """Config files to write before the start: path template -> content template."""
    final_answer_file: str | None = None
    """File (path template, relative to the workdir) whose text is the agent's final answer."""


def render_template(template: str, values: dict[str, str]) -> str:
    """Replace each `{placeholder}` of `PLACEHOLDERS` in `template` by `values[...]`, in one pass."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


class CommandHarness(CliAgentHarness):
    """Runs the configured command in the sandbox workdir; see the module docstring."""

    def __init__(self, config: CommandHarnessConfig) -> None:
        self.config = config
        self.name = config.name

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        """The rendered argv, env and files; the answer is `final_answer_file`'s text exactly
        (None when missing, or unsafe: a link is not followed).

        Raises:
            ConfigError: a config file path lies outside the sandbox home and workdir.
        """
        values = {
            "base_url": endpoint.base_url,
            "keyed_base_url": endpoint.keyed_base_url,
            "api_key": endpoint.api_key,
            "model": endpoint.model,
            "instruction": task.instruction,
            "instruction_file": paths.state("instruction.md"),
            "workdir": paths.workdir,
            "home": paths.home,
            "state_dir": paths.state(),
        }
        files = [AgentFile(f"{paths.state_rel}/instruction.md", task.instruction)]
        for path_template, content_template in self.config.files.items():
            base, rel = _inside_sandbox(paths, render_template(path_template, values))
            files.append(AgentFile(rel, render_template(content_template, values), base=base))
        answer = self.config.final_answer_file
        return AgentSpec(
            argv=[render_template(arg, values) for arg in self.config.argv],
            env={k: render_template(v, values) for k, v in self.config.env.items()},
            files=tuple(files),
            output=("work", render_template(answer, values)) if answer is not None else None,
            interpret=_file_answer if answer is not None else no_answer,
        )


def _file_answer(output: str | None, log_tail: str) -> AgentOutcome:
    return AgentOutcome(final_answer=output)


def _inside_sandbox(paths: AgentPaths, rendered: str) -> tuple[Base, str]:
    """A rendered file path (relative: under the state dir) as `(base, path relative to it)`;
    ConfigError unless it lies inside home or the workdir (as the agent sees them)."""
    path = posixpath.normpath(posixpath.join(paths.state(), rendered))
    for base, root in (("home", paths.home), ("work", paths.workdir)):
        if path.startswith(root + "/"):
            return base, path[len(root) + 1:]  # type: ignore[return-value]
    raise ConfigError(
        f"command harness files: path {rendered!r} resolves to {path}, outside the sandbox "
        f"home {paths.home} and workdir {paths.workdir}"
    )
