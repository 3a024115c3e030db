"""Held-out evaluation during training (`train/evaluation.py`), the run's curve (`train/plot.py`)
and the training-only sampling check; the e2e test runs a real 2-step train with eval_every=1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from PIL import Image

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.runtime import make_task_source
from harnessrl.tasks.base import Task
from harnessrl.train.evaluation import eval_metrics, held_out_split
from harnessrl.train.plot import SERIES, SIZE_PX, curve_figure, curve_points, curve_table, write_curve_png
from harnessrl.train.run import run as train
from harnessrl.train.setup import check_training
from harnessrl.types import Group, Rollout, Trace


def test_procedural_held_out_tasks_are_never_training_tasks() -> None:
    cfg = load_config(None, ['tasks.kinds=["compare"]']).tasks
    source = make_task_source(cfg)
    train_src, eval_src = held_out_split(cfg, source, 16)
    assert len(eval_src) == 16
    train_ids = {train_src.get(s).task_id for s in range(len(source))}
    eval_ids = [eval_src.get(s).task_id for s in range(16)]
    assert len(set(eval_ids)) == 16 and not train_ids & set(eval_ids)
    assert all(t.startswith("procedural/compare/") for t in eval_ids)
    # the same family and instruction form
    assert "answer.txt" in eval_src.get(0).instruction


class _ListSource:
    def __init__(self, n: int) -> None:
        self.tasks = [Task(task_id=f"t{i}", family="x", instruction="i") for i in range(n)]

    def __len__(self) -> int:
        return len(self.tasks)

    def get(self, seed: int) -> Task:
        return self.tasks[seed % len(self.tasks)]


def test_other_sources_hold_out_their_last_tasks() -> None:
    cfg = load_config(None, ['tasks.kind="humaneval"']).tasks
    train_src, eval_src = held_out_split(cfg, _ListSource(10), 3)
    assert [train_src.get(s).task_id for s in range(9)] == [f"t{i}" for i in range(7)] + ["t0", "t1"]
    assert [eval_src.get(s).task_id for s in range(3)] == ["t7", "t8", "t9"]
    with pytest.raises(ConfigError, match="train.eval_size = 10 leaves no training task"):
        held_out_split(cfg, _ListSource(10), 10)


def _rollout(group: int, i: int, status: str, reward: float | None) -> Rollout:
    return Rollout(rollout_id=f"r{group}-{i}", group_id=group, task_id=f"t{group}", harness="h", status=status,
                   reward=reward, trace=Trace(session_id=f"s{group}-{i}"))


def test_eval_metrics_count_errors_apart_from_wrong_answers() -> None:
    groups = [Group(group_id=0, task_id="t0", rollouts=[_rollout(0, 0, "ok", 1.0), _rollout(0, 1, "ok", 0.0)]),
              Group(group_id=1, task_id="t1", rollouts=[_rollout(1, 0, "ok", 0.0), _rollout(1, 1, "agent_error", None)])]
    m = eval_metrics(groups, 2.5)
    assert m["eval/pass_rate"] == pytest.approx(1 / 3)  # errors are not wrong answers
    assert m["eval/error_rate"] == 0.25 and m["eval/errors"] == 1.0
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/k"] == 1.0 and m["eval/pass_at_k"] == m["eval/pass@1"]  # k limited by the 1 scored of t1
    assert m["eval/reward_mean"] == pytest.approx(1 / 3) and m["eval/tasks"] == 2.0 and m["eval/s"] == 2.5


def test_training_refuses_truncated_sampling() -> None:
    for override in ("sampling.top_p=0.5", "sampling.top_k=5"):
        with pytest.raises(ConfigError, match="training needs top_p = 1 and top_k = 0"):
            check_training(load_config(None, [override]))
    check_training(load_config(None, ["sampling.temperature=0.5"]))  # a lower temperature is exact


HISTORY = [{"step": 0, "policy_version": 0, "eval/pass_rate": 0.25},
           {"step": 1, "reward/verifier_mean": 0.25, "reward/train_mean": 0.5},
           {"step": 2, "reward/verifier_mean": 0.5, "reward/train_mean": 0.625, "eval/pass_rate": 0.5},
           {"step": 3, "reward/verifier_mean": 0.75, "reward/train_mean": 0.75, "eval/pass_rate": 0.75}]


def test_curve_png_draws_each_series(tmp_path: Path) -> None:
    history = [*HISTORY, {"step": 3, "eval/tasks": 16.0, "eval/k": 4.0, "eval/pass_at_k": 0.9}]
    title = "harnessrl train: mini-swe-agent on procedural (smollm2-135m)"
    path = write_curve_png(history, tmp_path / "curve.png", title=title, tasks_per_step=2)
    assert path == tmp_path / "curve.png"
    img = Image.open(path)
    img.load()  # decodes
    assert img.format == "PNG" and img.size == SIZE_PX == (800, 450)
    assert 20_000 < path.stat().st_size < 200_000
    colours = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
    for _, _, hex_colour in SERIES:
        assert tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) in colours, hex_colour
    fig = curve_figure(history, title, tasks_per_step=2)
    (ax,) = fig.axes
    assert ax.get_title() == title  # matplotlib text: the word spaces kept
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "verifier reward (2 tasks/step)", "train reward (shaped) (2 tasks/step)",
        "held-out pass rate (16 tasks)", "held-out pass@4 (16 tasks)"]
    one_step = curve_figure([{"step": 1, "reward/verifier_mean": 0.25}], title, tasks_per_step=2)
    ticks = [t for t in one_step.axes[0].get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)  # a one-step run: whole steps only
    assert write_curve_png([{"step": 1, "skipped": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_curve_points_and_table() -> None:
    points = curve_points(HISTORY)
    assert points["eval/pass_rate"] == [(0, 0.25), (2, 0.5), (3, 0.75)]
    assert points["reward/verifier_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    same = [{"step": 1, "reward/verifier_mean": 0.5, "reward/train_mean": 0.5}]
    assert curve_points(same)["reward/train_mean"] == []  # no shaping: one line, not two
    one = [{"step": 0, "eval/pass_rate": 0.5, "eval/k": 1.0, "eval/pass_at_k": 0.5}]
    assert curve_points(one)["eval/pass_at_k"] == []  # pass@1: the pass rate again
    lines = curve_table(HISTORY).splitlines()
    assert lines[0].split()[:4] == ["step", "verifier", "train", "eval"]
    assert lines[1].split() == ["0", "-", "-", "0.25"]
    assert lines[4].split() == ["3", "0.75", "0.75", "0.75", "#" * 15]
    long = [{"step": s, "reward/verifier_mean": 0.1} for s in range(1, 101)]
    assert len(curve_table(long, max_rows=10).splitlines()) <= 12


@pytest.mark.e2e
def test_a_real_run_evaluates_before_and_after_and_draws_its_curve(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2", "sampling.max_tokens=8",
        "train.steps=2", "train.learning_rate=1e-3", "train.eval_every=2", "train.eval_size=2",
        'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
        f'sandbox.root_dir="{tmp_path / "sandboxes"}"'])
    run_dir = tmp_path / "run"
    history = asyncio.run(train(cfg, run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] == [h["step"] for h in history]
    assert rows[0]["policy_version"] == 0 and "loss" not in rows[0]
    for r in (rows[0], rows[2]):
        assert r["eval/tasks"] == 2.0 and 0.0 <= r["eval/pass_rate"] <= 1.0 and r["eval/k"] == 2.0
        assert r["eval/error_rate"] == 0.0
    assert "eval/pass_rate" not in rows[1]
    for k in (0, 2):
        lines = (run_dir / "eval" / f"step-{k}" / "rollouts.jsonl").read_text().splitlines()
        ids = {json.loads(line)["task_id"] for line in lines}
        assert len(lines) == 4 and len(ids) == 2
        train_ids = {json.loads(line)["task_id"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()}
        assert not ids & train_ids
    assert Image.open(run_dir / "curve.png").format == "PNG"
