"""User hooks: load them by dotted path, and the outcome record `rollout_reward_fn` receives.

Responsibility: turn a config string such as `"my_pkg.filters:has_tool_call"` (or
`"my_pkg.filters.has_tool_call"`, or `"path/to/file.py:has_tool_call"`) into a callable (also
used for the config's other dotted paths: `tasks.source`, `tasks.verifier`), and build `RolloutOutcome` from a finished
rollout. The three hooks apply identically to both harness kinds and every protocol, because
all produce the same protocol-neutral `Trace` (`Turn.request`, `Turn.reply`; DESIGN.md §4, §5):
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
import importlib.util
import logging
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harnessrl.errors import ConfigError
from harnessrl.types import Group, Rollout, Turn

log = logging.getLogger(__name__)


def load_hook(dotted: str, what: str = "hook") -> Callable[..., Any]:
    """Import the callable named by `dotted`: `"pkg.mod:attr"`, `"pkg.mod.attr"`, or
    `"path/to/file.py:attr"` (a file path, relative to the working directory).

    Args:
        what: the config key it came from (`hooks.rollout_reward_fn`, `tasks.source`, ...),
            named in the error.

    Raises:
        ConfigError: the module cannot be imported, has no such attribute, or the attribute is
            not callable; the message names `what` and `dotted`.
    """
    if ":" in dotted:
        module_name, _, attr = dotted.partition(":")
    else:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} = {dotted!r} must look like 'package.module:function'")
    if module_name.endswith(".py"):
        module = _import_file(module_name, dotted, what)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"{what} = {dotted!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} = {dotted!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} = {dotted!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_file(path: str, dotted: str, what: str) -> Any:
    """Import a Python file as a module (cached in `sys.modules` under its resolved path)."""
    file = Path(path).resolve()
    name = f"harnessrl_user_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    if not file.is_file():
        raise ConfigError(f"{what} = {dotted!r}: no file {path!r} (relative to {Path.cwd()})")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what} = {dotted!r}: {path!r} cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code: report it as a config error
        del sys.modules[name]
        raise ConfigError(f"{what} = {dotted!r}: importing {path!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    """What `rollout_reward_fn` sees of one finished rollout."""

    rollout: Rollout
    """The whole record: trace, status, verifier reward and its parts."""
    reward: float | None
    """The verifier's reward (`rollout.reward`); None when unscored."""
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    """Tool calls the model emitted in `ok` turns, by function name, from the recorded replies."""
    num_turns: int = 0
    """Recorded turns with `status="ok"`."""
    timed_out: bool = False
    """Whether the rollout ended at its time limit (`status="timeout"`)."""


def tool_call_names(turn: Turn) -> list[str]:
    """Function names of the tool calls in `turn.reply` (the neutral parsed reply, the same for
    every protocol), in order; [] when the turn has no reply. Calls without a name are skipped."""
    if turn.reply is None:
        return []
    return [call.name for call in turn.reply.tool_calls if call.name]


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
    """A ready-made `train_turn_fn`: train only turns whose reply calls a tool (any protocol)."""
    return bool(tool_call_names(turn))


@dataclass(frozen=True, slots=True)
class Hooks:
    """The user hooks of a run, imported (`[hooks]`; module docstring); None where unset."""

    agent_turn_fn: Callable[[list[Turn]], list[Turn]] | None = None
    train_turn_fn: Callable[[Turn], bool] | None = None
    rollout_reward_fn: Callable[[RolloutOutcome], float | None] | None = None


class HooksSettings(Protocol):
    """The dotted paths of the hooks (`config.HooksConfig`)."""

    @property
    def agent_turn_fn(self) -> str | None: ...
    @property
    def train_turn_fn(self) -> str | None: ...
    @property
    def rollout_reward_fn(self) -> str | None: ...


def load_hooks(hooks_cfg: HooksSettings) -> Hooks:
    """The hooks a `HooksConfig` names, imported (an empty string or None leaves one unset).

    Raises:
        ConfigError: a path that does not import or is not callable (named with its key).
    """
    def one(name: str, dotted: str | None) -> Callable[..., Any] | None:
        return load_hook(dotted, what=f"hooks.{name}") if dotted else None

    return Hooks(agent_turn_fn=one("agent_turn_fn", hooks_cfg.agent_turn_fn),
                 train_turn_fn=one("train_turn_fn", hooks_cfg.train_turn_fn),
                 rollout_reward_fn=one("rollout_reward_fn", hooks_cfg.rollout_reward_fn))


def reshape_reward(rollout: Rollout, reward_fn: Callable[..., Any] | None) -> Rollout:
    """`rollout` with `train_reward = reward_fn(outcome_of(rollout))` (unchanged when `reward_fn`
    is None); the verifier's `reward` is kept as it is. A value that is not finite (`nan`,
    `inf`) makes the rollout unscored (`train_reward` None, excluded from the baseline), with
    the value named in `metadata["reward_hook_error"]` (and `error` when it had none) and a
    warning: one rollout's verdict never ends the run. `harnessrl train` and `harnessrl rollout`
    both use it, so one config means the same training reward in both."""
    if reward_fn is None:
        return rollout
    value = reward_fn(outcome_of(rollout))
    if isinstance(value, (int, float)) and not math.isfinite(value):  # no advantage can use it
        error = f"rollout_reward_fn returned {value!r}, which is not finite: the rollout is unscored"
        log.warning("rollout %s: %s", rollout.rollout_id, error)
        return rollout.model_copy(update={"train_reward": None, "error": rollout.error or error,
                                          "metadata": {**rollout.metadata, "reward_hook_error": error}})
    return rollout.model_copy(update={"train_reward": value})


def shape_group(group: Group, reward_fn: Callable[..., Any] | None) -> Group:
    """`group` with each rollout passed through `reshape_reward` once (the same group when
    `reward_fn` is None). The loop shapes a group once, as it completes (the orchestrator's
    `on_group`), so a stateful hook's value is the one checked for signal, trained and logged."""
    if reward_fn is None:
        return group
    return group.model_copy(update={"rollouts": [reshape_reward(r, reward_fn) for r in group.rollouts]})


def training_reward(rollout: Rollout) -> float | None:
    """The reward the advantage uses: `train_reward` when shaping ran (even a None it returned:
    the hook declared the rollout unscored), else the verifier's `reward`; None for a value that
    is not finite (a record written before the runner and `reshape_reward` refused them)."""
    shaped = "train_reward" in rollout.model_fields_set
    value = rollout.train_reward if shaped else rollout.reward
    return value if value is None or math.isfinite(value) else None
