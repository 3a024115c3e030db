"""`harnessrl rollout`: run groups of rollouts without training and summarise them.

Responsibility: start the runtime, dispatch `limit` groups (G rollouts each, task chosen by
the seed `group_id`), write every finished rollout (with its trace) as one line of
`DIR/rollouts.jsonl`, log one readable line per finished rollout (`summary.rollout_line`,
to `DIR/run.log` and stderr) with a progress bar on a terminal, then print and save the
summary (`DIR/summary.json`): pass rate, error rate, pass@k, mean reward, statuses, tokens, time.

Ctrl-C / SIGTERM (`harnessrl.signals`): rollouts in flight are cancelled and release everything;
they are not written. Every finished rollout is written: those of groups the signal left
incomplete with `metadata["group_incomplete"] = true`. The summary of the groups completed
before the signal is still printed and saved, with `stopped_by_signal` = the signal number; the
exit code is 130 / 143.

Resume: run again with the same `--out DIR` and only what is missing runs. Rollouts already in
`DIR/rollouts.jsonl` of groups 0..N-1 are kept (at most G a group) unless their status is an
error (`summary.ERROR_STATUSES`); each group runs only the rollouts it lacks (an incomplete
group's mark is dropped once it is complete). Errored records move to
`DIR/rollouts.replaced.jsonl`; the summary covers kept and new rollouts together. A directory
whose `config.toml` differs from the config in a key that changes what a rollout is (any but
`RESUME_FREE`) is refused before anything is written, naming the keys.

The config means what it means for `harnessrl train`: it is checked the same way before
anything starts (`config.check_run`). The summary shows both rewards: `reward/verifier_*`
(the verifier's, which pass rate and pass@k count) and `reward/train_*` (what `[hooks]
rollout_reward_fn` gives, as the trainer's advantages use it); `rollouts.jsonl` keeps the
verifier's own reward on each rollout.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from harnessrl.config import RunConfig, check_run, dump_config
from harnessrl.errors import ConfigError
from harnessrl.hooks import shape_group
from harnessrl.jsonl import read_jsonl, repair_torn_tail
from harnessrl.log import setup_logging, to_run_log
from harnessrl.proxy.server import run_loop
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.runner import RolloutLimits
from harnessrl.rollout.summary import ERROR_STATUSES, rollout_line, summarize_groups
from harnessrl.runtime import Prepared, start_runtime
from harnessrl.signals import RunStopped, run_until_signal
from harnessrl.types import Group, Rollout

log = logging.getLogger(__name__)

DEFAULT_GROUPS = 4

INCOMPLETE = "group_incomplete"
"""The `Rollout.metadata` key marking a record written while its group was incomplete (a run
stopped before the group's other rollouts finished); dropped once a resumed run completes it."""

RESUME_FREE = ("log.", "train.", "tasks.limit", "rollout.max_concurrent_rollouts")
"""Config keys (prefixes) that may change between a run and its resume: they do not change
what a rollout is (`check_same_config`)."""

PROGRESS_EVERY_S = 30.0
"""Off a terminal, seconds between progress records while no rollout finishes."""


def run_evaluation(cfg: RunConfig, out_dir: Path, limit: int | None = None, prepared: Prepared | None = None) -> int:
    """Run `limit` groups (default: tasks.limit, else 4); returns the process exit code.
    `prepared`: the hooks, task source and verifier `preflight.check_start` built (the hooks
    are loaded here when None).

    Raises:
        ConfigError: a hook, task source or verifier path that does not import (`check_run`),
            before the output directory is made.
    """
    if prepared is None:
        prepared = Prepared(check_run(cfg), None, None)
    reward_fn = prepared.hooks.rollout_reward_fn
    check_same_config(out_dir, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    setup_logging(cfg.log.level, out_dir / "run.log", console=console)
    (out_dir / "config.toml").write_text(dump_config(cfg), encoding="utf-8")
    n_groups = limit or cfg.tasks.limit or DEFAULT_GROUPS
    kept, needed = resume_plan(out_dir, n_groups, cfg.rollout.group_size)
    log.info("harnessrl rollout -> %s (model %s, harness %s, tasks %s, %d tasks x G=%d)", out_dir,
             cfg.engine.model, cfg.harness.kind, cfg.tasks.kind, n_groups, cfg.rollout.group_size)
    t0 = time.monotonic()
    groups: list[Group] = []
    partial: dict[int, list[Rollout]] = {}
    stopped: RunStopped | None = None
    groups.extend(Group(group_id=gid, task_id=rs[0].task_id, rollouts=rs)
                  for gid, rs in sorted(kept.items()) if gid not in needed)
    try:
        if needed:
            # uvloop when installed: the agents' listener runs inside this process
            run_loop(run_until_signal(_evaluate(cfg, out_dir, needed, kept, console, groups, partial, prepared)))
    except RunStopped as exc:
        stopped = exc
    _write_incomplete(out_dir, partial)
    _settle_marks(out_dir, kept, groups)
    shaped = [shape_group(g, reward_fn) for g in groups]
    summary = summarize_groups(shaped)
    summary["wall_s"] = time.monotonic() - t0
    title = f"harnessrl rollout: {cfg.harness.kind} on {cfg.tasks.kind}"
    if stopped is not None:
        summary["stopped_by_signal"] = float(stopped.signum)
        name = signal.Signals(stopped.signum).name
        title += f" (stopped by {name}: {len(groups)} of {n_groups} tasks done)"
        log.warning("stopped by %s: rollouts in flight cancelled and not written; %d of %d tasks done; "
                    "%d finished rollouts of %d incomplete groups written (marked %s), the same --out "
                    "fills them", name, len(groups), n_groups, sum(len(rs) for rs in partial.values()),
                    len(partial), INCOMPLETE)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    out = Console(record=True)
    out.print(summary_table(summary, title=title))
    out.print(f"rollouts written to {out_dir / 'rollouts.jsonl'}")
    to_run_log(out.export_text())
    return 0 if stopped is None else stopped.exit_code


def resume_plan(out_dir: Path, n_groups: int, group_size: int) -> tuple[dict[int, list[Rollout]], dict[int, int]]:
    """What an evaluation of groups `0..n_groups-1` in `out_dir` still has to run: (kept rollouts
    per group id, rollouts to run per group id). Rewrites `out_dir/rollouts.jsonl` to the kept
    records (errored ones appended to `rollouts.replaced.jsonl`); a fresh directory needs all."""
    path = out_dir / "rollouts.jsonl"
    kept: dict[int, list[Rollout]] = {}
    if path.exists():
        read = read_jsonl(path)
        keep_lines, replaced = [], []
        for line, row in zip(read.lines, read.rows):
            try:
                rollout = Rollout.model_validate(row)
            except ValueError:
                replaced.append(line)
                continue
            group = kept.setdefault(rollout.group_id, [])
            if (rollout.status in ERROR_STATUSES or not 0 <= rollout.group_id < n_groups
                    or len(group) >= group_size):
                replaced.append(line)
                continue
            group.append(rollout)
            keep_lines.append(line)
        kept = {gid: rs for gid, rs in kept.items() if rs}
        if replaced or read.bad_lines or read.torn_tail:
            with (out_dir / "rollouts.replaced.jsonl").open("a", encoding="utf-8") as fh:
                fh.writelines(line + "\n" for line in replaced)
            tmp = path.with_name("rollouts.jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep_lines), encoding="utf-8")
            tmp.replace(path)
        n_kept = sum(len(rs) for rs in kept.values())
        log.info("resuming in %s: %d rollouts kept, %d errored or extra set aside in "
                 "rollouts.replaced.jsonl, %d unreadable lines dropped", out_dir, n_kept, len(replaced),
                 len(read.bad_lines))
    needed = {gid: group_size - len(kept.get(gid, [])) for gid in range(n_groups)
              if len(kept.get(gid, [])) < group_size}
    return kept, needed


async def _evaluate(cfg: RunConfig, out_dir: Path, needed: dict[int, int], kept: dict[int, list[Rollout]],
                    console: Console, groups: list[Group], partial: dict[int, list[Rollout]],
                    prepared: Prepared | None = None) -> None:
    """Run the rollouts `needed` (per group id), appending each completed group (with its `kept`
    rollouts) to `groups`, its new rollouts to `rollouts.jsonl`; `partial` holds the finished
    rollouts of groups not completed yet (what a stop leaves)."""
    total = sum(needed.values())
    last_record = time.monotonic()

    def on_rollout(rollout: Rollout) -> None:
        nonlocal last_record
        last_record = time.monotonic()
        partial.setdefault(rollout.group_id, []).append(rollout)
        log.info("rollout %d/%d %s", orch.rollouts_finished, total, rollout_line(rollout))

    def on_wait() -> None:
        nonlocal last_record
        progress.update(bar, completed=orch.rollouts_finished)
        if not console.is_terminal and time.monotonic() - last_record >= PROGRESS_EVERY_S:
            last_record = time.monotonic()
            log.info("rollouts %d/%d finished, %d running", orch.rollouts_finished, total,
                     orch.rollouts_running)

    async with start_runtime(cfg, run_dir=out_dir, prepared=prepared) as rt:
        orch = Orchestrator(
            rt.tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for,
            group_size=cfg.rollout.group_size,
            max_concurrent_rollouts=cfg.concurrent_rollouts,
            limits=RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s,
                                 cfg.rollout.max_final_answer_chars),
            on_rollout=on_rollout, replay_group_ids=sorted(needed), group_sizes=needed,
        )
        # the bar's total is fixed: every rollout of the run, known before any starts
        progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=False, disable=not console.is_terminal)
        bar = progress.add_task("rollouts", total=total)
        orch.allow(len(needed))
        orch.start()
        try:
            repair_torn_tail(out_dir / "rollouts.jsonl")  # left by a killed earlier run
            with progress, (out_dir / "rollouts.jsonl").open("a", encoding="utf-8") as fh:
                for _ in range(len(needed)):
                    group = await orch.get_group(on_wait=on_wait)
                    partial.pop(group.group_id, None)
                    for r in group.rollouts:
                        fh.write(r.model_dump_json() + "\n")
                    fh.flush()
                    groups.append(group.model_copy(update={"rollouts": kept.get(group.group_id, []) + group.rollouts}))
                progress.update(bar, completed=orch.rollouts_finished)
        finally:
            await orch.close()


def _write_incomplete(out_dir: Path, partial: dict[int, list[Rollout]]) -> None:
    """Append the finished rollouts of groups a stop left incomplete to `rollouts.jsonl`, each
    marked `metadata[INCOMPLETE] = True`; `resume_plan` keeps them and runs only the rest."""
    if not partial:
        return
    with (out_dir / "rollouts.jsonl").open("a", encoding="utf-8") as fh:
        for _, rollouts in sorted(partial.items()):
            for r in rollouts:
                marked = r.model_copy(update={"metadata": {**r.metadata, INCOMPLETE: True}})
                fh.write(marked.model_dump_json() + "\n")


def _settle_marks(out_dir: Path, kept: dict[int, list[Rollout]], groups: list[Group]) -> None:
    """Drop the `INCOMPLETE` mark from kept records whose group this run completed (rewriting
    `rollouts.jsonl` through a temporary file); nothing to do when no such record was kept."""
    done = {g.group_id for g in groups}
    if not any(r.metadata.get(INCOMPLETE) for gid in done for r in kept.get(gid, [])):
        return
    path = out_dir / "rollouts.jsonl"
    read = read_jsonl(path)
    lines = []
    for line, row in zip(read.lines, read.rows):
        if row.get("group_id") in done and row.get("metadata", {}).get(INCOMPLETE):
            row["metadata"].pop(INCOMPLETE)
            line = json.dumps(row, ensure_ascii=False)
        lines.append(line)
    tmp = path.with_name("rollouts.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


def check_same_config(out_dir: Path, cfg: RunConfig) -> None:
    """Refuse to resume in `out_dir` when it holds rollouts of another config: its `config.toml`
    differs from `cfg` in a key that changes what a rollout is (any key both name but
    `RESUME_FREE`). Checked before anything is written.

    Raises:
        ConfigError: one line naming the keys that differ (old -> new), or the missing
            `config.toml` of a directory holding rollouts.
    """
    if not (out_dir / "rollouts.jsonl").is_file() or (out_dir / "rollouts.jsonl").stat().st_size == 0:
        return
    old_path = out_dir / "config.toml"
    if not old_path.is_file():
        raise ConfigError(f"{out_dir} holds rollouts.jsonl but no config.toml, so its rollouts cannot be "
                          "matched to this config: use another --out, or move that directory aside")
    try:
        old = _flat(tomllib.loads(old_path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{old_path} does not read as TOML ({exc}): use another --out") from exc
    new = _flat(tomllib.loads(dump_config(cfg)))
    # a key only one side has is one this version added or removed (a kind's own keys differ
    # with its `kind`, which both have): only keys of both are compared
    differ = sorted(k for k in old.keys() & new.keys() if old[k] != new[k] and not k.startswith(RESUME_FREE))
    if differ:
        shown = "; ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in differ[:4])
        more = f"; and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise ConfigError(f"{out_dir} holds rollouts of another config ({shown}{more}): use another --out, "
                          "or move that directory aside")


def _flat(table: dict[str, object], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def summary_table(summary: dict[str, float], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        shown = f"{value:.3f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"
        table.add_row(key, shown)
    return table
