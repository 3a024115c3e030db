"""Getting the agent's submission out of a finished sandbox, and staging it for verification.

Responsibility: read what the agent submitted (a file in its workdir, or, for text-only
harnesses, a fenced code block / the text of its final answer) and create the fresh directory
the verifier runs in.

Invariant (DESIGN.md §3.5, "nothing the agent wrote can change the verifier's code"): the
verify directory `.verify-<random hex>/` is created inside the workdir at verify time, after
every agent process is dead; it holds only files the verifier writes (its runner script, the
hidden tests it needs, and a *copy* of the agent's submission). Verifier programs run there
with `python3 -I` (isolated mode: no script-directory or user site-packages on sys.path, no
PYTHON* environment variables), so a `sitecustomize.py`, `conftest.py` or module shadowing
the standard library left by the agent in its workdir is never imported.

What this module deliberately does not do: run anything.
"""

from __future__ import annotations

import re
import secrets

from harnessrl.errors import SandboxError
from harnessrl.sandbox.base import Sandbox

_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def read_submission(sandbox: Sandbox, rel_path: str) -> str | None:
    """Text of `rel_path` in the sandbox's workdir; None when missing, unreadable or a link
    leaving the workdir (the agent's fault: scored as no submission)."""
    try:
        return sandbox.read_file(rel_path).decode("utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, SandboxError):
        return None


def code_from_answer(final_answer: str | None) -> str | None:
    """The last fenced code block of `final_answer` (```python ... ```), or None."""
    if not final_answer:
        return None
    blocks = _FENCED.findall(final_answer)
    return blocks[-1] if blocks else None


def new_verify_dir(sandbox: Sandbox, files: dict[str, str]) -> str:
    """Create a fresh `.verify-<hex>/` in the workdir holding `files` (name -> text);
    returns its path relative to the workdir."""
    rel_dir = f".verify-{secrets.token_hex(8)}"
    for name, text in files.items():
        sandbox.write_file(f"{rel_dir}/{name}", text)
    return rel_dir
