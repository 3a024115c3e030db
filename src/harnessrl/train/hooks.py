"""User hooks: load them by dotted path, and the outcome record `rollout_reward_fn` receives.

Responsibility: turn a config string such as `"my_pkg.filters:has_tool_call"` (or
`"my_pkg.filters.has_tool_call"`) into a callable, and build `RolloutOutcome` from a finished
rollout. The three hooks apply identically to both harness kinds, because both produce the
same `Trace` (DESIGN.md §5):
  * `agent_turn_fn(turns: list[Turn]) -> list[Turn]`: which eligible turns are the agent's own
    (replaces the structural rule of `samples.py`);
  * `train_turn_fn(turn: Turn) -> bool`: False keeps the turn as context only (mask 0);
  * `rollout_reward_fn(outcome: RolloutOutcome) -> float | None`: the reward used for
    advantages (None: unscored, excluded from the baseline).

What this module does not do: call the hooks inside the samples builder or trainer (they do),
or sandbox user code (hooks run in the trainer process and are trusted).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harnessrl.errors import ConfigError
from harnessrl.types import Rollout, Turn


def load_hook(dotted: str) -> Callable[..., Any]:
    """Import the callable named by `dotted` (`"pkg.mod:attr"` or `"pkg.mod.attr"`).

    Raises:
        ConfigError: the module cannot be imported, has no such attribute, or the attribute is
            not callable; the message names `dotted`.
    """
    if ":" in dotted:
        module_name, _, attr = dotted.partition(":")
    else:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"hook path {dotted!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"hook {dotted!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"hook {dotted!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"hook {dotted!r} is a {type(obj).__name__}, not a callable")
    return obj


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    """What `rollout_reward_fn` sees of one finished rollout."""

    rollout: Rollout
    """The whole record: trace, status, verifier reward and its parts."""
    reward: float | None
    """The verifier's reward (`rollout.reward`); None when unscored."""
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    """Tool calls the model emitted in `ok` turns, by function name, from recorded responses."""
    num_turns: int = 0
    """Recorded turns with `status="ok"`."""
    timed_out: bool = False
    """Whether the rollout ended at its time limit (`status="timeout"`)."""


def tool_call_names(turn: Turn) -> list[str]:
    """Function names of the tool calls in `turn.response` (OpenAI chat shape), in order.

    Tolerates the shapes recorded for failures: no response, empty `choices`, a `None`
    message, `tool_calls: None` or `[]`, a call without a function name (skipped).
    """
    response = turn.response or {}
    names: list[str] = []
    for choice in response.get("choices") or []:
        message = (choice or {}).get("message") or {}
        for call in message.get("tool_calls") or []:
            name = ((call or {}).get("function") or {}).get("name")
            if isinstance(name, str) and name:
                names.append(name)
    return names


def outcome_of(rollout: Rollout) -> RolloutOutcome:
    """Build the `RolloutOutcome` of a finished rollout."""
    ok_turns = [t for t in rollout.trace.turns if t.status == "ok"]
    counts: Counter[str] = Counter()
    for turn in ok_turns:
        counts.update(tool_call_names(turn))
    return RolloutOutcome(
        rollout=rollout,
        reward=rollout.reward,
        tool_calls_by_name=dict(counts),
        num_turns=len(ok_turns),
        timed_out=rollout.status == "timeout",
    )


def has_tool_call(turn: Turn) -> bool:
    """A ready-made `train_turn_fn`: train only turns whose response calls a tool."""
    return bool(tool_call_names(turn))
