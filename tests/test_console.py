"""The training console: step lines (1-based, a skipped step says why) and a final table that
fits 80 columns."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console

from harnessrl.train.console import (FINAL_COLUMNS, bound_line, final_table, late_groups, rows_line, skip_reason,
                                     step_line)


def test_a_step_that_trains_nothing_says_why() -> None:
    m = {"policy_version": 1, "reward/verifier_mean": 0.0, "reward/verifier_std": 0.0, "pass_rate": 0.0, "error_rate": 0.25,
         "skipped": 1.0, "rows_built": 4.0, "rows_zero_variance_dropped": 4.0, "rows_stale_dropped": 0.0,
         "time/rollout_wait_s": 3.0, "time/train_s": 0.0, "time/sync_s": 0.0}
    m["skip_reason"] = skip_reason(m)
    line = step_line(3, 3, m)
    assert line.startswith("step 3/3 v1 reward 0.000±0.000 train - pass 0.00 err 0.25 ")
    assert "no update: all rewards equal within each group;" in line
    assert "loss" not in line and "nan" not in line


def test_a_step_the_train_turn_fn_emptied_names_it() -> None:
    """Every turn kept as context by the hook: the step says so (before: "no trainable turn (no
    rollout has a sampled token to train)")."""
    m = {"rows_built": 0.0, "samples/num_rejected_by_hook": 6.0}
    assert skip_reason(m) == "no trainable turn: hooks.train_turn_fn kept 6 turns as context only"


def test_skip_reasons() -> None:
    assert skip_reason({"rows_built": 0.0}).startswith("no trainable turn")
    assert skip_reason({"rows_built": 3.0, "rows_stale_dropped": 3.0}).startswith("all rows stale")
    assert skip_reason({"rows_built": 2.0, "rows_unscored_dropped": 2.0}).startswith("no scored rollout")
    mixed = skip_reason({"rows_built": 5.0, "rows_zero_variance_dropped": 3.0, "rows_stale_dropped": 2.0})
    assert mixed == "rows dropped: 3 all rewards equal within each group, 2 all rows stale"


def test_a_trained_step_line_shows_the_loss() -> None:
    m = {"policy_version": 2, "reward/verifier_mean": 0.5, "reward/verifier_std": 0.5, "pass_rate": 0.5, "error_rate": 0.0,
         "loss": 0.01234, "grad_norm": 0.5, "ratio_abs_dev": 1e-5, "tokens_trained": 321, "staleness_mean": 0.5,
         "time/rollout_wait_s": 1.0, "time/train_s": 2.0, "time/sync_s": 0.1}
    line = step_line(2, 3, m)
    assert "step 2/3 v2" in line and "loss 0.0123 gnorm 0.500 |r-1| 1.00e-05 tok 321 stale 0.50" in line


def test_final_table_headers_fit_80_columns() -> None:
    row = {"step": 12, "policy_version": 11, "reward/verifier_mean": 0.123, "pass_rate": 0.25, "error_rate": 0.125,
           "loss": -0.01234, "grad_norm": 12.345, "ratio_abs_dev": 1.234e-5, "tokens_trained": 12345,
           "rows_stale_dropped": 3, "time/step_s": 143.2}
    skipped = {**row, "step": 13, "skipped": 1.0, "loss": None, "grad_norm": None}
    console = Console(width=80, record=True, force_terminal=False)
    console.print(final_table([row, skipped]))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "reward" in line)
    assert header.split() == list(FINAL_COLUMNS), header
    body = [line.split() for line in lines if line.strip().startswith(("12 ", "13 "))]
    assert body[0][:8] == ["12", "11", "0.12", "-", "0.25", "0.12", "-", "-0.0123"]
    assert body[1][7] == "skip"


