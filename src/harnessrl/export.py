"""A run's training data in OpenEnv's format: `harnessrl export RUN_DIR --format openenv --out DIR`.

Responsibility: turn each rollout of `RUN_DIR/rollouts.jsonl` into OpenEnv's own training-trace
record (`openenv.core.harness.TrainingTrace`, schema_version 1, serialised with its pydantic
model so OpenEnv's validation runs on every turn), so tools built for that format can consume a
harnessrl run.

What is written (one file per rollout, plus an index):
  * `DIR/<rollout_id>.json`: a `TrainingTrace` whose turns are the rollout's training rows
    exactly as `harnessrl train` builds them (`train/samples.build_rows` with the run's
    `[train]` settings and row hooks). Row i is `TrainingTurn(node_id="<rollout_id>/row<i>")`:
    `prompt_token_ids` = the row's tokens before its first trained token (all context),
    `completion_token_ids` = the rest, `loss_mask` = the row's completion mask over both (0 on
    the prompt, 1 on trained tokens, 0 on context inside the completion part: tool results,
    turns kept as context), `per_token_logps` = the engine's sampling logprobs (0.0 where the
    mask is 0). Turn `metadata`: `rollout_id`, `group_id`, `task_id`, `harness`, `status`,
    `reward` (the verifier's; None = unscored, never 0.0), `train_reward` (after shaping, if
    any), `policy_versions` (per completion position, -1 where the mask is 0). A rollout
    with no trainable row (an error, every turn unfaithful) has `turns: []`.
  * `DIR/index.jsonl`: one line per rollout: `rollout_id`, `file`, `group_id`, `task_id`,
    `status`, `reward`, `train_reward`, `rows`, `tokens_trained`.

Round trip: `load_openenv_export(DIR)` reads the files back with OpenEnv's own model
(`TrainingTrace.model_validate_json`); `prompt_token_ids + completion_token_ids` and
`loss_mask` equal the row's `input_ids` and `completion_mask`.

Errors: `ConfigError` when `openenv` is not installed (`pip install harnessrl[openenv]`), the
run directory has no `rollouts.jsonl`, or the format is unknown.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harnessrl.errors import ConfigError
from harnessrl.hooks import load_hooks
from harnessrl.jsonl import read_jsonl
from harnessrl.train.samples import build_rows
from harnessrl.types import Rollout
from harnessrl.view.detail import run_build_kwargs
from harnessrl.view.index import load_run_config

log = logging.getLogger(__name__)

FORMATS = ("openenv",)


@dataclass(frozen=True, slots=True)
class ExportReport:
    rollouts: int
    """Rollouts written (one file each)."""
    rows: int
    """Training rows written (TrainingTurns), over all rollouts."""
    tokens_trained: int
    """Positions with loss_mask 1, over all rollouts."""
    skipped_lines: int
    """Lines of rollouts.jsonl that did not parse as a rollout (torn, garbage)."""


def _openenv_types() -> tuple[Any, Any]:
    try:
        from openenv.core.harness import TrainingTrace, TrainingTurn  # lazy: openenv, heavy; not needed at import
    except ImportError as exc:
        raise ConfigError("--format openenv needs the openenv package: pip install 'harnessrl[openenv]' "
                          f"({exc})") from None
    return TrainingTrace, TrainingTurn


def export_run(run_dir: Path, out_dir: Path, fmt: str = "openenv") -> ExportReport:
    """Write every rollout of `run_dir` into `out_dir` in `fmt` (module docstring).

    Raises:
        ConfigError: unknown format, `openenv` missing, not a run directory, hooks that do
            not import.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")

    training_trace, training_turn = _openenv_types()
    cfg = load_run_config(run_dir)  # ConfigError without rollouts.jsonl
    kwargs = run_build_kwargs(cfg, load_hooks(cfg.hooks))
    read = read_jsonl(run_dir / "rollouts.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    skipped = len(read.bad_lines)
    n_rollouts = n_rows = n_trained = 0
    with (out_dir / "index.jsonl").open("w", encoding="utf-8") as index:
        for obj in read.rows:
            try:
                rollout = Rollout.model_validate(obj)
            except ValidationError as exc:
                skipped += 1
                log.warning("skipping a rollout that does not load: %s", str(exc).splitlines()[0])
                continue
            rows, _ = build_rows(rollout, **kwargs)
            meta = {"rollout_id": rollout.rollout_id, "group_id": rollout.group_id, "task_id": rollout.task_id,
                    "harness": rollout.harness, "status": rollout.status, "reward": rollout.reward,
                    "train_reward": rollout.train_reward}
            turns = [training_turn(**_row_fields(row, i, meta)) for i, row in enumerate(rows)]
            trace = training_trace(turns=turns)
            name = f"{_safe(rollout.rollout_id)}.json"
            (out_dir / name).write_text(trace.model_dump_json(), encoding="utf-8")
            trained = sum(row.num_trained_tokens for row in rows)
            index.write(json.dumps({**{k: meta[k] for k in ("rollout_id", "group_id", "task_id", "status",
                                                           "reward", "train_reward")},
                                    "file": name, "rows": len(rows), "tokens_trained": trained}) + "\n")
            n_rollouts, n_rows, n_trained = n_rollouts + 1, n_rows + len(rows), n_trained + trained
    return ExportReport(rollouts=n_rollouts, rows=n_rows, tokens_trained=n_trained, skipped_lines=skipped)


def _row_fields(row: Any, i: int, meta: dict[str, Any]) -> dict[str, Any]:
    first = row.completion_mask.index(1)  # build_rows keeps only rows with a trained token
    return {
        "node_id": f"{meta['rollout_id']}/row{i}",
        "prompt_token_ids": list(row.input_ids[:first]),
        "completion_token_ids": list(row.input_ids[first:]),
        "per_token_logps": [float(x) for x in row.sampler_logprobs[first:]],
        "loss_mask": list(row.completion_mask),
        "metadata": {**meta, "policy_versions": list(row.policy_versions[first:])},
    }


def load_openenv_export(out_dir: Path) -> dict[str, Any]:
    """Read an export back with OpenEnv's model: `{rollout_id: TrainingTrace}`, in index order.

    Raises:
        ConfigError: `openenv` missing or `out_dir` has no `index.jsonl`.
        pydantic.ValidationError: a file that OpenEnv's model rejects.
    """
    training_trace, _ = _openenv_types()
    index = out_dir / "index.jsonl"
    if not index.is_file():
        raise ConfigError(f"{out_dir} is not an export: it has no index.jsonl")
    traces = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        traces[entry["rollout_id"]] = training_trace.model_validate_json((out_dir / entry["file"]).read_text("utf-8"))
    return traces


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "rollout"
