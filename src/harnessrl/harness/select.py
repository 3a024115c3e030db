"""Picking a harness from config: `make_harness(kind, options)` with one `match`.

Responsibility: turn a harness kind and its option table (from the run config) into a
`Harness`, validating the options with that harness's pydantic config (`extra="forbid"`).

What this module deliberately does not do: install agents (that is `harnessrl harness
install`; a missing agent raises `HarnessInstallError` when a rollout starts).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from harnessrl.errors import ConfigError
from harnessrl.harness.base import Harness
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.harness.mini_swe_agent import MiniSweAgentConfig, MiniSweAgentHarness
from harnessrl.harness.claude_code import ClaudeCodeConfig, ClaudeCodeHarness
from harnessrl.harness.codex import CodexConfig, CodexHarness
from harnessrl.harness.opencode import OpencodeConfig, OpencodeHarness
from harnessrl.harness.pi import PiConfig, PiHarness
from harnessrl.harness.python_loop import WhiteBoxConfig, WhiteBoxHarness
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.sessions import SessionStore

HARNESS_KINDS = ("mini-swe-agent", "opencode", "command", "white_box", "pi", "codex", "claude-code")
"""Kinds `make_harness` accepts."""


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
    try:
        match kind:
            case "white_box":
                if capture is None or store is None:
                    raise ConfigError("harness.kind='white_box' needs the proxy's capture deps and session store")
                return WhiteBoxHarness(capture, store, WhiteBoxConfig.model_validate(options))
            case "mini-swe-agent" | "mini_swe_agent":
                return MiniSweAgentHarness(MiniSweAgentConfig.model_validate(options))
            case "opencode":
                return OpencodeHarness(OpencodeConfig.model_validate(options))
            case "command":
                return CommandHarness(CommandHarnessConfig.model_validate(options))
            case "pi":
                return PiHarness(PiConfig.model_validate(options))
            case "codex":
                return CodexHarness(CodexConfig.model_validate(options))
            case "claude-code" | "claude_code":
                return ClaudeCodeHarness(ClaudeCodeConfig.model_validate(options))
            case _:
                raise ConfigError(f"harness.kind={kind!r} is unknown; expected one of {', '.join(HARNESS_KINDS)}")
    except ValidationError as exc:
        problems = "; ".join(
            f"harness.options.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"harness {kind!r}: {problems}") from exc