def test_final_table_shows_held_out_pass_and_the_train_reward() -> None:
    before = {"step": 0, "policy_version": 0, "eval/pass_rate": 0.125}
    row = {"step": 5, "policy_version": 5, "reward/verifier_mean": 0.5, "reward/train_mean": 0.625,
           "pass_rate": 0.5, "error_rate": 0.0, "eval/pass_rate": 0.375, "loss": 0.01, "grad_norm": 1.0,
           "ratio_abs_dev": 1e-6, "tokens_trained": 100, "rows_stale_dropped": 0, "time/step_s": 10.0}
    console = Console(width=80, record=True, force_terminal=False)
    console.print(final_table([before, row]))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    body = [line.split() for line in lines if line.strip().startswith(("0 ", "5 "))]
    assert body[0][:8] == ["0", "0", "-", "-", "-", "-", "0.12", "-"]
    assert body[1][:8] == ["5", "5", "0.50", "0.62", "0.50", "0.00", "0.38", "0.0100"]
    assert "eval 0.38" in step_line(5, 5, row)


def test_bound_line_names_the_side_that_bounds_the_run() -> None:
    steps = [{"step": 1, "time/step_s": 10.0, "time/rollout_wait_s": 7.0, "time/train_s": 2.5, "time/sync_s": 0.5,
              "engine/busy_frac": 0.9, "time/loop_cpu_s": 1.0, "sandbox_s_mean": 0.05, "verify_s_mean": 0.25},
             {"step": 2, "time/step_s": 10.0, "time/rollout_wait_s": 5.0, "time/train_s": 4.5, "time/sync_s": 0.5,
              "engine/busy_frac": 0.7, "time/loop_cpu_s": 2.0, "sandbox_s_mean": 0.15, "verify_s_mean": 0.35},
             {"step": 2, "eval/pass_rate": 0.5}]  # a held-out evaluation row has no step timings
    line = bound_line(steps)
    assert line == ("bound by generation: of 20 s of steps, waiting for rollouts 60%, training 35%, weight sync 5%; "
                    "engine busy 80%; event loop CPU 1.5 s/step; sandbox start 100 ms/rollout; verify 300 ms/rollout")
    trained = [{"time/step_s": 10.0, "time/rollout_wait_s": 4.0, "time/train_s": 5.5, "time/sync_s": 0.5}]
    assert bound_line(trained).startswith("bound by training: of 10 s of steps, waiting for rollouts 40%, training 55%")
    assert bound_line([{"step": 0, "eval/pass_rate": 0.1}]) == ""


def test_bound_line_names_the_late_groups_of_an_async_run() -> None:
    """An asynchronous run bound by training: the steps after the first that waited for
    rollouts (>= 10% of the step) waited for a late group; the clause gives them, their wait,
    the slowest rollout they trained and generation's lead (max_staleness x the mean step).
    The first step (the pipeline filling), a synchronous run and a run bound by generation get
    no such clause."""
    def step(wait: float, slowest: float) -> dict[str, float]:
        return {"time/step_s": 4.0 + wait, "time/rollout_wait_s": wait, "time/train_s": 3.5, "time/sync_s": 0.5,
                "total_s_max": slowest}

    steps = [step(3.0, 2.0), step(0.0, 3.0), step(2.5, 9.4), step(0.3, 6.0), step(0.0, 5.0)]  # 0.3 < 10% of 4.3
    line = bound_line(steps, max_staleness=2)
    assert line.startswith("bound by training: of 26 s of steps, waiting for rollouts 22%")
    # steps 2-5: 2.5 s of waits on one step; mean step (4.0 + 6.5 + 4.3 + 4.0) / 4 = 4.7, lead 9.4 s
    assert line.endswith("; 1 of 4 steps after the first waited for a late group (2.5 s, 10% of the steps' time; "
                         "their slowest rollout 9.4 s, against generation's lead of ~9.4 s: max_staleness 2 x the "
                         "mean step; a larger train.max_staleness or a smaller sampling.max_tokens shortens them)")
    assert "late group" not in bound_line(steps)  # synchronous: every wait is generation
    assert "late group" not in bound_line([step(0.0, 1.0), step(0.2, 1.0)], max_staleness=2)  # none waited 10%
    assert late_groups([{"time/step_s": 0.0, "time/rollout_wait_s": 0.0}], 1.0, 2) == ""  # no wait, however short
    generation_bound = [step(6.0, 9.0), step(6.0, 9.0)]
    assert bound_line(generation_bound, max_staleness=2).startswith("bound by generation")
    assert "late group" not in bound_line(generation_bound, max_staleness=2)


