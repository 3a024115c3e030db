"""The run's learning curve: `curve.png` in the run directory and a compact text table.

Responsibility: from the per-step metrics of a run (`metrics.jsonl` rows), draw against the
step: the verifier's mean reward on the training rollouts (`reward/verifier_mean`), the training
reward (`reward/train_mean`, after shaping; drawn only when it differs from the verifier's
somewhere), the held-out pass rate (`eval/pass_rate`, on the steps that evaluated; step 0 is
before the first update) and the held-out pass@k (`eval/pass_at_k` at k = `eval/k`, drawn when
k > 1). The legend names the tasks behind each: training tasks per step (`train.groups_per_step`,
when given) and held-out tasks (`eval/tasks`). Values are in [0, 1] for the built-in verifiers;
the y axis widens when a reward leaves [0, 1]. Drawn with matplotlib on its Agg canvas (no
display, no pyplot state), so it works on any machine the trainer runs on; the viewer embeds the
same figure (`view/index.index_json`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SERIES = (("reward/verifier_mean", "verifier reward", "#1f77b4"),
          ("reward/train_mean", "train reward (shaped)", "#ff7f0e"),
          ("eval/pass_rate", "held-out pass rate", "#2ca02c"),
          ("eval/pass_at_k", "held-out pass@k", "#9467bd"))
"""(metric key, legend label, colour) of each drawn series."""

SIZE_PX = (800, 450)
"""The PNG's width and height in pixels (8 x 4.5 inches at 100 dpi)."""


def curve_points(history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per metric key of `SERIES`: the (step, value) points with a finite value, by step.
    The training reward is left out (empty) when it equals the verifier's at every step, and
    pass@k when k (`eval/k`) is 1 at every step (it is then the pass rate's estimate again)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for key, _, _ in SERIES:
        points = [(int(m["step"]), float(m[key])) for m in history
                  if isinstance(m.get(key), (int, float)) and math.isfinite(m[key]) and "step" in m]
        out[key] = sorted(points)
    if dict(out["reward/train_mean"]) == dict(out["reward/verifier_mean"]):
        out["reward/train_mean"] = []
    if all(m.get("eval/k", 1) == 1 for m in history if "eval/pass_at_k" in m):
        out["eval/pass_at_k"] = []
    return out


def curve_labels(history: Sequence[dict[str, Any]], tasks_per_step: int | None = None) -> dict[str, str]:
    """The legend label of each key of `SERIES`, with the number of tasks behind it: training
    tasks per step (`tasks_per_step`) for the rewards; held-out tasks (`eval/tasks`, the last
    evaluation's) and k (`eval/k`) for the held-out series."""
    last_eval: dict[str, Any] = next((m for m in reversed(history) if "eval/tasks" in m), {})
    labels = {key: label for key, label, _ in SERIES}
    if tasks_per_step:
        per = f"{tasks_per_step} task{'s' if tasks_per_step != 1 else ''}/step"
        labels["reward/verifier_mean"] += f" ({per})"
        labels["reward/train_mean"] += f" ({per})"
    tasks = last_eval.get("eval/tasks")
    held = f"{int(tasks)} tasks" if isinstance(tasks, (int, float)) and math.isfinite(tasks) else ""
    k = last_eval.get("eval/k")
    if isinstance(k, (int, float)) and math.isfinite(k):
        labels["eval/pass_at_k"] = f"held-out pass@{int(k)}"
    if held:
        labels["eval/pass_rate"] += f" ({held})"
        labels["eval/pass_at_k"] += f" ({held})"
    return labels


def curve_figure(history: Sequence[dict[str, Any]], title: str = "harnessrl train",
                 tasks_per_step: int | None = None) -> Any:
    """The curve of `history` (module docstring) as a `matplotlib.figure.Figure` on an Agg
    canvas, `SIZE_PX` pixels at 100 dpi; None when no series has a point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib, heavy; not needed at import
    from matplotlib.figure import Figure  # lazy: matplotlib, heavy; not needed at import
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib, heavy; not needed at import

    points = curve_points(history)
    if not any(points.values()):
        return None
    labels = curve_labels(history, tasks_per_step)
    fig = Figure(figsize=(SIZE_PX[0] / 100, SIZE_PX[1] / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, _, colour in SERIES:
        if points[key]:
            steps, values = zip(*points[key])
            ax.plot(steps, values, marker="o", markersize=5, linewidth=2, color=colour, label=labels[key])
    every_value = [v for series in points.values() for _, v in series]
    low, high = min(0.0, min(every_value)), max(1.0, max(every_value))
    ax.set_ylim(low - 0.03 * (high - low), high + 0.03 * (high - low))
    every_step = [x for series in points.values() for x, _ in series]
    if max(every_step) - min(every_step) < 2:  # one or two steps: whole-number ticks need a wider axis
        ax.set_xlim(min(every_step) - 1, max(every_step) + 1)
    locator = ax.xaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):  # Axes' default AutoLocator is one
        locator.set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / pass rate")
    ax.set_title(title, fontsize=10)
    ax.grid(True, color="#e0e0e0")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def curve_png(history: Sequence[dict[str, Any]], title: str = "harnessrl train",
              tasks_per_step: int | None = None) -> bytes | None:
    """`curve_figure` as PNG bytes; None when no series has a point."""
    fig = curve_figure(history, title, tasks_per_step)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_curve_png(history: Sequence[dict[str, Any]], path: Path, title: str = "harnessrl train",
                    tasks_per_step: int | None = None) -> Path | None:
    """Write `curve_png` of `history` to the PNG file `path` (its directory made).

    Returns `path`, or None when no series has a point (nothing is written).
    """
    data = curve_png(history, title, tasks_per_step)
    if data is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def curve_table(history: Sequence[dict[str, Any]], max_rows: int = 20) -> str:
    """A compact text table of the curve: step, verifier reward, train reward, held-out pass,
    and a bar of the verifier reward; at most `max_rows` rows (evenly spaced steps, the first,
    the last and every step that evaluated kept)."""
    rows = [m for m in history if "step" in m]
    if not rows:
        return "(no steps)"
    keep = {0, len(rows) - 1} | {i for i, m in enumerate(rows) if "eval/pass_rate" in m}
    stride = max(1, math.ceil(len(rows) / max_rows))
    keep |= set(range(0, len(rows), stride))
    lines = ["step  verifier  train  eval  verifier reward"]
    for i in sorted(keep):
        m = rows[i]
        ver = m.get("reward/verifier_mean")
        bar = "#" * round(20 * min(max(ver, 0.0), 1.0)) if isinstance(ver, (int, float)) and math.isfinite(ver) else ""
        lines.append(f"{m['step']:>4}  {_f(ver):>8}  {_f(m.get('reward/train_mean')):>5}  "
                     f"{_f(m.get('eval/pass_rate')):>4}  {bar}")
    return "\n".join(lines)


def _f(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"
