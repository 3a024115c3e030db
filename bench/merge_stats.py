"""CLEAN / REALIGN / FORK fractions and untrained sampled tokens of recorded rollouts.

Builds training rows from each `rollouts.jsonl` with the samples builder exactly as
`harnessrl train` does by default (no hooks) and prints, per run directory: turns, the merge
fractions over main-chain turns after the first, main-chain sampled tokens, those that train in
no row (`untrained_sampled_tokens`, goal 0), and how many turns were bridged by the proxy
(`bridged_from=N` in `Turn.notes`); then rows per rollout and, per turn position (the k-th
model call of a rollout), the share of all trained tokens that position's completions hold,
counted from the built rows (each trained token traced back to the turn whose completion it
is), over all rollouts and over those that passed (reward 1).

Run: `.venv/bin/python bench/merge_stats.py RUN_DIR [RUN_DIR ...]`, e.g. after
`harnessrl rollout --out RUN_DIR --set engine.model=tiny-random --set harness.kind=pi
--set rollout.group_size=2 --limit 1`.
"""

from __future__ import annotations

import sys
from collections import Counter
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


def turn_shares(run_dir: Path) -> tuple[float, dict[int, float], dict[int, float]]:
    """(rows per rollout, {turn position: share of trained tokens} over all rollouts, the same
    over passing ones). A trained span of a row is attributed to the turn whose completion ids
    it equals, found in order (completions are trained whole and in turn order)."""
    rollouts = rows = 0
    by_pos: Counter[int] = Counter()
    by_pos_pass: Counter[int] = Counter()
    for rec in read_jsonl(run_dir / "rollouts.jsonl").rows:
        rollout = Rollout.model_validate(rec)
        built = build_rows(rollout)[0]
        rollouts += 1
        rows += len(built)
        spans = []
        for row in built:
            ids, mask, i = row.input_ids, row.completion_mask, 0
            while i < len(ids):
                if mask[i]:
                    j = i
                    while j < len(ids) and mask[j]:
                        j += 1
                    spans.append(tuple(ids[i:j]))
                    i = j
                else:
                    i += 1
        pos = 0
        for k, turn in enumerate(rollout.trace.turns):
            if spans[pos:pos + 1] == [tuple(turn.completion_ids)]:
                by_pos[k] += len(turn.completion_ids)
                if rollout.reward == 1.0:
                    by_pos_pass[k] += len(turn.completion_ids)
                pos += 1

    def shares(c: Counter[int]) -> dict[int, float]:
        total = sum(c.values())
        return {k: c[k] / total for k in sorted(c)} if total else {}

    return (rows / rollouts if rollouts else 0.0), shares(by_pos), shares(by_pos_pass)


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
        per_rollout, shares, passing = turn_shares(Path(arg))
        print(f"  rows per rollout {per_rollout:.2f}; trained-token share per turn position: "
              + ", ".join(f"{k + 1}: {v:.2f}" for k, v in shares.items())
              + "; passing rollouts: " + (", ".join(f"{k + 1}: {v:.2f}" for k, v in passing.items()) or "none"))


if __name__ == "__main__":
    main(sys.argv[1:])
