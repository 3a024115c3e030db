"""The training console: step lines (1-based, a skipped step says why) and a final table that
fits 80 columns."""

from __future__ import annotations

from rich.console import Console

from harnessrl.train.console import FINAL_COLUMNS, bound_line, final_table, skip_reason, step_line


def test_a_step_that_trains_nothing_says_why() -> None:
    m = {"policy_version": 1, "reward/verifier_mean": 0.0, "reward/verifier_std": 0.0, "pass_rate": 0.0, "error_rate": 0.25,
         "skipped": 1.0, "rows_built": 4.0, "rows_zero_variance_dropped": 4.0, "rows_stale_dropped": 0.0,
         "time/rollout_wait_s": 3.0, "time/train_s": 0.0, "time/sync_s": 0.0}
    m["skip_reason"] = skip_reason(m)
    line = step_line(3, 3, m)
    assert line.startswith("step 3/3 v1 reward 0.000±0.000 train - pass 0.00 err 0.25 ")
    assert "no update: all rewards equal within each group;" in line
    assert "loss" not in line and "nan" not in line


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
