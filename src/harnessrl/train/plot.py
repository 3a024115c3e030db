"""The run's learning curve: `curve.png` in the run directory and a compact text table.

Responsibility: from the per-step metrics of a run (`metrics.jsonl` rows), draw three series
against the step: the verifier's mean reward (`reward/verifier_mean`), the training reward
(`reward/train_mean`, after shaping; drawn only when it differs from the verifier's somewhere)
and the held-out pass rate (`eval/pass_rate`, on the steps that evaluated; step 0 is before the
first update). Values are in [0, 1] for the built-in verifiers; the y axis spans the data's own
range when a reward leaves [0, 1]. Drawn with Pillow (no plotting library), so it works on any
machine the trainer runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SERIES = (("reward/verifier_mean", "verifier reward", (31, 119, 180)),
          ("reward/train_mean", "train reward", (255, 127, 14)),
          ("eval/pass_rate", "held-out pass", (44, 160, 44)))
"""(metric key, legend label, RGB) of each drawn series."""


def curve_points(history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per metric key of `SERIES`: the (step, value) points with a finite value, by step.
    The training reward is left out (empty) when it equals the verifier's at every step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for key, _, _ in SERIES:
        points = [(int(m["step"]), float(m[key])) for m in history
                  if isinstance(m.get(key), (int, float)) and math.isfinite(m[key]) and "step" in m]
        out[key] = sorted(points)
    if dict(out["reward/train_mean"]) == dict(out["reward/verifier_mean"]):
        out["reward/train_mean"] = []
    return out


def write_curve_png(history: Sequence[dict[str, Any]], path: Path, title: str = "harnessrl train",
                    size: tuple[int, int] = (800, 450)) -> Path | None:
    """Draw the curve of `history` (see the module docstring) into the PNG file `path`.

    Returns `path`, or None when no series has a point (nothing is written).
    """
    from PIL import Image, ImageDraw

    points = curve_points(history)
    if not any(points.values()):
        return None
    width, height = size
    left, right, top, bottom = 60, 20, 40, 70
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    steps = [s for series in points.values() for s, _ in series]
    values = [v for series in points.values() for _, v in series]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(0.0, min(values)), max(1.0, max(values))

    def xy(step: float, value: float) -> tuple[float, float]:
        x = left + (step - x0) / (x1 - x0) * (width - left - right)
        y = height - bottom - (value - y0) / (y1 - y0) * (height - top - bottom)
        return x, y

    draw.text((left, 12), title, fill="black")
    for i in range(6):  # y grid and labels
        v = y0 + (y1 - y0) * i / 5
        _, y = xy(x0, v)
        draw.line([(left, y), (width - right, y)], fill=(225, 225, 225))
        draw.text((8, y - 6), f"{v:.2f}", fill="black")
    n_ticks = min(10, x1 - x0)
    for i in range(n_ticks + 1):  # x ticks
        s = x0 + round((x1 - x0) * i / n_ticks)
        x, y = xy(s, y0)
        draw.line([(x, y), (x, y + 4)], fill="black")
        draw.text((x - 6, y + 8), str(s), fill="black")
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text((width // 2 - 15, height - bottom + 24), "step", fill="black")
    legend_x = left
    for key, label, colour in SERIES:
        series = points[key]
        if not series:
            continue
        coords = [xy(s, v) for s, v in series]
        if len(coords) > 1:
            draw.line(coords, fill=colour, width=2)
        for x, y in coords:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.line([(legend_x, height - 18), (legend_x + 20, height - 18)], fill=colour, width=3)
        draw.text((legend_x + 25, height - 24), label, fill="black")
        legend_x += 40 + 7 * len(label)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
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
