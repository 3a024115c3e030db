"""`harnessrl rollout`: run groups of rollouts without training and summarise them.

Responsibility: start the runtime, dispatch `limit` groups (G rollouts each, task chosen by
the seed `group_id`), write every finished rollout (with its trace) as one line of
`DIR/rollouts.jsonl`, show a progress bar, then print and save the summary
(`DIR/summary.json`): pass rate, pass@k, mean reward, statuses, tokens, time.

The config means what it means for `harnessrl train`: it is checked the same way before
anything starts (`config.check_run`), and the summary's rewards are those `[hooks]
rollout_reward_fn` gives (as the trainer's advantages use them); `rollouts.jsonl` keeps the
verifier's own reward on each rollout, as `harnessrl train` writes it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harnessrl.config import RunConfig, dump_config
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.runner import RolloutLimits
from harnessrl.rollout.summary import summarize_groups
from harnessrl.types import Group

DEFAULT_GROUPS = 4


def run_evaluation(cfg: RunConfig, out_dir: Path, limit: int | None = None) -> int:
    """Run `limit` groups (default: tasks.limit, else 4); returns the process exit code.

    Raises:
        ConfigError: a hook, task source or verifier path that does not import (`check_run`),
            before the output directory is made.
    """
    from harnessrl.config import check_run
    from harnessrl.log import setup_logging
    from harnessrl.train.hooks import load_hooks, reshape_reward

    check_run(cfg)
    reward_fn = load_hooks(cfg.hooks).get("rollout_reward_fn")
    out_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(cfg.log.level, out_dir / "run.log")
    (out_dir / "config.toml").write_text(dump_config(cfg), encoding="utf-8")
    n_groups = limit or cfg.tasks.limit or DEFAULT_GROUPS
    console = Console()
    t0 = time.monotonic()
    groups = asyncio.run(_evaluate(cfg, out_dir, n_groups, console))
    shaped = [g.model_copy(update={"rollouts": [reshape_reward(r, reward_fn) for r in g.rollouts]})
              for g in groups]
    summary = summarize_groups(shaped)
    summary["wall_s"] = time.monotonic() - t0
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    console.print(summary_table(summary, title=f"harnessrl rollout: {cfg.harness.kind} on {cfg.tasks.kind}"))
    console.print(f"rollouts written to {out_dir / 'rollouts.jsonl'}")
    return 0


async def _evaluate(cfg: RunConfig, out_dir: Path, n_groups: int, console: Console) -> list[Group]:
    from harnessrl.runtime import start_runtime

    groups: list[Group] = []
    async with start_runtime(cfg) as rt:
        orch = Orchestrator(
            rt.tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for,
            group_size=cfg.rollout.group_size,
            max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts,
            limits=RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s),
        )
        total = n_groups * cfg.rollout.group_size
        progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=False)
        orch.allow(n_groups)
        orch.start()
        try:
            with progress, (out_dir / "rollouts.jsonl").open("a", encoding="utf-8") as fh:
                bar = progress.add_task("rollouts", total=total)
                while len(groups) < n_groups:
                    group = await orch.get_group(
                        on_wait=lambda: progress.update(bar, completed=orch.rollouts_finished))
                    groups.append(group)
                    for r in group.rollouts:
                        fh.write(r.model_dump_json() + "\n")
                    fh.flush()
                progress.update(bar, completed=orch.rollouts_finished)
        finally:
            await orch.close()
    return groups


def summary_table(summary: dict[str, float], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        shown = f"{value:.3f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"
        table.add_row(key, shown)
    return table
