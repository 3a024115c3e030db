"""What a training run shows on the console: a line per step, sampled conversations, a final table.

Structured content (lists of parts) is rendered as text; nothing here may raise on odd content.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from harnessrl.loss.diagnostics import ESS_WARN, KL_WARN, WEIGHT_MEAN_WARN
from harnessrl.types import Rollout


def step_line(step: int, steps: int, m: dict[str, Any]) -> str:
    """One plain-text line per training step; `step` is 1-based (the k-th of `steps`).

    A step that trained nothing says why (`skip_reason`) instead of showing empty loss columns.
    """
    def f(key: str, fmt: str = ".3f") -> str:
        v = m.get(key)
        return "-" if v is None else format(v, fmt)

    head = (f"step {step}/{steps} v{m.get('policy_version', '?')} "
            f"reward {f('reward/verifier_mean')}±{f('reward/verifier_std')} "
            f"train {f('reward/train_mean')} pass {f('pass_rate', '.2f')} "
            f"err {f('error_rate', '.2f')} ")
    times = (f"t(wait/train/sync) {f('time/rollout_wait_s', '.1f')}/{f('time/train_s', '.1f')}/"
             f"{f('time/sync_s', '.1f')}s")
    if "eval/pass_rate" in m:
        head += f"eval {f('eval/pass_rate', '.2f')} "
    if m.get("skipped"):
        return head + f"no update: {m.get('skip_reason') or 'no row to train'}; " + times
    return head + (f"loss {f('loss', '.4f')} gnorm {f('grad_norm', '.3f')} |r-1| {f('ratio_abs_dev', '.2e')} "
                   f"tok {int(m.get('tokens_trained', 0))} stale {f('staleness_mean', '.2f')} ") + times


def _crossed(m: Mapping[str, Any], prefix: str) -> list[str]:
    """The thresholds the metrics under `prefix` cross, in words."""
    if not m.get(f"{prefix}tokens"):
        return []
    found = []
    kl, ess, mean = m[f"{prefix}mismatch_kl"], m[f"{prefix}is_weight_ess"], m[f"{prefix}is_weight_mean"]
    if kl > KL_WARN:
        found.append(f"mismatch KL {kl:.3f} > {KL_WARN}")
    if ess < ESS_WARN:
        found.append(f"ESS {ess:.2f} < {ESS_WARN}")
    if not WEIGHT_MEAN_WARN[0] <= mean <= WEIGHT_MEAN_WARN[1]:
        found.append(f"mean weight {mean:.2f} outside [{WEIGHT_MEAN_WARN[0]}, {WEIGHT_MEAN_WARN[1]}]")
    return found


def offpolicy_warnings(m: Mapping[str, Any]) -> list[str]:
    """One line per likely cause whose tokens cross a threshold: the precision gap (staleness 0
    tokens: engine and trainer disagree at the same weights) and the policy lag (staleness >= 1
    tokens); the totals when no staleness is known. Empty when nothing crosses."""
    lines = []
    gap = _crossed(m, "offpolicy/s0/")
    if gap:
        lines.append("off-policy: precision gap at staleness 0 (" + ", ".join(gap) + "): the engine and the "
                     "trainer disagree at the same weights (engine dtype, top_p / top_k renormalisation)")
    lag = _crossed(m, "offpolicy/lag/")
    if lag:
        lines.append("off-policy: policy lag at staleness >= 1 (" + ", ".join(lag) + "): rollouts from older "
                     "weights (lower train.max_staleness)")
    if not lines and "offpolicy/s0/tokens" not in m and "offpolicy/lag/tokens" not in m:
        total = _crossed(m, "offpolicy/")
        if total:
            lines.append("off-policy: sampler/trainer mismatch (" + ", ".join(total) + ")")
    return lines


def skip_reason(m: dict[str, Any]) -> str:
    """Why a step has no row to train, from its row counts (`rows_built` and the
    `rows_*_dropped` counts of `rows.rows_for_step`)."""
    if not m.get("rows_built"):
        return "no trainable turn (no rollout has a sampled token to train)"
    dropped = {
        "all rewards equal within each group": m.get("rows_zero_variance_dropped", 0),
        "no scored rollout (errors have no reward)": m.get("rows_unscored_dropped", 0),
        "all rows stale (older than max_staleness)": m.get("rows_stale_dropped", 0),
    }
    causes = [(reason, int(n)) for reason, n in dropped.items() if n]
    if len(causes) == 1:
        return causes[0][0]
    return "rows dropped: " + ", ".join(f"{n} {reason.split(' (')[0]}" for reason, n in causes)


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
    """The rollout's last recorded request plus the reply it got, as one panel (the neutral
    record: `Turn.request` messages and `Turn.reply`, whatever protocol the agent spoke)."""
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
    if last.reply is not None:
        text = last.reply.content or ""
        for call in last.reply.tool_calls:
            text += f"\n[tool call] {call.name}({call.arguments})"
        lines.append(f"[bold green]assistant[/]: {escape(_cut(text, max_chars))}")
    title = f"{rollout.task_id} · {rollout.status} · reward {rollout.reward}"
    if "train_reward" in rollout.model_fields_set:
        title += f" (train {rollout.train_reward})"
    console.print(Panel("\n".join(lines), title=escape(title), expand=False))


FINAL_COLUMNS = ("step", "ver", "reward", "train", "pass", "err", "eval", "loss", "gnorm", "tok", "stale", "s")
"""Columns of the final table: step (1-based; 0 is the held-out evaluation before any
update), policy version, the verifier's mean reward (`reward/verifier_mean`), the training
reward (`reward/train_mean`, after shaping), pass rate, error rate, held-out pass rate
(`eval/pass_rate`, on the steps that evaluated), loss, grad norm, trained tokens, stale rows
dropped, step seconds (the mean |ratio - 1| is in each step line and `metrics.jsonl`)."""


def final_table(history: Sequence[dict[str, Any]]) -> Table:
    """One row per step; short headers and no vertical rules, so it fits 80 columns uncut."""
    table = Table(title="harnessrl train", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in FINAL_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for m in history:
        skipped = bool(m.get("skipped"))
        evaluated_only = "loss" not in m and not skipped
        table.add_row(
            str(m.get("step")), str(m.get("policy_version")), _fmt(m.get("reward/verifier_mean"), ".2f"),
            _fmt(m.get("reward/train_mean"), ".2f"),
            _fmt(m.get("pass_rate"), ".2f"), _fmt(m.get("error_rate"), ".2f"), _fmt(m.get("eval/pass_rate"), ".2f"),
            "skip" if skipped else ("-" if evaluated_only else _fmt(m.get("loss"), ".4f")), _fmt(m.get("grad_norm"), ".2f"),
            str(int(m.get("tokens_trained", 0))),
            str(int(m.get("rows_stale_dropped", 0))), _fmt(m.get("time/step_s"), ".1f"),
        )
    return table


def bound_line(history: Sequence[dict[str, Any]], cores: int | None = None, max_staleness: int = 0) -> str:
    """Which part bounds the run, from the training steps' metrics (held-out evaluations left
    out): the shares of the steps' wall time (`time/step_s`) the trainer spent waiting for
    groups (`time/rollout_wait_s`: generation, sandboxes, agents and verifiers), training
    (`time/train_s`) and syncing (`time/sync_s`); the engine's busy fraction (`engine/busy_frac`,
    mean over steps, when the engine reports it); the event loop thread's CPU seconds per step
    (`time/loop_cpu_s`: the proxy and the orchestrator); the CPU seconds per step of this
    process (`time/process_cpu_s`) and of every other process on its cores
    (`time/other_cpu_s`: the agents and their commands, other jobs), with the latter's share of
    the cores' time over the steps (`cores` x the steps' wall time); and the mean seconds a
    rollout spent creating its sandbox and being verified. Generation bounds the run when the
    trainer waited more than it trained and synced, else training does; when other processes
    took half the cores' time or more, the line says that training and generation ran on what
    those left. `cores`: default, those this process may run on. "" when no step has timings.

    Late groups: in an asynchronous run (`max_staleness` >= 1, the run's `train.max_staleness`)
    bound by training, the steps after the first that still waited for rollouts (at least
    `LATE_GROUP_SHARE` of the step) waited for a group that outlasted generation's lead: a group
    granted after step k's sync trains at step k + max_staleness + 1, which starts when step
    k + max_staleness ends, so its rollouts have about `max_staleness` steps of wall time. The
    line gives those steps, their wait, the slowest rollout they trained (`total_s_max`) and
    that lead, and what shortens the waits."""
    steps = [m for m in history if "time/step_s" in m]
    total = sum(m["time/step_s"] for m in steps)
    if not steps or total <= 0:
        return ""
    if cores is None:  # the cores this process may run on
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = {k: sum(m.get(f"time/{k}_s", 0.0) for m in steps) / total for k in ("rollout_wait", "train", "sync")}
    bound = "generation" if share["rollout_wait"] > share["train"] + share["sync"] else "training"
    parts = [f"bound by {bound}: of {total:.0f} s of steps, waiting for rollouts {share['rollout_wait']:.0%}, "
             f"training {share['train']:.0%}, weight sync {share['sync']:.0%}"]

    def mean(key: str) -> float | None:
        values = [m[key] for m in steps if key in m]
        return sum(values) / len(values) if values else None

    for key, text, scale in (("engine/busy_frac", "engine busy {:.0%}", 1.0),
                             ("time/loop_cpu_s", "event loop CPU {:.1f} s/step", 1.0),
                             ("time/process_cpu_s", "this process {:.1f} CPU-s/step", 1.0)):
        value = mean(key)
        if value is not None:
            parts.append(text.format(value * scale))
    other_share = None
    if (other := mean("time/other_cpu_s")) is not None:
        other_share = sum(m.get("time/other_cpu_s", 0.0) for m in steps) / (cores * total)
        parts.append(f"other processes (agents, their commands, other jobs) {other:.1f} CPU-s/step "
                     f"({other_share:.0%} of {cores} cores)")
    for key, text, scale in (("sandbox_s_mean", "sandbox start {:.0f} ms/rollout", 1e3),
                             ("verify_s_mean", "verify {:.0f} ms/rollout", 1e3)):
        value = mean(key)
        if value is not None:
            parts.append(text.format(value * scale))
    if bound == "training" and max_staleness >= 1 and (late := late_groups(steps[1:], total, max_staleness)):
        parts.append(late)
    line = "; ".join(parts)
    if other_share is not None and other_share >= OTHERS_BOUND_SHARE:
        line += "; other processes took most of the CPU: training and generation ran on what they left"
    return line


def late_groups(steps: Sequence[Mapping[str, float]], total: float, max_staleness: int) -> str:
    """`bound_line`'s late-group clause over `steps` (the run's training steps after the
    first; `total`: all its steps' wall seconds), "" when none waited `LATE_GROUP_SHARE` of
    its time."""
    waited = [m for m in steps
              if (w := m.get("time/rollout_wait_s", 0.0)) > 0 and w >= LATE_GROUP_SHARE * m["time/step_s"]]
    if not waited:
        return ""
    wait = sum(m["time/rollout_wait_s"] for m in waited)
    lead = max_staleness * sum(m["time/step_s"] for m in steps) / len(steps)
    slowest = [m["total_s_max"] for m in waited if "total_s_max" in m]
    longest = f"; their slowest rollout {max(slowest):.1f} s" if slowest else ""
    return (f"{len(waited)} of {len(steps)} steps after the first waited for a late group ({wait:.1f} s, "
            f"{wait / total:.0%} of the steps' time{longest}, against generation's lead of ~{lead:.1f} s: "
            f"max_staleness {max_staleness} x the mean step; a larger train.max_staleness or a smaller "
            f"sampling.max_tokens shortens them)")


LATE_GROUP_SHARE = 0.1
"""Share of a step's wall time from which its wait for rollouts counts as waiting for a late
group (`bound_line`, `late_groups`)."""


OTHERS_BOUND_SHARE = 0.5
"""Share of the cores' time over the steps taken by other processes (`time/other_cpu_s`: the
agents' own processes, other jobs) from which `bound_line` says they set the pace."""


def rows_line(history: Sequence[Mapping[str, float]]) -> str:
    """Rows and credit over the run's training steps, from the samples builder's counts in
    each step's metrics (`MergeStats.as_metrics`), so totals are exact rather than means of
    per-step fractions: rows per rollout (`samples/num_rows` over `samples/num_rollouts`), the
    CLEAN (of them bridged) / REALIGN / FORK shares of merged turns, the untrained sampled
    tokens (summed; must be 0), and each turn position's share of the main-chain trained tokens
    (`samples/trained_token_share/*` weighted by the step's `samples/main_sampled_tokens` −
    `samples/untrained_sampled_tokens`). "" when no step carries the builder's counts."""
    steps = [m for m in history if "samples/num_rollouts" in m]
    if not steps:
        return ""

    def total(key: str) -> float:
        return sum(float(m.get(key) or 0.0) for m in steps)

    rollouts = total("samples/num_rollouts")
    merged = {k: total(f"samples/num_{k}") for k in ("clean", "bridged", "realign", "fork")}
    n_merged = merged["clean"] + merged["realign"] + merged["fork"]
    frac = {k: (v / n_merged if n_merged else 0.0) for k, v in merged.items()}
    prefix = "samples/trained_token_share/"
    names = sorted({k[len(prefix):] for m in steps for k in m if k.startswith(prefix)},
                   key=lambda n: (len(n), n))  # turn_1 .. turn_3, then turn_4plus
    weights = [float(m.get("samples/main_sampled_tokens") or 0.0) - float(m.get("samples/untrained_sampled_tokens") or 0.0)
               for m in steps]
    weight = sum(weights)
    shares = {n: (sum(w * float(m.get(prefix + n) or 0.0) for w, m in zip(weights, steps)) / weight if weight else 0.0)
              for n in names}
    by_turn = ", ".join(f"{n.removeprefix('turn_').replace('plus', '+')}: {v:.2f}" for n, v in shares.items())
    return (f"rows and credit over {len(steps)} step{'' if len(steps) == 1 else 's'}: {total('samples/num_rows') / rollouts if rollouts else 0.0:.2f} "
            f"rows per rollout; merged turns CLEAN {frac['clean']:.2f} (bridged {frac['bridged']:.2f}), "
            f"REALIGN {frac['realign']:.2f}, FORK {frac['fork']:.2f} of {int(n_merged)}; "
            f"untrained sampled tokens {int(total('samples/untrained_sampled_tokens'))}; "
            f"trained tokens by turn {by_turn or '-'}")


def _fmt(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + " … " + text[-n // 2 :]
