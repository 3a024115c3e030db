"""Index of a run directory: byte offsets into `rollouts.jsonl` and a summary per rollout.

Responsibility: open a run of thousands of rollouts without holding them: one pass over
`rollouts.jsonl` records where each line starts and ends and a few fields of it (ids, task,
status, reward, turns, tokens, step, advantage); a rollout is read back later by its offsets
(`RunIndex.read`). Metrics come from `metrics.jsonl` as written (whatever keys it holds), the
trained tokens' loss weights from `token_weights.jsonl` (`loss/token_weights.py`).

Step of a rollout: `harnessrl train` writes a step's groups together, `groups_per_step` groups a
step, in order; the k-th distinct group of the file is in step `k // groups_per_step + 1`. A run
without `metrics.jsonl` (`harnessrl rollout`) has no steps (`step` is None).

Advantage: the rollout's group-relative advantage, from the run's `[train] advantage` on the
rewards the trainer used: the rollout's recorded `train_reward`; for records without one, the
config's `[hooks] rollout_reward_fn` applied again (a hook with state, e.g. a counter, then gives
other values than it gave the trainer), else the verifier's reward.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from harnessrl.config import RunConfig, load_config
from harnessrl.errors import ConfigError
from harnessrl.hooks import load_hooks, reshape_reward
from harnessrl.jsonl import read_jsonl
from harnessrl.loss.advantages import advantage_fn_for
from harnessrl.loss.token_weights import TokenWeightRecord, read_token_weights
from harnessrl.train.plot import curve_png
from harnessrl.types import Rollout

log = logging.getLogger(__name__)

MAX_WARNINGS = 3
"""Unreadable lines reported one by one; the rest are counted."""


@dataclass(slots=True)
class RunIndex:
    """What `build_index` found in a run directory."""

    run_dir: Path
    cfg: RunConfig
    summaries: list[dict[str, Any]]
    """One per readable rollout line, in file order: `i`, `offset`, `length` (bytes),
    `rollout_id`, `group_id`, `task_id`, `harness`, `status`, `reward` (verifier),
    `train_reward` (after the reward hook), `advantage`, `step`, `turns`, `error_turns`,
    `unfaithful_turns`, `prompt_tokens` (last turn), `completion_tokens` (all turns)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """`metrics.jsonl` records, unchanged."""
    bad_lines: int = 0
    """Lines of `rollouts.jsonl` that do not parse (torn or garbage), skipped."""
    token_weights: dict[str, list[TokenWeightRecord]] = field(default_factory=dict)
    """`token_weights.jsonl` records by rollout id (`loss/token_weights.py`; empty without the
    file): each trained row's per-token loss weights and clip / bound flags."""

    def read(self, i: int) -> Rollout:
        """Rollout number `i` (its summary's `i`), read by its byte offsets.

        Raises:
            IndexError: no rollout `i` in the index.
        """
        if not 0 <= i < len(self.summaries):
            raise IndexError(f"rollout {i} is not in the index (0..{len(self.summaries) - 1})")
        s = self.summaries[i]
        with (self.run_dir / "rollouts.jsonl").open("rb") as fh:
            fh.seek(s["offset"])
            return Rollout.model_validate_json(fh.read(s["length"]))


VIEW_KEYS = (("engine", "model"), ("train", "groups_per_step"), ("train", "advantage"),
             ("train", "train_auxiliary"), ("hooks", "agent_turn_fn"), ("hooks", "train_turn_fn"),
             ("hooks", "rollout_reward_fn"))
"""Settings the viewer needs, kept from a `config.toml` that no longer validates."""


def load_run_config(run_dir: Path) -> RunConfig:
    """The run's `config.toml` (defaults when it has none). A config written by another
    version of harnessrl (unknown or renamed keys) still opens: the settings the viewer needs
    (`VIEW_KEYS`) are taken from it, with a warning naming what was ignored.

    Raises:
        ConfigError: `run_dir` has no `rollouts.jsonl`, or a needed setting is invalid.
    """
    if not (run_dir / "rollouts.jsonl").is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no rollouts.jsonl")
    path = run_dir / "config.toml"
    if not path.is_file():
        return load_config(None)
    try:
        return load_config(path)
    except ConfigError as exc:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            raise exc from None
        kept = [f"{a}.{b}={json.dumps(data[a][b])}" for a, b in VIEW_KEYS
                if isinstance(data.get(a), dict) and b in data[a] and data[a][b] is not None]
        log.warning("%s does not load with this version (%s); using its %s and defaults", path, exc,
                    ", ".join(k.split("=", 1)[0] for k in kept))
        return load_config(None, kept)


