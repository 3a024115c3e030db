"""Resuming a run: the run directory's logs brought back to what a checkpoint holds.

Responsibility: before `train(..., resume=True)` continues from the checkpoint after step k,
`metrics.jsonl` keeps the lines of steps <= k and `rollouts.jsonl` the rollouts of the groups
that checkpoint trained on (the groups it lists to replay are redone), so each step and group
appears once. Torn or unreadable lines (a process killed mid-write) are dropped and reported.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from harnessrl.jsonl import read_jsonl

log = logging.getLogger(__name__)


def drop_lines_after_checkpoint(run_dir: Path, step: int, next_group_id: int, replay: list[int]) -> None:
    """Before a resume from the checkpoint after `step`: drop the metrics of later steps and the
    rollouts of groups that checkpoint did not train on (they are redone), so that each step and
    group appears once in `metrics.jsonl` and `rollouts.jsonl`."""
    redo = set(replay)

    def keep_metrics(row: dict[str, Any]) -> bool:
        return row.get("step", 0) <= step

    def keep_rollout(row: dict[str, Any]) -> bool:
        gid = row.get("group_id", -1)
        return gid < next_group_id and gid not in redo

    for name, keep in (("metrics.jsonl", keep_metrics), ("rollouts.jsonl", keep_rollout)):
        path = run_dir / name
        if not path.exists():
            continue
        # a torn last line (the previous process was killed mid-write) is dropped, reported
        read = read_jsonl(path)
        kept = [line for line, row in zip(read.lines, read.rows) if keep(row)]
        if len(kept) < len(read.rows) or read.bad_lines or read.torn_tail:
            tmp = path.with_name(name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(path)
            log.info("%s: dropped %d lines logged after step %d (that work is redone) and %d "
                     "unreadable lines", name, len(read.rows) - len(kept), step, len(read.bad_lines))
