"""The one runner of loop-owning CLI agents: what every CLI harness shares.

Responsibility: given an `AgentSpec` (what is specific to one agent: its config files, argv,
env, where its final answer is and how to read its output), run it in a sandbox:
  1. write its files through the seam (`Sandbox.write_file`, mode 0600: they hold the key);
  2. spawn it (`Sandbox.spawn`) in the work dir, stdout+stderr to its log, with an
     environment built from scratch (`base_env`);
  3. wait at most `timeout_s`, then kill its whole tree (`SandboxProcess.kill_tree`: SIGTERM,
     the sandbox's `kill_grace_s`, SIGKILL) whether it exited, timed out or the awaiting task
     was cancelled;
  4. read back its log tail and its output file through the seam (no link followed, bounded),
     let the spec interpret them, and map the outcome to a `HarnessResult`.

Where an agent's private files go: `<home>/.harnessrl/<agent>/` for its config and state,
`<home>/.harnessrl/<agent>.log` for its output; both outside the work dir the verifier scores.
Paths the agent is told about come from `AgentPaths` (`Sandbox.agent_path`), never from host
paths, so the runner works on any sandbox backend.

Invariants:
  * When `run_cli_agent` returns or raises, no process of the agent's tree is alive (or
    `SandboxError` was raised because one survived SIGKILL).
  * The harness never touches host pids or host paths.
  * Agent output that goes into a message the run logs (`HarnessResult.error`, which becomes
    the rollout's error and its line in `run.log`; the warning about an unsafe file) has its
    control characters written as escapes (`printable`): an agent cannot clear the terminal
    of whoever reads the log, move its cursor or rewrite earlier lines. The log tail itself
    is kept as read (`HarnessResult.log_tail`, JSON in `rollouts.jsonl`).

What this module deliberately does not do: know any agent's output format (the spec's
`interpret` does), or remove files (the sandbox owns its directory).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from harnessrl.errors import SandboxError
from harnessrl.harness.base import HarnessResult
from harnessrl.harness.install import agent_dir, agent_executable, agent_spec
from harnessrl.sandbox.base import Base, Sandbox, tree_path
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

log = logging.getLogger(__name__)

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab and newline, DEL, and the C1 controls (U+0080-U+009F: 8-bit CSI, ...)."""


def printable(text: str) -> str:
    """`text` with every control character but newline and tab written as its `\\xNN` escape
    (ESC -> `\\x1b`, CR -> `\\x0d`, CSI U+009B -> `\\x9b`): what a terminal would act on is
    shown, and no character is lost (each escape names its code point)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH for agents: system directories only (not the project's venv)."""
LOG_TAIL_BYTES = 4000
"""How much of the end of an agent's log goes into `HarnessResult.log_tail`."""
AGENT_FILE_BYTES = 8 << 20
"""Default bound of an agent's output file read back (log, answer, trajectory), bytes."""
STATE_DIR = ".harnessrl"
"""Directory under the sandbox home holding every agent's state dir and log."""


@dataclass(frozen=True, slots=True)
class AgentPaths:
    """Where one agent's files are: relative to the sandbox home (for the seam's file API) and
    as the agent sees them (`Sandbox.agent_path`)."""

    sandbox: Sandbox
    agent: str

    @property
    def state_rel(self) -> str:
        """`.harnessrl/<agent>`, relative to home."""
        return f"{STATE_DIR}/{self.agent}"

    @property
    def log_rel(self) -> str:
        """`.harnessrl/<agent>.log`, relative to home."""
        return f"{STATE_DIR}/{self.agent}.log"

    def state(self, rel_path: str = "") -> str:
        """Path of `rel_path` under the agent's state dir as the agent sees it."""
        return self.sandbox.agent_path("home", f"{self.state_rel}/{rel_path}" if rel_path else self.state_rel)

    @property
    def home(self) -> str:
        return self.sandbox.agent_path("home")

    @property
    def workdir(self) -> str:
        return self.sandbox.agent_path("work")


