"""Picking a harness from config: `make_harness(kind, options)` with one `match`.

Responsibility: turn a harness kind and its option table (from the run config) into a
`Harness`, validating the options with that harness's pydantic config (`extra="forbid"`,
through `options.validate_options`, which the run config also uses at load time).

What this module deliberately does not do: install agents (that is `harnessrl harness
install`; a missing agent raises `HarnessInstallError` when a rollout starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harnessrl.errors import ConfigError
from harnessrl.harness.base import Harness
from harnessrl.harness.claude_code import ClaudeCodeHarness
from harnessrl.harness.codex import CodexHarness
from harnessrl.harness.command import CommandHarness
from harnessrl.harness.gemini_cli import GeminiCliHarness
from harnessrl.harness.mini_swe_agent import MiniSweAgentHarness
from harnessrl.harness.opencode import OpencodeHarness
from harnessrl.harness.options import HARNESS_KINDS, canonical_kind, validate_options
from harnessrl.harness.pi import PiHarness
from harnessrl.harness.python_loop import WhiteBoxHarness
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.sessions import SessionStore

__all__ = ["HARNESS_KINDS", "make_harness"]


_CLI_HARNESSES: dict[str, Callable[[Any], Harness]] = {
    "mini-swe-agent": MiniSweAgentHarness,
    "opencode": OpencodeHarness,
    "command": CommandHarness,
    "pi": PiHarness,
    "codex": CodexHarness,
    "claude-code": ClaudeCodeHarness,
    "gemini-cli": GeminiCliHarness,
}
"""The harnesses built from their validated options alone (every kind but white_box)."""


def make_harness(
    kind: str,
    options: dict[str, Any],
    *,
    capture: CaptureDeps | None = None,
    store: SessionStore | None = None,
) -> Harness:
    """Build the harness `kind` with `options` (the fields of its config model).

    Args:
        capture, store: the proxy's capture dependencies and session store; required by the
            white-box loop, which samples through them without HTTP.

    Raises:
        ConfigError: unknown kind, or options that fail validation (the message names the key).
    """
    kind = canonical_kind(kind)
    config = validate_options(kind, options)
    match kind:
        case "white_box":
            if capture is None or store is None:
                raise ConfigError("harness.kind='white_box' needs the proxy's capture deps and session store")
            return WhiteBoxHarness(capture, store, config)  # type: ignore[arg-type]
        case _ if kind in _CLI_HARNESSES:
            return _CLI_HARNESSES[kind](config)
    raise ConfigError(f"harness.kind={kind!r} has no harness class")  # unreachable: canonical_kind checked it
