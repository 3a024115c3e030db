"""Benchmark: the proxy's added latency and CPU per call, two source trees side by side in one run.

For deciding whether a change to the proxy's request path pays its way: the harnessrl arm of
`bench/proxy_upstream.py` (`ProxyServer` + `VllmEngine` in front of its stub vLLM
completions server, the proxy config `harnessrl train` builds) is started once per tree, each
in its own process with `PYTHONPATH` at that tree's `src`, both against one stub. Every round
sends each arm (and the stub directly, with the ids the proxy renders) `--calls` calls of each
body at concurrency 1, in an order rotated each round, so slow phases of a shared machine fall
on every arm alike. Reported per arm and body, as medians over rounds with their range: p50
latency, added latency (p50 minus the direct stub's p50 in the same round) and the serving
process's CPU ms per call (psutil, user + system: less sensitive to other load than latency).

Usage: `.venv/bin/python bench/proxy_ab.py --tree before=/path/to/old/src --tree after=src
[--rounds 6] [--calls 200]` (bodies: `bench/proxy.py`'s small ~1 KB and agent ~60 KB calls).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _load(name: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _serve(stub_port: int) -> None:
    """The harnessrl arm in this process (`--serve`): prints `port key`, serves until killed."""
    upstream = _load("bench_proxy_upstream", "proxy_upstream.py")

    class _Out:
        def put(self, item: tuple[int, str]) -> None:
            print(*item, flush=True)

    from harnessrl.proxy.server import run_loop

    run_loop(upstream._serve_harnessrl(stub_port, _Out()))


async def _calls(port: int, key: str, path: str, payload: bytes, n: int) -> list[float]:
    """`n` sequential calls on one keep-alive connection after 5 warm-up calls; each call's seconds."""
    import aiohttp

    url = f"http://127.0.0.1:{port}{path}"
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    out: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        for i in range(n + 5):
            t0 = time.perf_counter()
            async with http.post(url, data=payload, headers=headers) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
            if i >= 5:
                out.append(time.perf_counter() - t0)
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=SRC_DIR (two or more)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=200, help="calls per arm, body and round")
    parser.add_argument("--bodies", default="small,agent", help="which bodies (default small,agent)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        _serve(args.serve)
        return
    if args.stub is not None:
        _load("bench_proxy_upstream", "proxy_upstream.py")._completions_stub_main(args.stub)
        return
    import orjson

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) < 2:
        parser.error("give at least two --tree NAME=SRC_DIR")
    bench_proxy = _load("bench_proxy", "proxy.py")
    bench_openenv = _load("bench_proxy_openenv", "proxy_openenv.py")
    upstream = _load("bench_proxy_upstream", "proxy_upstream.py")
    bodies = {k: v for k, v in bench_proxy.short_bodies().items() if k in args.bodies.split(",")}
    chat = {k: orjson.dumps(v) for k, v in bodies.items()}
    direct = {k: orjson.dumps({"model": "bench", "prompt": upstream._prompt_ids(v), "max_tokens": 16,
                               "temperature": 1.0, "logprobs": 0, "return_token_ids": True})
              for k, v in bodies.items()}
    stub_port = bench_openenv._free_port()
    stub = subprocess.Popen([sys.executable, __file__, "--stub", str(stub_port)])
    bench_openenv._wait_port(stub_port)
    servers: dict[str, subprocess.Popen[str]] = {}
    arms: dict[str, tuple[int, str]] = {}
    try:
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            proc = subprocess.Popen([sys.executable, __file__, "--serve", str(stub_port)], env=env,
                                    stdout=subprocess.PIPE, text=True)
            servers[name] = proc
            assert proc.stdout is not None
            port, key = proc.stdout.readline().split()
            arms[name] = (int(port), key)
        import psutil

        names = ["direct", *trees]
        p50: dict[tuple[str, str], list[float]] = {(n, s): [] for n in names for s in bodies}
        cpu: dict[tuple[str, str], list[float]] = {(n, s): [] for n in trees for s in bodies}
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for n in order:
                for size in bodies:
                    if n == "direct":
                        lat = asyncio.run(_calls(stub_port, "none", "/v1/completions", direct[size], args.calls))
                    else:
                        proc_ps = psutil.Process(servers[n].pid)
                        t0 = proc_ps.cpu_times()
                        lat = asyncio.run(_calls(*arms[n], "/v1/chat/completions", chat[size], args.calls))
                        t1 = proc_ps.cpu_times()
                        used = (t1.user - t0.user) + (t1.system - t0.system)
                        cpu[(n, size)].append(used * 1e3 / (args.calls + 5))
                    p50[(n, size)].append(statistics.median(lat) * 1e3)
            print(f"round {rnd + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
        for size in bodies:
            print(f"\n== {size}: chat body {len(chat[size]) / 1024:.1f} KB; {args.rounds} rounds of {args.calls} calls")
            print(f"{'arm':>10} | {'p50 ms, median [range]':>24} | {'added ms, median [range]':>24} | "
                  f"{'CPU ms/call, median [range]':>27}")
            print(f"{'direct':>10} | {_spread(p50[('direct', size)]):>24} |")
            for n in trees:
                added = [a - b for a, b in zip(p50[(n, size)], p50[("direct", size)], strict=True)]
                print(f"{n:>10} | {_spread(p50[(n, size)]):>24} | {_spread(added):>24} | {_spread(cpu[(n, size)]):>27}")
        print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for proc in servers.values():
            proc.kill()
            proc.wait()
        stub.kill()
        stub.wait()


if __name__ == "__main__":
    main()