@dataclass(frozen=True, slots=True)
class AgentFile:
    """A file written into the sandbox before the agent starts."""

    rel_path: str
    """Relative to `base`."""
    content: str
    base: Base = "home"
    mode: int = 0o600


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """What an agent's own output says about its run."""

    final_answer: str | None = None
    error_detail: str | None = None
    """Why it failed, in its own words (used when it exited non-zero or `failed`); None: the
    last non-empty line of its log."""
    failed: bool = False
    """It reports failure although it exited 0 (Claude Code's `is_error`)."""


def no_answer(output: str | None, log_tail: str) -> AgentOutcome:
    """The default `interpret`: no final answer, errors described by the log's last line."""
    return AgentOutcome()


def stripped_answer(output: str | None, log_tail: str) -> AgentOutcome:
    """The output file's text, stripped, as the final answer (None when missing or blank)."""
    return AgentOutcome(final_answer=(output.strip() or None) if output is not None else None)


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """What is specific to one CLI agent; `run_cli_agent` does the rest."""

    argv: list[str]
    """The command, `argv[0]` an absolute executable path as the sandbox sees it."""
    env: dict[str, str] = field(default_factory=dict)
    """Entries applied over `base_env` (never the key: it goes into a file)."""
    files: tuple[AgentFile, ...] = ()
    output: tuple[Base, str] | None = None
    """The file its result is read from (`(base, rel_path)`); None: its own log."""
    output_bytes: int = AGENT_FILE_BYTES
    """Most bytes of the output file read (the last ones when `output` is None, the log)."""
    interpret: Callable[[str | None, str], AgentOutcome] = no_answer
    """(output text or None when missing/unsafe, log tail) -> outcome."""
    label: str = ""
    """Name in error messages ("<label> exited with code N: ..."); empty: the harness name."""


