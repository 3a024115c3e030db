"""The time-to-accuracy benchmark (`bench/async_learning.py`) and the learning benchmark's seed
and per-arm process handling (`bench/learning.py`): their arithmetic and command lines, on fake
arm results, without training."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import async_learning as al  # noqa: E402
import learning  # noqa: E402


def _result(sampled: float, train_s: float, curve: list[list[float]], clip: float = 0.0, greedy: float = 1.0) -> dict:
    return {"held_out": {"pass": greedy, "sampled_pass": sampled}, "train_s": train_s, "wall_s": train_s + 10,
            "curve": curve, "clip_max": clip, "loss": "proximal", "peak_rss_gb": 3.0, "load": [1.0, 2.0],
            "probe": []}


def test_cumulative_times_sum_the_step_times_in_step_order() -> None:
    history = [{"step": 0, "eval/pass_rate": 0.5}, {"step": 2, "time/step_s": 20.0}, {"step": 1, "time/step_s": 15.5},
               {"step": 3, "time/step_s": math.nan}, {"step": 4}, {"step": 5, "time/step_s": 4.5}]
    assert al.cumulative_times(history) == {1: 15.5, 2: 35.5, 3: 35.5, 4: 35.5, 5: 40.0}


def test_time_to_is_the_first_checkpoint_at_or_above_the_target() -> None:
    curve = [[6, 90.0, 0.80], [2, 30.0, 0.50], [4, 60.0, 0.8125]]
    assert al.time_to(curve, 0.8125) == 60.0
    assert al.time_to(curve, 0.80) == 60.0  # step 4 comes before step 6
    assert al.time_to(curve, 0.5) == 30.0
    assert al.time_to(curve, 0.9) is None
    assert al.time_to([[2, 10.0, 26 / 32]], 0.8125) == 10.0  # the same fraction, computed otherwise


def test_time_to_sync_and_the_goals() -> None:
    results = {
        "sync": _result(0.85, 100.0, [[2, 30.0, 0.6], [4, 65.0, 0.8], [6, 100.0, 0.85]]),
        "async-1": _result(0.83, 70.0, [[2, 20.0, 0.7], [4, 45.0, 0.86], [6, 70.0, 0.83]], clip=0.01),
        "async-1-behaviour": _result(0.50, 80.0, [[2, 25.0, 0.4], [4, 50.0, 0.45], [6, 80.0, 0.50]], clip=0.05),
        "async-4": _result(0.805, 50.0, [[2, 15.0, 0.7], [4, 33.0, 0.8], [6, 50.0, 0.805]]),
        "trl": _result(0.80, 250.0, [[6, 250.0, 0.80]]),
    }
    al.add_time_to_sync(results)
    assert (results["sync"]["time_to_sync"], results["sync"]["ratio_to_sync"]) == (100.0, 1.0)
    assert (results["async-1"]["time_to_sync"], results["async-1"]["ratio_to_sync"]) == (45.0, 0.45)
    assert (results["async-1-behaviour"]["time_to_sync"], results["async-1-behaviour"]["ratio_to_sync"]) == (None, None)
    assert results["trl"]["time_to_sync"] is None and results["async-4"]["time_to_sync"] is None
    sync, trl = results["sync"], results["trl"]
    # (a) 0.83 is within 3 points of 0.85; (b) 45 <= 60; (c) 0.83 >= 0.80 and 70 <= 100; (d) 1% clipped
    assert al.goals("async-1", results["async-1"], sync, trl) == {"a": True, "b": True, "c": True, "d": True}
    assert al.goals("async-1-behaviour", results["async-1-behaviour"], sync, trl) == {
        "a": False, "b": False, "c": False, "d": False}
    # staleness 4 is allowed 5 points: 0.805 >= 0.80; never reached sync's accuracy
    assert al.goals("async-4", results["async-4"], sync, trl) == {"a": True, "b": False, "c": True, "d": True}
    assert al.goals("async-1", results["async-1"], None, None) == {"a": None, "b": None, "c": None, "d": True}
    assert al.goals("trl", trl, sync, trl) == {"a": None, "b": None, "c": None, "d": None}
    assert al.goals("sync", sync, sync, trl) == {"a": None, "b": None, "c": None, "d": None}
    # 60% and 40% are inclusive
    edge = _result(0.82, 100.0, [[6, 60.0, 0.85]])
    al.add_time_to_sync({"sync": sync, "x": edge})
    assert al.goals("async-2", edge, sync, _result(0.5, 250.0, [])) == {"a": True, "b": True, "c": True, "d": True}
    worse = al.goals("async-2", {**edge, "clip_max": 0.0201}, sync, _result(0.5, 249.0, []))
    assert (worse["c"], worse["d"]) == (False, False)  # 100 s > 0.40 x 249 s; 2.01% clipped


def test_max_clip_reads_the_updating_steps() -> None:
    history = [{"step": 1, "loss": 0.1, "clip_low_frac": 0.01, "clip_high_frac": 0.015},
               {"step": 2, "skipped": 1.0, "clip_low_frac": 0.5}, {"step": 3, "loss": 0.2, "clip_high_frac": 0.002}]
    assert al.max_clip(history) == pytest.approx(0.025)
    assert al.max_clip([{"step": 1, "skipped": 1.0}]) == 0.0


def test_probe_assigns_each_steps_groups_in_file_order(tmp_path: Path) -> None:
    def rollout(group: int, versions: list[int], reward: float) -> str:
        return json.dumps({"group_id": group, "reward": reward,
                           "trace": {"turns": [{"policy_version": v} for v in versions]}})

    lines = [rollout(0, [0], 1.0), rollout(0, [0], 0.0), rollout(1, [0], 1.0), rollout(1, [0, 1], 1.0),
             rollout(3, [1], 0.0), rollout(3, [1], 1.0), rollout(2, [0], 0.0), rollout(2, [1, 1], 0.0)]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    history = [{"step": 2, "staleness_mean": 0.5, "staleness_max": 1.0, "ratio_abs_dev": 0.02, "clip_low_frac": 0.0,
                "clip_high_frac": 0.01}, {"step": 1, "staleness_mean": 0.0}]
    rows = al.probe(history, tmp_path / "rollouts.jsonl", groups_per_step=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert (rows[0]["groups"], rows[0]["versions"], rows[0]["spanning"], rows[0]["spanning_reward_mean"]) == (
        [0, 1], [[0], [0, 1]], 1, [1.0])  # group 1's second rollout took a turn from version 1
    assert (rows[1]["groups"], rows[1]["versions"], rows[1]["spanning"], rows[1]["spanning_reward_mean"]) == (
        [3, 2], [[1], [0, 1]], 1, [0.0])
    assert rows[1]["clip_high_frac"] == 0.01 and math.isnan(rows[0]["ratio_abs_dev"])


def test_command_line_defaults_and_refusals() -> None:
    own, bench = al.parse_args(["--task", "lookup", "--steps", "6", "--lr", "5e-5", "--seeds", "0,1,2",
                                "--arms", "sync,async-1-behaviour", "--eval-prompts", "32"])
    assert (own.seeds, own.arms, own.eval_every) == ([0, 1, 2], ["sync", "async-1-behaviour"], 2)
    assert (bench.task, bench.steps, bench.lr, bench.eval_prompts, bench.dynamic_sampling) == ("lookup", 6, 5e-5, 32, 0)
    own, bench = al.parse_args(["--dynamic-sampling", "6"])
    assert (own.arms, bench.dynamic_sampling, bench.eval_prompts, bench.task) == (list(al.DEFAULT_ARMS), 6, 64, "larger")
    for bad in (["--arms", "sync,async-3"], ["--max-staleness", "1"], ["--eval-every", "0"], ["--arms", ","]):
        with pytest.raises(SystemExit):
            al.parse_args(bad)
    assert al.ARMS["async-1-behaviour"] == al.Arm(1, ("train.loss.clip_center=behaviour",))
    assert [al.ARMS[a].max_staleness for a in ("sync", "async-1", "async-2", "async-4")] == [0, 1, 2, 4]  # type: ignore[union-attr]


def test_the_behaviour_arm_runs_on_code_with_or_without_the_clip_center_key() -> None:
    label, sets = al.loss_label(("train.loss.clip_center=behaviour",), [])
    from harnessrl.config import load_config

    if "clip_center" in load_config(None, []).train.loss.model_dump():
        assert (label, sets) == ("behaviour", ("train.loss.clip_center=behaviour",))
        assert al.loss_label((), [])[0] == "proximal"
    else:
        assert sets == () and label.startswith("ppo_clip")
    from harnessrl.errors import ConfigError

    with pytest.raises(ConfigError):
        al.loss_label((), ["train.loss.no_such_key=1"])


def test_one_seed_runs_that_seed_and_each_arm_gets_its_own_process(tmp_path: Path) -> None:
    """`--seeds 3` alone ran seed 0 and filed it under 3; each arm's child gets `--arm-only`."""
    args = learning.parse_args(["--seeds", "3"])
    seeds = args.seeds or [args.seed]
    assert seeds == [3]
    child = learning.child_argv(["--task", "lookup", "--arm-only", "trl", "--seed=1", "--seeds", "0,1"], 2,
                                tmp_path / "a", None)
    assert child == ["--task", "lookup", "--seed", "2", "--out", str(tmp_path / "a")]
    assert learning.parse_args([*child, "--arm-only", "harnessrl"]).arm_only == "harnessrl"
    assert learning.jsonable([{"step": 1, "x": 0.5, "s": "a", "bad": [1]}]) == [{"step": 1, "x": 0.5, "s": "a"}]
    assert learning.peak_rss_gb() > 0.01


