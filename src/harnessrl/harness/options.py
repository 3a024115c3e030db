"""Harness options: one typed pydantic model per harness kind, validated at config time.

Responsibility: map a `harness.kind` to its options model (`CodexConfig`, `OpencodeConfig`,
...), validate a config's `harness.options` table against it with errors that name the key and
list the valid ones, give the harness's `HarnessRequirements` for those options, and describe
every option (type, default, description) for `harnessrl harness options NAME`.

Each harness module is imported only when its kind is asked for, so the config layer and the
CLI stay light (no torch, no engine).

What this module deliberately does not do: build harnesses (`select.make_harness` does).
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from harnessrl.errors import ConfigError
from harnessrl.harness.base import HarnessRequirements

_OPTION_MODELS: dict[str, tuple[str, str]] = {
    "mini-swe-agent": ("harnessrl.harness.mini_swe_agent", "MiniSweAgentConfig"),
    "opencode": ("harnessrl.harness.opencode", "OpencodeConfig"),
    "command": ("harnessrl.harness.command", "CommandHarnessConfig"),
    "white_box": ("harnessrl.harness.python_loop", "WhiteBoxConfig"),
    "pi": ("harnessrl.harness.pi", "PiConfig"),
    "codex": ("harnessrl.harness.codex", "CodexConfig"),
    "claude-code": ("harnessrl.harness.claude_code", "ClaudeCodeConfig"),
    "gemini-cli": ("harnessrl.harness.gemini_cli", "GeminiCliConfig"),
}
_ALIASES = {"mini_swe_agent": "mini-swe-agent", "claude_code": "claude-code", "gemini_cli": "gemini-cli",
            "gemini": "gemini-cli"}

_MOVED = {"kill_grace_s": "sandbox.kill_grace_s, the one kill grace of every harness"}
"""Options that harnesses no longer take, and the key that now sets the knob."""

HARNESS_KINDS = tuple(_OPTION_MODELS)
"""Harness kinds a config may name (`harness.kind`)."""

DEFAULT_CONTEXT_TOKENS = 4096
"""`engine.max_context_tokens` when neither the config nor the harness asks for more."""
DEFAULT_REPLY_TOKENS = 192
"""`sampling.max_tokens` when neither the config nor the harness asks for more."""


def canonical_kind(kind: str) -> str:
    """`kind` with aliases resolved (`claude_code` -> `claude-code`).

    Raises:
        ConfigError: unknown kind (the message lists the known ones).
    """
    kind = _ALIASES.get(kind, kind)
    if kind not in _OPTION_MODELS:
        raise ConfigError(f"harness.kind={kind!r} is unknown; expected one of {', '.join(HARNESS_KINDS)}")
    return kind


def options_model(kind: str) -> type[BaseModel]:
    """The pydantic options model of harness `kind`. Raises ConfigError for an unknown kind."""
    module_name, class_name = _OPTION_MODELS[canonical_kind(kind)]
    return getattr(importlib.import_module(module_name), class_name)


def validate_options(kind: str, options: dict[str, Any]) -> BaseModel:
    """`options` validated by the options model of `kind`.

    Raises:
        ConfigError: unknown kind, unknown option (named, with the valid ones listed), or an
            invalid value (named, with the reason).
    """
    model = options_model(kind)
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        valid = ", ".join(model.model_fields)
        problems = []
        for err in exc.errors():
            key = "harness.options." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "harness.options"
            if err["type"] == "extra_forbidden":
                moved = _MOVED.get(str(err["loc"][-1])) if err["loc"] else None
                problems.append(f"unknown option {key!r}" + (f" (set {moved} instead)" if moved else ""))
            elif err["type"] == "missing":
                problems.append(f"{key} is required")
            else:
                problems.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"harness {canonical_kind(kind)!r}: {'; '.join(problems)} "
                          f"(valid options: {valid}; see `harnessrl harness options {canonical_kind(kind)}`)") from None


def requirements_for(kind: str, options: BaseModel) -> HarnessRequirements:
    """What harness `kind` with validated `options` needs (its options model's `requirements()`)."""
    declare = getattr(options, "requirements", None)
    if declare is None:
        return HarnessRequirements(protocol="any")
    return declare()


def default_limits(req: HarnessRequirements) -> tuple[int, int]:
    """Per-harness defaults `(engine.max_context_tokens, sampling.max_tokens)`: the harness's
    minimum context rounded up to a power of two (at least `DEFAULT_CONTEXT_TOKENS`), and its
    minimum reply length (at least `DEFAULT_REPLY_TOKENS`)."""
    context = DEFAULT_CONTEXT_TOKENS
    while context < req.min_context_tokens:
        context *= 2
    return context, max(DEFAULT_REPLY_TOKENS, req.min_reply_tokens)


def describe_options(kind: str) -> str:
    """Plain-text listing of harness `kind`'s options (name, type, default, description) and
    of what it needs with its default options. Raises ConfigError for an unknown kind."""
    kind = canonical_kind(kind)
    model = options_model(kind)
    lines = [f"harness {kind}: options ([harness] options = {{ ... }} or --set harness.options.NAME=VALUE)"]
    if model.__doc__ and not model.__doc__.startswith("Usage docs"):
        lines.append(f"  {model.__doc__.strip().splitlines()[0]}")
    lines.append("")
    for name, field in model.model_fields.items():
        type_name = _type_name(field.annotation)
        if field.is_required():
            default = "required"
        elif field.default_factory is not None:
            default = f"default {field.default_factory()!r}"  # type: ignore[call-arg]
        elif field.default is PydanticUndefined:
            default = "required"
        else:
            default = f"default {field.default!r}"
        lines.append(f"  {name}: {type_name} ({default})")
        for text in (field.description or "").strip().splitlines():
            lines.append(f"      {text.strip()}")
    try:
        req = requirements_for(kind, model())
    except ValidationError:
        req = None  # options without defaults (command: argv): needs depend on them
    if req is not None:
        context, reply = default_limits(req)
        reply_need = f">= {req.min_reply_tokens}" if req.min_reply_tokens else "any"
        lines += ["", f"needs (default options): protocol {req.protocol}, engine.max_context_tokens >= "
                      f"{req.min_context_tokens}, sampling.max_tokens {reply_need}"]
        if req.why:
            lines.append(f"  {req.why}")
        lines.append(f"run defaults with this harness: engine.max_context_tokens = {context}, "
                     f"sampling.max_tokens = {reply} (when the config leaves them unset)")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")