def test_bound_line_says_when_other_processes_take_the_cpu() -> None:
    """This process's and the other processes' CPU per step, and the latter's share of the
    cores' time; from half of it the line says the loop ran on what they left."""
    steps = [{"time/step_s": 20.0, "time/rollout_wait_s": 2.0, "time/train_s": 17.0, "time/sync_s": 1.0,
              "time/process_cpu_s": 14.0, "time/other_cpu_s": 28.0},
             {"time/step_s": 20.0, "time/rollout_wait_s": 2.0, "time/train_s": 17.0, "time/sync_s": 1.0,
              "time/process_cpu_s": 16.0, "time/other_cpu_s": 20.0}]
    line = bound_line(steps, cores=2)
    assert line.startswith("bound by training: of 40 s of steps")
    assert "this process 15.0 CPU-s/step; other processes (agents, their commands, other jobs) 24.0 CPU-s/step " \
           "(60% of 2 cores)" in line
    assert line.endswith("other processes took most of the CPU: training and generation ran on what they left")
    light = bound_line(steps, cores=4)
    assert "24.0 CPU-s/step (30% of 4 cores)" in light
    assert "most of the CPU" not in light
    assert "other processes" not in bound_line([{k: v for k, v in m.items() if k != "time/other_cpu_s"}
                                                for m in steps], cores=2)


def test_machine_busy_seconds_counts_another_process_on_the_cores(tmp_path: Path) -> None:
    """The cores' busy time grows by what a child process burns (it is not this process's CPU),
    and the per-core lines of /proc/stat are read as proc(5) lays them out."""
    import subprocess
    import sys
    import time

    from harnessrl.train.timing import machine_busy_seconds

    before, own = machine_busy_seconds(), time.process_time()
    if before is None:
        pytest.skip("no /proc/stat here")
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)
    busy = machine_busy_seconds()
    assert busy is not None
    assert busy - before - (time.process_time() - own) >= 0.4
    stat = tmp_path / "stat"
    cores = sorted(os.sched_getaffinity(0))
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  9 9 9 9 9 9 9 9 0 0\n" + "".join(
        f"cpu{c} {tick} 0 {2 * tick} 500 7 0 0 0 0 0\n" for c in cores) + "intr 1 2 3\n")
    assert machine_busy_seconds(stat) == pytest.approx(3.0 * len(cores))


def test_rows_line_totals_the_builders_counts_over_the_steps() -> None:
    from harnessrl.hooks import Hooks
    from harnessrl.loss.advantages import advantage_fn_for
    from harnessrl.train.rows import rows_for_step
    from harnessrl.types import Group, Rollout, Trace, Turn

    def turn(i: int, prompt: list[int], completion: list[int], bridged: bool = False) -> Turn:
        return Turn(turn_index=i, request={}, prompt_ids=prompt, completion_ids=completion,
                    completion_logprobs=[-0.5] * len(completion), policy_version=0,
                    notes=["bridged_from=0"] if bridged else [])

    def rollout(rid: str, turns: list[Turn], reward: float) -> Rollout:
        return Rollout(rollout_id=rid, group_id=0, task_id="t", harness="h", status="ok", reward=reward,
                       trace=Trace(session_id=rid, turns=turns))

    p = list(range(100, 140))
    # step 1: a bridged CLEAN pair (2 + 1 trained ids) and a FORK pair (2 + 1, two rows)
    one = [rollout("a", [turn(0, p, [1, 2]), turn(1, p + [1, 2, 3], [4], bridged=True)], 1.0),
           rollout("b", [turn(0, p, [1, 2]), turn(1, p + [1, 9, 3], [4])], 0.0)]
    # step 2: one rollout of three CLEAN turns (6 + 1 + 1 trained ids) and one of a single turn (4)
    two = [rollout("c", [turn(0, p, [1, 2, 3, 4, 5, 6]), turn(1, p + [1, 2, 3, 4, 5, 6, 7], [8]),
                         turn(2, p + [1, 2, 3, 4, 5, 6, 7, 8, 9], [10])], 1.0),
           rollout("d", [turn(0, p, [1, 2, 3, 4])], 0.0)]
    history = []
    for k, rollouts in enumerate((one, two), start=1):
        batch = rows_for_step([Group(group_id=k, task_id="t", rollouts=rollouts)], hooks=Hooks(),
                              advantage_fn=advantage_fn_for("grpo"), version=0, max_staleness=1)
        history.append({"step": k, **batch.metrics})
    history.append({"step": 2, "eval/pass_rate": 0.5})  # a held-out row has no builder counts
    # rows 3 + 2 over 4 rollouts; merged turns 4: 3 CLEAN (1 bridged), 1 FORK; trained ids by
    # turn 1: 2 + 2 + 6 + 4 = 14, 2: 1 + 1 + 1 = 3, 3: 1 of 18 (the mean of the two steps' shares would say 0.04)
    assert rows_line(history) == (
        "rows and credit over 2 steps: 1.25 rows per rollout; merged turns CLEAN 0.75 (bridged 0.25), "
        "REALIGN 0.00, FORK 0.25 of 4; untrained sampled tokens 0; "
        "trained tokens by turn 1: 0.78, 2: 0.17, 3: 0.06, 4+: 0.00")
    assert rows_line(history[1:2]).startswith("rows and credit over 1 step: 1.00 rows per rollout; merged turns CLEAN 1.00")
    assert rows_line([{"step": 0, "eval/pass_rate": 0.1}]) == ""