def test_one_seed_is_the_seed_side_by_side_runs(tmp_path: Path, tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    seen: list[int] = []

    def fake_side_by_side(args, model_dir, base, out):  # noqa: ANN001, ANN202
        seen.append(args.seed)
        return {"held_out": {"base": base}, "train_s": {}}

    monkeypatch.setattr(learning, "side_by_side", fake_side_by_side)
    monkeypatch.setattr(learning, "evaluate", lambda *a: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    (tmp_path / "base.json").write_text(json.dumps({"pass": 0.5}))
    monkeypatch.setattr(sys, "argv", ["learning.py", "--seeds", "3", "--out", str(tmp_path / "o"), "--model",
                                      str(tiny_model_dir), "--base-scores", str(tmp_path / "base.json")])
    learning.main()
    assert seen == [3]
    assert list(json.loads((tmp_path / "o" / "learning.json").read_text())["seeds"]) == ["3"]


def test_report_reads_an_out_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for arm, r in {"sync": _result(0.85, 100.0, [[2, 40.0, 0.7], [4, 100.0, 0.85]]),
                   "async-1": {**_result(0.86, 80.0, [[2, 35.0, 0.86], [4, 80.0, 0.86]]), "probe": [
                       {"step": 2, "staleness_mean": 0.5, "staleness_max": 1.0, "ratio_abs_dev": 0.03,
                        "clip_low_frac": 0.001, "clip_high_frac": 0.002, "groups": [3, 2], "versions": [[1], [0, 1]],
                        "spanning": 1, "spanning_reward_mean": [0.25], "skipped": False,
                        "lag/mismatch_kl": 0.04}]}}.items():
        (tmp_path / "seed-1" / arm).mkdir(parents=True)
        (tmp_path / "seed-1" / arm / "arm.json").write_text(json.dumps(r))
    runs = al.report(tmp_path)
    assert runs[1]["async-1"]["time_to_sync"] == 35.0 and runs[1]["async-1"]["ratio_to_sync"] == 0.35
    assert runs[1]["async-1"]["goals"] == {"a": True, "b": True, "c": None, "d": True}
    text = capsys.readouterr().out
    assert "seed 1: sync's final sampled pass 85.0% in 100 s" in text and "0.35" in text
    assert "sync                   1  100.0%   85.0%     100   1.00  - - - -" in text
    assert "async-1                1  100.0%   86.0%      80   0.35  1/1 1/1 - 1/1" in text
    assert "    2  nan 0.50/1   3.00e-02 0.0010/0.0020  0.04 / nan / nan / nan / nan  3[1] 2[0, 1]  0.25" in text
