"""`harnessrl view RUN_DIR --out DIR`: a self-contained HTML report of a run.

Writes `DIR/index.html` (script, style, the index and the metrics inlined) and one file per
rollout, `DIR/rollouts/<i>.js`, loaded when that rollout is clicked. Each holds the rollout's
JSON payload (`detail.rollout_detail`) wrapped as `hrlRollout(i, {...});`: browsers refuse
`fetch` of a `file://` JSON file, a script element they load.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from harnessrl.hooks import Hooks
from harnessrl.view.detail import rollout_detail
from harnessrl.view.index import RunIndex, index_json
from harnessrl.view.page import render_page, script_safe_json


def write_report(index: RunIndex, out_dir: Path, tokenizer: Any, hooks: Hooks) -> dict[str, float]:
    """Write the report of `index` into `out_dir` (created); returns timings and counts:
    `rollouts`, `write_s`, `bytes`.

    Raises:
        OSError: `out_dir` cannot be written.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    (out_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    total = 0
    for s in index.summaries:
        i = s["i"]
        body = f"hrlRollout({i}, {script_safe_json(rollout_detail(index, i, tokenizer, hooks))});\n"
        (out_dir / "rollouts" / f"{i}.js").write_text(body, encoding="utf-8")
        total += len(body)
    page = render_page(index_json(index), "static")
    (out_dir / "index.html").write_text(page, encoding="utf-8")
    total += len(page)
    return {"rollouts": float(len(index.summaries)), "write_s": time.perf_counter() - t0, "bytes": float(total)}
