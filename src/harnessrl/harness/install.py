"""Installing agent programs once per machine, outside every sandbox and the project's own env.

Responsibility: put each known agent program (mini-swe-agent from PyPI, opencode from npm) at
a pinned version into its own directory under `$HARNESSRL_CACHE/agents/<name>` and tell
harnesses where its executable is.

* `mini-swe-agent`: a venv made with the system `python3 -m venv`, then
  `pip install mini-swe-agent==<pin>` into it (about 750 MB).
* `opencode`: `npm install --prefix <dir> opencode-ai@<pin>` (about 355 MB).
* `pi`, `codex`, `claude-code`, `gemini-cli`: the same npm form with `@mariozechner/pi-coding-agent`
  (about 205 MB), `@openai/codex` (about 425 MB), `@anthropic-ai/claude-code`.

Invariants:
  * An install is complete only when its record file (`installed.json`) exists; the record is
    written last, after the executable answered `--version`. A half-finished install is
    therefore never used and the next `install_agent` call repairs it in place.
  * `install_agent` is idempotent: with a complete install of the pinned version it returns at
    once without running pip or npm.
  * Concurrent installers of one agent serialise on a lock file next to its directory.

What this module deliberately does not do: run agents, choose a sandbox, or fall back to an
agent found on `PATH`. Pins are versions measured to work headless and offline (see the
design notes on harness clients); change them only after re-measuring.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from harnessrl.engine.model_store import cache_dir
from harnessrl.errors import HarnessInstallError
from harnessrl.subprocesses import run_step, system_python

_RECORD_NAME = "installed.json"
_INSTALL_TIMEOUT_S = 1800.0
_VERSION_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """How one agent program is installed and where its executable lands."""

    name: str
    """Name users type: `harnessrl harness install <name>`."""
    manager: Literal["pip", "npm"]
    package: str
    """Registry package name (PyPI or npm)."""
    version: str
    """Pinned version, measured to work headless and offline."""
    executable: str
    """Executable path relative to the agent's install directory."""


AGENTS: dict[str, AgentSpec] = {
    "mini-swe-agent": AgentSpec(
        name="mini-swe-agent",
        manager="pip",
        package="mini-swe-agent",
        version="2.4.6",
        executable="venv/bin/mini",
    ),
    "opencode": AgentSpec(
        name="opencode",
        manager="npm",
        package="opencode-ai",
        version="1.18.33",
        executable="node_modules/.bin/opencode",
    ),
    "pi": AgentSpec(
        name="pi",
        manager="npm",
        package="@mariozechner/pi-coding-agent",
        version="0.73.1",
        executable="node_modules/.bin/pi",
    ),
    "codex": AgentSpec(
        name="codex",
        manager="npm",
        package="@openai/codex",
        version="0.171.0",
        executable="node_modules/.bin/codex",
    ),
    "claude-code": AgentSpec(
        name="claude-code",
        manager="npm",
        package="@anthropic-ai/claude-code",
        version="2.1.332",
        executable="node_modules/.bin/claude",
    ),
    "gemini-cli": AgentSpec(
        name="gemini-cli",
        manager="npm",
        package="@google/gemini-cli",
        version="0.61.0",
        executable="node_modules/.bin/gemini",
    ),
}


