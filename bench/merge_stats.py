"""Rows and credit of recorded rollouts: the samples builder's own accounting, per run directory.

Builds training rows from each `rollouts.jsonl` with the samples builder exactly as
`harnessrl train` does by default (no hooks) and prints its `MergeStats`, the numbers every
training step logs as `samples/*`: turns, the CLEAN (of them bridged: the turn notes
`bridged_from=N`) / REALIGN / FORK shares of the main-chain turns after each rollout's first,
main-chain sampled tokens and those that train in no row (`untrained_sampled_tokens`, goal 0),
rows per rollout, and each agent turn position's share of the trained tokens
(`trained_token_share/turn_<k>`: the k-th main-chain turn of its rollout, the last bucket every
later turn too), over all rollouts and over those that passed (reward 1).

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


def run_stats(run_dir: Path) -> tuple[MergeStats, MergeStats]:
    """The merged builder stats of every rollout in `run_dir`, and of those with reward 1."""
    stats, passing = MergeStats(), MergeStats()
    for rec in read_jsonl(run_dir / "rollouts.jsonl").rows:
        rollout = Rollout.model_validate(rec)
        built = build_rows(rollout)[1]
        stats = stats.merge(built)
        if rollout.reward == 1.0:
            passing = passing.merge(built)
    return stats, passing


def _shares(stats: MergeStats) -> str:
    if not stats.num_rollouts:
        return "none"
    return ", ".join(f"{k.removeprefix('turn_').replace('plus', '+')}: {v:.2f}" for k, v in stats.turn_shares().items())


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for arg in argv:
        stats, passing = run_stats(Path(arg))
        fr = stats.fractions()
        print(f"{arg}: rollouts={stats.num_rollouts} turns={stats.num_turns} clean={fr['clean']:.2f} "
              f"(bridged={stats.frac_bridged():.2f}) realign={fr['realign']:.2f} fork={fr['fork']:.2f} "
              f"auxiliary={stats.num_auxiliary} main_sampled={stats.main_sampled_tokens} "
              f"untrained_sampled={stats.untrained_sampled_tokens} rows={stats.num_rows}")
        print(f"  rows per rollout {stats.rows_per_rollout():.2f}; trained-token share per turn position: "
              f"{_shares(stats)}; passing rollouts ({passing.num_rollouts}): {_shares(passing)}")


if __name__ == "__main__":
    main(sys.argv[1:])
