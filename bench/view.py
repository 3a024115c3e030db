"""Index time and report-write time of `harnessrl view` on a run of thousands of rollouts.

A synthetic run directory is made by duplicating the lines of a real `rollouts.jsonl` (with new
`rollout_id`s, groups of `--group-size`) up to `--rollouts` lines, with the source run's
`config.toml` and `metrics.jsonl`. Then it times `build_index` (one pass, byte offsets and
summaries), one rollout's payload (what the server does on a click), and `write_report`
(every rollout's payload rebuilt with the samples builder and written as its own file).

Run: `.venv/bin/python bench/view.py SOURCE_RUN_DIR [--rollouts 2000] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import orjson


def make_run(source: Path, target: Path, n: int, group_size: int) -> int:
    lines = [ln for ln in (source / "rollouts.jsonl").read_bytes().splitlines() if ln.strip()]
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.toml", "metrics.jsonl"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    with (target / "rollouts.jsonl").open("wb") as fh:
        for k in range(n):
            d = orjson.loads(lines[k % len(lines)])
            d["rollout_id"] = f"syn{k:06d}"
            d["group_id"] = k // group_size
            fh.write(orjson.dumps(d) + b"\n")
    return (target / "rollouts.jsonl").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--rollouts", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="report directory (default: a temporary one)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    from harnessrl.view.detail import rollout_detail
    from harnessrl.view.index import build_index
    from harnessrl.view.report import write_report

    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-view-") as tmp:
        run = Path(tmp) / "run"
        size = make_run(args.source, run, args.rollouts, args.group_size)
        t0 = time.perf_counter()
        index = build_index(run)
        t_index = time.perf_counter() - t0
        tokenizer = load_tokenizer(resolve_model(index.cfg.engine.model))
        t0 = time.perf_counter()
        rollout_detail(index, len(index.summaries) // 2, tokenizer, {})
        t_one = time.perf_counter() - t0
        out = args.out or Path(tmp) / "report"
        done = write_report(index, out, tokenizer, {})
        print(f"rollouts.jsonl: {len(index.summaries)} rollouts, {size / 1e6:.1f} MB")
        print(f"index: {t_index:.2f} s ({len(index.summaries) / t_index:,.0f} rollouts/s)")
        print(f"one rollout's payload: {t_one * 1e3:.1f} ms")
        print(f"report: {done['write_s']:.1f} s for {int(done['rollouts'])} rollouts, {done['bytes'] / 1e6:.1f} MB written")


if __name__ == "__main__":
    main()