def _closing(tmp_path: Path, history: list[dict], written: list[dict], monkeypatch: pytest.MonkeyPatch) -> list:
    """Run `loop.finish` on a run directory whose `metrics.jsonl` holds `written`, logging to
    `run.log`; returns the histories `write_curve_png` was given."""
    import json
    from types import SimpleNamespace

    from harnessrl.config import load_config
    from harnessrl.log import close_logging, setup_logging
    from harnessrl.train import loop
    from harnessrl.train.setup import loop_settings

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in written))
    drawn: list = []
    monkeypatch.setattr(loop, "write_curve_png", lambda h, path, **kw: drawn.append(list(h)) or None)
    setup_logging("INFO", tmp_path / "run.log")
    try:
        loop.finish(SimpleNamespace(settings=loop_settings(load_config(None, [])), run_dir=tmp_path),  # type: ignore[arg-type]
                    history)
    finally:
        close_logging()
    return drawn


STEP = {"policy_version": 1, "reward/verifier_mean": 0.5, "reward/train_mean": 0.5, "loss": 0.1,
        "tokens_trained": 10, "time/step_s": 4.0, "time/rollout_wait_s": 3.0, "time/train_s": 0.5,
        "time/sync_s": 0.5, "samples/num_rollouts": 4.0, "samples/num_rows": 4.0}


def test_a_resumed_run_draws_its_curve_from_every_step_of_metrics_jsonl(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Steps 1-2 before the resume, 3-4 by this process: the curve and its table show 1-4 (before:
    3-4 only); the closing table stays this process's."""
    written = [{"step": k, **STEP, "reward/verifier_mean": k / 4} for k in range(1, 5)]
    drawn = _closing(tmp_path, written[2:], written, monkeypatch)
    assert [[m["step"] for m in h] for h in drawn] == [[1, 2, 3, 4]]
    out = capsys.readouterr().out
    curve = out[out.index("step  verifier"):]
    assert [line.split()[0] for line in curve.splitlines()[1:5]] == ["1", "2", "3", "4"]


def test_run_log_gets_the_closing_table_and_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What the console printed at the end (the table, the bound line, the rows line, the curve's
    table) is in `run.log` too (before: none of it)."""
    history = [{"step": k, **STEP} for k in (1, 2)]
    _closing(tmp_path, history, history, monkeypatch)
    out = capsys.readouterr().out
    log = (tmp_path / "run.log").read_text()
    for line in (bound_line(history), rows_line(history), "harnessrl train", "step  verifier"):
        head = line[:40]  # the console wraps at 80 columns; the bound line's tail depends on the config
        assert head in out and head in log, head
