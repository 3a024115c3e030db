"""What a training run shows on the console: a line per step, sampled conversations, a final table.

Structured content (lists of parts) is rendered as text; nothing here may raise on odd content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from harnessrl.types import Rollout


def step_line(step: int, steps: int, m: dict[str, Any]) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        v = m.get(key)
        return "-" if v is None else format(v, fmt)

    return (
        f"[bold]step {step + 1}/{steps}[/] v{m.get('policy_version', '?')} "
        f"reward {f('reward_mean')}±{f('reward_std')} pass {f('pass_rate', '.2f')} "
        f"loss {f('loss', '.4f')} gnorm {f('grad_norm', '.3f')} |r-1| {f('ratio_abs_dev', '.2e')} "
        f"tok {int(m.get('tokens_trained', 0))} stale {f('staleness_mean', '.2f')} "
        f"t(wait/train/sync) {f('time/rollout_wait_s', '.1f')}/{f('time/train_s', '.1f')}/{f('time/sync_s', '.1f')}s"
    )


def content_text(content: Any) -> str:
    """A message's content as text: strings as they are, lists of parts joined, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, default=str))
        return "\n".join(parts)
    return json.dumps(content, default=str)


def print_conversation(console: Console, rollout: Rollout, max_chars: int = 1200) -> None:
    """The rollout's last recorded request plus the reply it got, as one panel."""
    turns = [t for t in rollout.trace.turns if t.request.get("messages") is not None]
    if not turns:
        console.print(Panel(f"(no chat turns) status={rollout.status}", title=rollout.rollout_id))
        return
    last = turns[-1]
    lines = []
    for msg in last.request.get("messages", []):
        if not isinstance(msg, dict):
            continue
        text = content_text(msg.get("content"))
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            text += f"\n[tool call] {fn.get('name')}({fn.get('arguments')})"
        lines.append(f"[bold]{escape(str(msg.get('role', '?')))}[/]: {escape(_cut(text, max_chars))}")
    if last.response and last.response.get("choices"):
        reply = last.response["choices"][0].get("message", {})
        lines.append(f"[bold green]assistant[/]: {escape(_cut(content_text(reply.get('content')), max_chars))}")
    title = f"{rollout.task_id} · {rollout.status} · reward {rollout.reward}"
    console.print(Panel("\n".join(lines), title=escape(title), expand=False))


def final_table(history: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="harnessrl train")
    for col in ("step", "version", "reward", "pass", "loss", "grad_norm", "|r-1|", "tokens", "stale dropped", "wall s"):
        table.add_column(col, justify="right")
    for m in history:
        table.add_row(
            str(m.get("step")), str(m.get("policy_version")), _fmt(m.get("reward_mean")),
            _fmt(m.get("pass_rate")), _fmt(m.get("loss"), ".4f"), _fmt(m.get("grad_norm")),
            _fmt(m.get("ratio_abs_dev"), ".2e"), str(int(m.get("tokens_trained", 0))),
            str(int(m.get("rows_stale_dropped", 0))), _fmt(m.get("time/step_s"), ".1f"),
        )
    return table


def _fmt(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + " … " + text[-n // 2 :]
