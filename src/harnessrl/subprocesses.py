"""Set-up commands run to completion: what the agent and engine installers share.

Responsibility: run one installer step (`python3 -m venv`, `pip install`, `npm install`, a
version check) with a timeout, its output captured, and turn every way it can fail into one
`HarnessInstallError` naming the step; find the system `python3` a venv is built from.

What it does not do: run anything an agent or a sandbox runs (`sandbox/`), or decide what to
install (`harness/install.py`, `engine/vllm/install.py`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from harnessrl.errors import HarnessInstallError


def system_python() -> str:
    """The system `python3` (`/usr/bin/python3` first: it lies under `/usr`, which sandboxes
    bind read-only; an interpreter elsewhere would have to be bound too).

    Raises:
        HarnessInstallError: no python3 at /usr/bin or on PATH.
    """
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate is not None and Path(candidate).is_file():
            return candidate
    raise HarnessInstallError("no system python3 found (/usr/bin/python3 or on PATH) to create the venv")


def run_step(argv: list[str], timeout_s: float, what: str) -> str:
    """Run `argv` (stdin closed) to completion within `timeout_s` seconds; returns its stdout
    followed by its stderr.

    Raises:
        HarnessInstallError: the executable is missing, it ran past the timeout, or it exited
            non-zero (the message names `what` and holds the last 2,000 characters of output).
    """
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
        )
    except FileNotFoundError as exc:
        raise HarnessInstallError(f"{what}: executable {argv[0]!r} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise HarnessInstallError(f"{what}: did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise HarnessInstallError(f"{what}: exit code {proc.returncode}\n{tail}")
    return proc.stdout + proc.stderr
