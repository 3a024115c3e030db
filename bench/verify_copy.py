"""How long a sibling coroutine is held up while a verifier copies a large workspace.

A real local sandbox's workdir gets `--dirs` directories of `--files` empty files each (the
default, 100 x 1,000, is the worst case the copy bounds allow: it walks 100,000 entries and
copies 10,000 files before `CopyLimits` stops it). A sibling coroutine ticks every 1 ms, as the
proxy's handlers of other rollouts would run, and records the longest gap between its ticks
while the verify directory is staged:
  * `on-loop` (the baseline, what verifiers did before): `new_verify_dir` called directly on
    the event loop;
  * `off-loop` (what verifiers do now): `stage_verify_dir`, the same copy on a worker thread.
Both stages end in `SandboxLimitError` at these sizes (the workspace is past the bounds), which
is counted as the agent's failure; the time spent and the stall are what is measured. Printed:
the copy's wall seconds and the longest stall of each, and the ratio off-loop / on-loop of the
longest stall.

Usage: `.venv/bin/python bench/verify_copy.py [--dirs 100] [--files 1000] [--repeats 2]`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from harnessrl.errors import SandboxLimitError
from harnessrl.rewards.submission import new_verify_dir, stage_verify_dir
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig


async def _measure(stage) -> tuple[float, float]:  # noqa: ANN001
    ticks: list[float] = []
    done = asyncio.Event()

    async def sibling() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.001)

    ticking = asyncio.ensure_future(sibling())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    try:
        result = stage()
        if asyncio.iscoroutine(result):
            await result
    except SandboxLimitError:
        pass
    copy_s = time.monotonic() - t0
    await asyncio.sleep(0.01)
    done.set()
    await ticking
    window = [t for t in ticks if t >= t0 - 0.01]
    stall = max((b - a for a, b in zip(window, window[1:])), default=copy_s)
    return copy_s, stall


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verify-copy-") as tmp:
        backend = LocalSandboxBackend(SandboxConfig(root_dir=Path(tmp), use_bwrap=False))
        sandbox = await backend.create("bench", {})
        try:
            for d in range(args.dirs):
                sub = sandbox.workdir / f"d{d}"
                sub.mkdir()
                for f in range(args.files):
                    (sub / str(f)).touch()
            print(f"workspace: {args.dirs} x {args.files} = {args.dirs * args.files} files")
            results: dict[str, list[tuple[float, float]]] = {"on-loop": [], "off-loop": []}
            for _ in range(args.repeats):
                results["on-loop"].append(await _measure(lambda: new_verify_dir(sandbox, {"run.py": ""})))
                results["off-loop"].append(await _measure(lambda: stage_verify_dir(sandbox, {"run.py": ""})))
            for name, runs in results.items():
                shown = ", ".join(f"copy {c:.2f} s stall {s * 1000:.0f} ms" for c, s in runs)
                print(f"{name:9s} {shown}")
            worst = {name: max(s for _, s in runs) for name, runs in results.items()}
            print(f"longest stall off-loop / on-loop: {worst['off-loop'] / worst['on-loop']:.3f}")
        finally:
            await sandbox.close()


if __name__ == "__main__":
    asyncio.run(main())
