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

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.errors import ConfigError
from harnessrl.harness.base import HarnessResult
from harnessrl.harness.cli_agent import (
    agent_log_path,
    agent_state_dir,
    base_env,
    read_agent_file,
    run_agent_process,
)
from harnessrl.sandbox.base import Sandbox
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
    kill_grace_s: float = Field(default=2.0, ge=0.0)
    """Seconds between SIGTERM and SIGKILL when the agent's tree is killed."""


def render_template(template: str, values: dict[str, str]) -> str:
    """Replace each `{placeholder}` of `PLACEHOLDERS` in `template` by `values[...]`, in one pass."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


class CommandHarness:
    """Runs the configured command in the sandbox workdir; see the module docstring."""

    def __init__(self, config: CommandHarnessConfig) -> None:
        self.config = config
        self.name = config.name

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        """Run the command on `task` for at most `timeout_s` wall seconds.

        Raises:
            ConfigError: a config file path lies outside the sandbox. Agent failures never raise.
        """
        state = agent_state_dir(sandbox, self.name)
        instruction_file = state / "instruction.md"
        instruction_file.write_text(task.instruction)
        values = {
            "base_url": endpoint.base_url,
            "keyed_base_url": endpoint.keyed_base_url,
            "api_key": endpoint.api_key,
            "model": endpoint.model,
            "instruction": task.instruction,
            "instruction_file": str(instruction_file),
            "workdir": str(sandbox.workdir),
            "home": str(sandbox.home),
            "state_dir": str(state),
        }
        for path_template, content_template in self.config.files.items():
            path = _inside_sandbox(sandbox, state, render_template(path_template, values))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render_template(content_template, values))
        argv = [render_template(arg, values) for arg in self.config.argv]
        env = base_env(sandbox, {k: render_template(v, values) for k, v in self.config.env.items()})
        log_path = agent_log_path(sandbox, self.name)
        run = await run_agent_process(sandbox, argv, env, log_path, timeout_s, self.config.kill_grace_s)
        error = None
        if not run.timed_out and run.exit_code != 0:
            lines = [ln for ln in run.log_tail.splitlines() if ln.strip()]
            error = f"{self.name} exited with code {run.exit_code}: {lines[-1][:500] if lines else 'no output'}"
        return HarnessResult(
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            final_answer=self._final_answer(sandbox, values),
            error=error,
            log_tail=run.log_tail,
        )

    def _final_answer(self, sandbox: Sandbox, values: dict[str, str]) -> str | None:
        if self.config.final_answer_file is None:
            return None
        path = sandbox.workdir / render_template(self.config.final_answer_file, values)
        return read_agent_file(sandbox, path)


def _inside_sandbox(sandbox: Sandbox, state: Path, rendered: str) -> Path:
    """Resolve a file path (relative -> under `state`) and require it inside home or workdir."""
    path = Path(rendered)
    path = (path if path.is_absolute() else state / path).resolve()
    for root in (sandbox.home.resolve(), sandbox.workdir.resolve()):
        if path == root or root in path.parents:
            return path
    raise ConfigError(
        f"command harness files: path {rendered!r} resolves to {path}, outside the sandbox "
        f"home {sandbox.home} and workdir {sandbox.workdir}"
    )
