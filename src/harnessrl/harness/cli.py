"""`harnessrl harness install NAME`: install an agent program into the per-machine cache.

Responsibility: the command-line face of `install.install_agent`: print what happens and
where the agent is, exit 1 with the reason when installing fails.

Invariant: imports neither torch nor the engine (the CLI must stay fast); a second run of an
installed agent is a fast no-op that prints where it is.
"""

from __future__ import annotations

import typer

from harnessrl.errors import HarnessInstallError
from harnessrl.harness.install import install_agent


def install(name: str) -> None:
    """Install agent `name` (`mini-swe-agent`, `opencode`) at its pinned version.

    Raises:
        typer.Exit: code 1 when the agent is unknown or its install failed (message on stderr).
    """
    try:
        outcome = install_agent(name, log=lambda line: typer.echo(line, err=True))
    except HarnessInstallError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    record = outcome.record
    state = "already installed" if outcome.already_installed else f"installed in {outcome.duration_s:.0f} s"
    typer.echo(f"{record.name} {record.version} {state}: {record.executable}")
