"""`harnessrl harness install NAME` and `harnessrl harness options NAME`.

Responsibility: the command-line face of `install.install_agent` (print what happens and
where the agent is, exit 1 with the reason when installing fails) and of
`options.describe_options` (every option of a harness with its type, default and description,
and what the harness needs from the engine and sampling).

Invariant: imports neither torch nor the engine (the CLI must stay fast); a second run of an
installed agent is a fast no-op that prints where it is.
"""

from __future__ import annotations

import typer

from harnessrl.errors import ConfigError, HarnessInstallError
from harnessrl.harness.install import install_agent
from harnessrl.harness.options import describe_options


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


def options(name: str) -> None:
    """Print harness `name`'s options and needs.

    Raises:
        typer.Exit: code 1 when the harness is unknown (the known ones are listed on stderr).
    """
    try:
        text = describe_options(name)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(text)