def base_env(paths: AgentPaths, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment built from scratch for an agent: HOME and XDG dirs inside the sandbox home
    (as the agent sees it), system PATH, UTF-8 locale, no colours; `extra` is applied last.
    (The sandbox adds its own entries such as TMPDIR and its markers.)"""
    home = paths.home
    env = {
        "HOME": home,
        "PATH": DEFAULT_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
    }
    env.update(extra or {})
    return env


def read_text(sandbox: Sandbox, base: Base, rel_path: str, max_bytes: int = AGENT_FILE_BYTES,
              *, tail: bool = False) -> str | None:
    """Text (UTF-8, replacement) of a file the agent could have touched, via `Sandbox.read_file`
    (bounded, no link followed); None when missing, or unsafe (a symlink or special file,
    logged as a warning)."""
    try:
        data = sandbox.read_file(rel_path, base=base, max_bytes=max_bytes, tail=tail)
    except FileNotFoundError:
        return None
    except SandboxError as e:
        log.warning("agent file not read: %s", printable(str(e)))
        return None
    return data.decode("utf-8", errors="replace")


def read_log_tail(sandbox: Sandbox, paths: AgentPaths, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `max_bytes` of the agent's log: "" when missing, a one-line note when it is a
    symlink or not a regular file (never followed)."""
    try:
        data = sandbox.read_file(paths.log_rel, base="home", max_bytes=max_bytes, tail=True)
    except FileNotFoundError:
        return ""
    except SandboxError as e:
        return f"[harnessrl: agent log not read: {printable(str(e))}]"
    return data.decode("utf-8", errors="replace")


def collect_result(sandbox: Sandbox, spec: AgentSpec, paths: AgentPaths, exit_code: int | None,
                   timed_out: bool, label: str) -> HarnessResult:
    """Read back the agent's log tail and output through the seam, let `spec.interpret` read
    them, and map to a `HarnessResult` (`error` set when it exited non-zero, not at a timeout,
    or when it reports failure)."""
    log_tail = read_log_tail(sandbox, paths)
    if spec.output is None:
        output = read_text(sandbox, "home", paths.log_rel, spec.output_bytes, tail=True)
    else:
        output = read_text(sandbox, spec.output[0], spec.output[1], spec.output_bytes)
    outcome = spec.interpret(output, log_tail)
    error = None
    if not timed_out and (exit_code != 0 or outcome.failed):
        detail = outcome.error_detail
        if detail is None:
            lines = [ln for ln in log_tail.splitlines() if ln.strip()]
            detail = lines[-1] if lines else "no output"
        error = f"{spec.label or label} exited with code {exit_code}: {printable(detail[:500])}"
    return HarnessResult(exit_code=None if timed_out else exit_code, timed_out=timed_out,
                         final_answer=outcome.final_answer, error=error, log_tail=log_tail)


async def run_cli_agent(sandbox: Sandbox, spec: AgentSpec, paths: AgentPaths, timeout_s: float,
                        label: str) -> HarnessResult:
    """Write `spec.files`, spawn `spec.argv`, wait at most `timeout_s` wall seconds, kill the
    tree, collect the result (see the module docstring).

    Raises:
        SandboxError: the sandbox cannot write a file or start the process, or a process of
            the agent's tree survived SIGKILL. The agent's own failures never raise.
    """
    for f in spec.files:
        sandbox.write_file(f.rel_path, f.content, base=f.base, mode=f.mode)
    started = time.monotonic()
    proc = await sandbox.spawn(spec.argv, env=base_env(paths, spec.env), log_file=paths.log_rel)
    try:
        exit_code = await proc.wait(timeout_s)
    finally:
        killed = await proc.kill_tree()
    log.debug("%s: exit %s after %.1f s, %d processes killed", label, exit_code, time.monotonic() - started, killed)
    return collect_result(sandbox, spec, paths, exit_code, exit_code is None, label)


class CliAgentHarness:
    """A `Harness` made of one `AgentSpec`: subclasses set `name`, optionally `install_name`
    (checked with `agent_executable` before anything is written) and implement `spec`."""

    name: str
    install_name: str | None = None

    def spec(self, task: Task, endpoint: Endpoint, paths: AgentPaths) -> AgentSpec:
        raise NotImplementedError

    def executable(self) -> str:
        """The installed agent's executable (`install_name`): its host path (`command` gives
        the command as the sandbox sees it).

        Raises:
            HarnessInstallError: the agent is not installed (the message gives the command).
        """
        assert self.install_name is not None, "only for installed agents"
        return str(agent_executable(self.install_name))

    def command(self, paths: AgentPaths) -> list[str]:
        """The agent's command as the sandbox sees it: `executable()` where the sandbox mounts
        its install tree (`sandbox.base.tree_path`: not the host path under bubblewrap or
        podman). An entry script of a pip agent's venv is run by the venv's own interpreter,
        named beside it: the script's shebang names the venv's host path.

        Raises:
            HarnessInstallError: the agent is not installed (the message gives the command).
        """
        assert self.install_name is not None, "only for installed agents"
        host = Path(self.executable())
        executable = tree_path(paths.sandbox, host)
        if agent_spec(self.install_name).manager == "pip" and host.is_relative_to(agent_dir(self.install_name)):
            return [f"{PurePosixPath(executable).parent}/python", executable]
        return [executable]

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        """Run the agent on `task` for at most `timeout_s` wall seconds; its tree is dead when
        this returns. `endpoint` is the one the sandbox gives agents (`Sandbox.agent_endpoint`).

        Raises:
            HarnessInstallError: the agent is not installed. ConfigError: invalid options.
            SandboxError: see `run_cli_agent`. Agent failures never raise.
        """
        paths = AgentPaths(sandbox, self.name)
        spec = self.spec(task, endpoint, paths)
        return await run_cli_agent(sandbox, spec, paths, timeout_s, self.name)
