"""CLEAN / REALIGN / FORK fractions and untrained sampled tokens of recorded rollouts.

Builds training rows from each `rollouts.jsonl` with the samples builder exactly as
`harnessrl train` does by default (no hooks) and prints, per run directory: turns, the merge
fractions over main-chain turns after the first, main-chain sampled tokens, those that train in
no row (`untrained_sampled_tokens`, goal 0), and how many turns were bridged by the proxy
(`bridged_from=N` in `Turn.notes`).

Run: `.venv/bin/python bench/merge_stats.py RUN_DIR [RUN_DIR ...]`, e.g. after
`harnessrl rollout --out RUN_DIR --set engine.model=tiny-random --set harness.kind=pi
--set rollout.group_size=2 --limit 1`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.jsonl import read_jsonl
from harnessrl.train.samples import MergeStats, build_rows
from harnessrl.types import Rollout


def run_stats(run_dir: Path) -> tuple[MergeStats, int]:
    """The merged builder stats of every rollout in `run_dir` and the number of bridged turns."""
    stats, bridged = MergeStats(), 0
    for rec in read_jsonl(run_dir / "rollouts.jsonl").rows:
        rollout = Rollout.model_validate(rec)
        stats = stats.merge(build_rows(rollout)[1])
        bridged += sum(any(n.startswith("bridged_from=") for n in t.notes) for t in rollout.trace.turns)
    return stats, bridged


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for arg in argv:
        stats, bridged = run_stats(Path(arg))
        fr = stats.fractions()
        print(f"{arg}: turns={stats.num_turns} bridged={bridged} clean={fr['clean']:.2f} "
              f"realign={fr['realign']:.2f} fork={fr['fork']:.2f} auxiliary={stats.num_auxiliary} "
              f"main_sampled={stats.main_sampled_tokens} untrained_sampled={stats.untrained_sampled_tokens} "
              f"rows={stats.num_rows}")


if __name__ == "__main__":
    main(sys.argv[1:])
