"""Benchmark: the cost of one local sandbox's lifecycle (create, exec `true`, close).

Measured, sequentially, N times each (default 200) in one process:
  * baseline: `asyncio.create_subprocess_exec("true")` and wait (a bare process start, the
    floor under any sandbox);
  * plain: `LocalSandboxBackend(use_bwrap=False)`: create (directory tree + a 2-file
    workspace), exec `true` (fresh env, rlimits, new session), close (/proc scan, kill,
    rmtree);
  * plain-shm: plain with the sandbox root on tmpfs (/dev/shm): the filesystem's share of
    the cost (on ext4 mounted with `discard`, each removed directory costs milliseconds);
  * bwrap: plain with bubblewrap (skipped when it is not installed): unprivileged user, no
    capabilities, own network namespace with nothing routed;
  * bwrap-proxy: bwrap with a proxy route, so each command also starts the forwarder
    (`sandbox/forward.py`, a python3 start) relaying 127.0.0.1:<port> to a Unix socket, as
    every command of a run does;
  * bwrap-agents: bwrap-proxy with every installed agent tree bound (what a run binds), each
    shared tree through the command's own overlay (`sandbox/layers.py`, as root);
    bwrap-agents-bound: the same trees bound directly (no overlay), the cost before it.
Reported: p50 and p90 of the whole lifecycle and p50 of each phase in ms, the ratio of each
to the baseline, and bwrap/plain. Target: plain p50 <= 30 ms.

Usage: `.venv/bin/python bench/sandbox.py [--n 200]`. On a shared machine numbers are noisy;
the ratios are measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import tempfile
import time
from pathlib import Path

from harnessrl.harness.install import installed_agent_dirs
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig, leftover_sandboxes

WORKSPACE = {"solution.py": "def f():\n    return 1\n", "data/input.txt": "1 2 3\n"}


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


async def bench_baseline(n: int) -> dict[str, list[float]]:
    totals = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
        totals.append(time.perf_counter() - t0)
    return {"total": totals}


async def bench_lifecycle(n: int, use_bwrap: bool, root: Path, proxy_socket: Path | None = None,
                          ro_binds: tuple[Path, ...] = (), layered: bool = True) -> dict[str, list[float]]:
    backend = LocalSandboxBackend(SandboxConfig(root_dir=root, use_bwrap=use_bwrap), ro_binds=ro_binds,
                                  proxy_port=18_080 if proxy_socket else None, proxy_socket=proxy_socket)
    if not layered:
        backend.layers_problem = "turned off by the benchmark"
    phases: dict[str, list[float]] = {"create": [], "exec": [], "close": [], "total": []}
    for i in range(n):
        t0 = time.perf_counter()
        sb = await backend.create(f"bench-{i}", WORKSPACE)
        t1 = time.perf_counter()
        result = await sb.exec(["true"], timeout_s=10)
        t2 = time.perf_counter()
        await sb.close()
        t3 = time.perf_counter()
        assert result.returncode == 0, f"`true` failed in the sandbox: {result}"
        for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            phases[name].append(value)
    assert leftover_sandboxes(root) == [], "sandboxes left behind"
    return phases


def report(name: str, phases: dict[str, list[float]], base_p50_ms: float) -> float:
    total = phases["total"]
    p50, p90 = _pct(total, 50) * 1e3, _pct(total, 90) * 1e3
    detail = "  ".join(
        f"{k} p50 {_pct(v, 50) * 1e3:6.2f}" for k, v in phases.items() if k != "total"
    )
    print(f"{name:18s} p50 {p50:7.2f} ms  p90 {p90:7.2f} ms  x{p50 / base_p50_ms:5.1f} baseline  {detail}")
    return p50


async def main(n: int) -> None:
    baseline = (await bench_baseline(n))["total"]
    base_p50_ms = _pct(baseline, 50) * 1e3
    print(f"lifecycle = create + exec `true` + close, n={n} each (ms)")
    report("baseline", {"total": baseline}, base_p50_ms)
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-") as tmp:
        plain = report("plain", await bench_lifecycle(n, False, Path(tmp) / "plain"), base_p50_ms)
        if Path("/dev/shm").is_dir():
            with tempfile.TemporaryDirectory(prefix="harnessrl-bench-", dir="/dev/shm") as shm:
                report("plain-shm", await bench_lifecycle(n, False, Path(shm)), base_p50_ms)
        if bwrap_path() is None:
            print("bwrap     skipped: bubblewrap not installed (apt-get install bubblewrap)")
            return
        bw = report("bwrap", await bench_lifecycle(n, True, Path(tmp) / "bwrap"), base_p50_ms)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(Path(tmp) / "proxy.sock"))
        listener.listen()
        report("bwrap-proxy", await bench_lifecycle(n, True, Path(tmp) / "bwrap-proxy", Path(tmp) / "proxy.sock"),
               base_p50_ms)
        trees = installed_agent_dirs()
        if trees:
            print(f"agent trees: {len(trees)} ({', '.join(t.name for t in trees)}); overlays: "
                  f"{LocalSandboxBackend(SandboxConfig(root_dir=Path(tmp) / 'probe')).layers_problem or 'yes'}")
            for name, layered in (("bwrap-agents", True), ("bwrap-agents-bound", False)):
                report(name, await bench_lifecycle(n, True, Path(tmp) / name, Path(tmp) / "proxy.sock", trees, layered),
                       base_p50_ms)
        listener.close()
    print(f"bwrap/plain p50 ratio: {bw / plain:.2f}; plain target <= 30 ms: "
          f"{'met' if plain <= 30 else 'NOT met'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="lifecycles per variant")
    asyncio.run(main(parser.parse_args().n))