def build_index(run_dir: Path, cfg: RunConfig | None = None) -> RunIndex:
    """Scan `run_dir/rollouts.jsonl` once (see the module docstring).

    Raises:
        ConfigError: not a run directory, or its config / reward hook does not load.
    """
    run_dir = Path(run_dir)
    cfg = cfg or load_run_config(run_dir)
    reward_fn = None
    try:
        reward_fn = load_hooks(cfg.hooks).rollout_reward_fn
    except ConfigError as exc:  # only needed for records without train_reward
        log.warning("the run's reward hook does not load (%s): rewards without train_reward use the verifier's", exc)
    metrics_path = run_dir / "metrics.jsonl"
    metrics = read_jsonl(metrics_path).rows if metrics_path.is_file() else []
    summaries: list[dict[str, Any]] = []
    bad = 0
    group_order: OrderedDict[int, list[int]] = OrderedDict()
    with (run_dir / "rollouts.jsonl").open("rb") as fh:
        offset = 0
        for line in fh:
            start, offset = offset, offset + len(line)
            body = line.rstrip(b"\r\n")
            if not body.strip():
                continue
            try:
                d = orjson.loads(body)
                turns = d["trace"]["turns"]
                summary = {
                    "i": len(summaries), "offset": start, "length": len(body),
                    "rollout_id": str(d["rollout_id"]), "group_id": int(d["group_id"]),
                    "task_id": str(d.get("task_id", "")), "harness": str(d.get("harness", "")),
                    "status": str(d.get("status", "")), "reward": d.get("reward"),
                    "turns": len(turns),
                    "error_turns": sum(t.get("status") == "error" for t in turns),
                    "unfaithful_turns": sum(t.get("status") == "unfaithful" for t in turns),
                    "prompt_tokens": len(turns[-1].get("prompt_ids", ())) if turns else 0,
                    "completion_tokens": sum(len(t.get("completion_ids", ())) for t in turns),
                }
                if "train_reward" in d:  # the reward the trainer used, as it recorded it
                    summary["train_reward"] = d["train_reward"]
                elif reward_fn is not None:  # older records: shaped again here
                    summary["train_reward"] = reshape_reward(Rollout.model_validate(d), reward_fn).reward
                else:
                    summary["train_reward"] = summary["reward"]
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                bad += 1
                if bad <= MAX_WARNINGS:
                    log.warning("rollouts.jsonl: skipped an unreadable line at byte %d (%s)", start,
                                str(exc).splitlines()[0])
                continue
            group_order.setdefault(summary["group_id"], []).append(summary["i"])
            summaries.append(summary)
    advantage_fn = advantage_fn_for(cfg.train.advantage)
    per_step = cfg.train.groups_per_step
    for k, members in enumerate(group_order.values()):
        adv = advantage_fn([_finite(summaries[i]["train_reward"]) for i in members])
        for i, a in zip(members, adv.advantages_G):
            summaries[i]["advantage"] = None if a is None or adv.zero_variance else float(a)
            summaries[i]["step"] = k // per_step + 1 if metrics else None
    if bad > MAX_WARNINGS:
        log.warning("rollouts.jsonl: %d unreadable lines skipped in all", bad)
    return RunIndex(run_dir, cfg, summaries, metrics, bad, read_token_weights(run_dir))


def _finite(reward: object) -> float | None:
    """`reward` when it is a finite number, else None (unscored, as the trainer counts it: a
    record may hold `"NaN"` from before the runner refused non-finite verdicts)."""
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward):
        return float(reward)
    return None


def index_json(index: RunIndex) -> dict[str, Any]:
    """The page's index payload: summaries without offsets, metrics, run facts, and the run's
    curve as `train` draws it (`train/plot.curve_png`, base64 PNG; None without metrics)."""
    keep = [{k: v for k, v in s.items() if k not in ("offset", "length")} for s in index.summaries]
    cfg = index.cfg
    png = curve_png(index.metrics, f"harnessrl train: {cfg.harness.kind} on {cfg.tasks.kind} ({cfg.engine.model})",
                    tasks_per_step=cfg.train.groups_per_step)
    return {
        "run_dir": str(index.run_dir), "model": cfg.engine.model, "harness": cfg.harness.kind,
        "rollouts": keep, "metrics": index.metrics, "bad_lines": index.bad_lines,
        "curve_png": base64.b64encode(png).decode() if png else None,
    }
