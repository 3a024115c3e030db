"""Learning-rate schedules: the factor applied to `train.learning_rate` at each update.

The schedules are those of Hugging Face transformers' `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup` (`transformers/optimization.py`), written as a pure function
of the update index so that a resumed run continues the schedule where it stopped (nothing but
the step number is kept). Update `k` (0-based) of a run of `total` steps, `w` warm-up steps:

  * warm-up, `k < w`: `k / w`;
  * `constant`: 1;
  * `linear`: `max(0, (total - k) / max(1, total - w))`;
  * `cosine`: `max(0, 0.5 (1 + cos(pi (k - w) / max(1, total - w))))`.

A step that trains nothing still advances the schedule (its index is its step number), as the
Hugging Face `Trainer` counts every step of `max_steps`.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(schedule: str, update: int, total: int, warmup: int = 0) -> float:
    """Multiplier of the base learning rate at update `update` (0-based) of `total`.

    Raises:
        ValueError: an unknown `schedule`, `total < 1`, or a negative `update` / `warmup`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"train.lr_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total < 1 or update < 0 or warmup < 0:
        raise ValueError(f"lr_factor needs total >= 1, update >= 0, warmup >= 0 (got {total}, {update}, {warmup})")
    if update < warmup:
        return update / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, (total - update) / span)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (update - warmup) / span)))