class InstallRecord(BaseModel):
    """What `installed.json` holds (written last, so its presence means a complete install)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    package: str
    version: str
    executable: str
    """Absolute path of the executable."""
    installed_at: float
    """Unix time (s) the install completed."""


@dataclass(frozen=True, slots=True)
class InstallOutcome:
    """What `install_agent` did."""

    record: InstallRecord
    already_installed: bool
    """True when the pinned version was already there and nothing ran."""
    duration_s: float


def agent_spec(name: str) -> AgentSpec:
    """The spec of agent `name`. Raises `HarnessInstallError` naming the known agents."""
    try:
        return AGENTS[name]
    except KeyError:
        known = ", ".join(sorted(AGENTS))
        raise HarnessInstallError(f"unknown agent {name!r}; installable agents: {known}") from None


def agent_dir(name: str) -> Path:
    """Install directory of agent `name`: `$HARNESSRL_CACHE/agents/<name>`."""
    return cache_dir() / "agents" / agent_spec(name).name


def install_command_hint(name: str) -> str:
    """The exact command a user runs to install agent `name`."""
    return f"harnessrl harness install {name}"


def read_install_record(name: str) -> InstallRecord | None:
    """The record of a complete install of the pinned version, or None."""
    spec = agent_spec(name)
    path = agent_dir(name) / _RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = InstallRecord.model_validate_json(path.read_text())
    except ValueError:
        return None
    if record.version != spec.version or not Path(record.executable).is_file():
        return None
    return record


def agent_executable(name: str) -> Path:
    """Absolute path of the installed executable of agent `name`.

    Raises:
        HarnessInstallError: the pinned version is not installed; the message gives the exact
            `harnessrl harness install <name>` command.
    """
    record = read_install_record(name)
    if record is None:
        spec = agent_spec(name)
        raise HarnessInstallError(
            f"agent {name!r} ({spec.package}=={spec.version}) is not installed under "
            f"{agent_dir(name)}; run: {install_command_hint(name)}"
        )
    return Path(record.executable)


def installed_agent_dirs() -> tuple[Path, ...]:
    """Install directories of every completely installed agent: what a sandbox that hides
    the host filesystem (bubblewrap) must bind read-only for the agents to run."""
    return tuple(agent_dir(name) for name in sorted(AGENTS) if read_install_record(name) is not None)


def install_agent(name: str, log: Callable[[str], None] = print) -> InstallOutcome:
    """Install agent `name` at its pinned version unless it already is (then a fast no-op).

    Args:
        name: a key of `AGENTS`.
        log: receives one line per step (the CLI prints them).

    Raises:
        HarnessInstallError: unknown agent, missing `python3`/`npm`, or a failed install
            step (the message carries the tail of its output).
    """
    spec = agent_spec(name)
    start = time.monotonic()
    target = agent_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_install_record(name)
        if record is not None:
            return InstallOutcome(record, already_installed=True, duration_s=time.monotonic() - start)
        target.mkdir(parents=True, exist_ok=True)
        log(f"installing {spec.package}=={spec.version} into {target} (several minutes)")
        match spec.manager:
            case "pip":
                _install_pip(spec, target, log)
            case "npm":
                _install_npm(spec, target)
        executable = target / spec.executable
        found = _installed_version(spec, target)
        if found != spec.version:
            raise HarnessInstallError(f"{name}: installed version is {found!r}, expected {spec.version!r}")
        log(f"{name} {found} ready at {executable}")
        record = InstallRecord(
            name=spec.name,
            package=spec.package,
            version=spec.version,
            executable=str(executable),
            installed_at=time.time(),
        )
        (target / _RECORD_NAME).write_text(record.model_dump_json(indent=2))
    return InstallOutcome(record, already_installed=False, duration_s=time.monotonic() - start)


def _install_pip(spec: AgentSpec, target: Path, log: Callable[[str], None]) -> None:
    venv = target / "venv"
    if not (venv / "bin" / "python").exists():
        python = system_python()
        log(f"creating venv with {python} -m venv {venv}")
        run_step([python, "-m", "venv", str(venv)], _INSTALL_TIMEOUT_S, "python3 -m venv")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    run_step([*pip, f"{spec.package}=={spec.version}"], _INSTALL_TIMEOUT_S, f"pip install {spec.package}")


def _install_npm(spec: AgentSpec, target: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise HarnessInstallError(f"agent {spec.name!r} needs npm (Node.js) on PATH; none found")
    argv = [npm, "install", "--prefix", str(target), "--no-audit", "--no-fund", "--no-save"]
    run_step([*argv, f"{spec.package}@{spec.version}"], _INSTALL_TIMEOUT_S, f"npm install {spec.package}")


def _installed_version(spec: AgentSpec, target: Path) -> str:
    """The version the installed program reports (pip: package metadata; npm: `--version`)."""
    match spec.manager:
        case "pip":
            code = f"import importlib.metadata as m; print(m.version({spec.package!r}))"
            argv = [str(target / "venv" / "bin" / "python"), "-c", code]
        case "npm":
            argv = [str(target / spec.executable), "--version"]
    out = run_step(argv, _VERSION_TIMEOUT_S, f"{spec.name} version check").strip()
    last = out.splitlines()[-1].strip() if out else ""
    # npm CLIs decorate it (`codex-cli 0.171.0`, `2.1.332 (Claude Code)`): keep the version token.
    found = re.search(r"\d+\.\d+\.\d+\S*", last)
    return found.group(0) if found else last
