"""Benchmark arm: OpenEnv's intercept server (openenv 0.10.0 `CaptureServer`) beside harnessrl's
proxy, on the same calls as `bench/proxy.py` (its bodies and its aiohttp driver).

OpenEnv's server forwards every call to an HTTP upstream, so it gets a stub upstream in its own
process (uvicorn, instant: a vLLM-shaped reply with `prompt_token_ids`, `choices[0].token_ids`
and `logprobs.content`, 16 fixed ids, as `bench/proxy.py`'s instant engine returns). Arms, each
server in its own child process:
  * stub: the stub upstream called directly (the floor of an HTTP hop to an engine);
  * openenv: OpenEnv's capture server in front of the stub, the session id as the API key;
  * harnessrl: `ProxyServer` with `bench/proxy.py`'s instant in-process engine.
Reported per body (small ~1 KB, agent ~60 KB): p50 at concurrency 1 and the latency each arm
adds to the stub's, server CPU ms per call (the stub's process excluded for the openenv arm:
its own CPU is the proxy's share), and requests/s at concurrency 32.

Usage: `.venv/bin/python bench/proxy_openenv.py [--quick]` (needs `pip install 'harnessrl[openenv]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("bench_proxy", Path(__file__).with_name("proxy.py"))
assert _spec is not None and _spec.loader is not None
bench_proxy = importlib.util.module_from_spec(_spec)
sys.modules["bench_proxy"] = bench_proxy
_spec.loader.exec_module(bench_proxy)

OUT_IDS = bench_proxy.OUT_IDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub_main(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    prompt = list(range(100, 400))

    async def chat(request: Any) -> Response:
        body = orjson.loads(await request.body())
        ids = list(OUT_IDS[: int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)])
        content = [{"token": f"token_id:{i}", "logprob": -0.25, "bytes": None, "top_logprobs": []} for i in ids]
        reply = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "bench",
                 "prompt_token_ids": prompt,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                              "token_ids": ids, "logprobs": {"content": content}}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                           "total_tokens": len(prompt) + len(ids)}}
        return Response(orjson.dumps(reply), media_type="application/json")

    async def models(request: Any) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]}),
                        media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


def _openenv_main(port: int, stub_port: int, queue: Any) -> None:
    import httpx
    from openenv.core.harness.capture import CaptureServer

    server = CaptureServer(llm_url=f"http://127.0.0.1:{stub_port}/v1", model="bench", port=port,
                           admin_key="bench-admin-key-0123456789")
    server.start()
    r = httpx.post(f"http://127.0.0.1:{port}/sessions", json={},
                   headers={"authorization": "Bearer bench-admin-key-0123456789"}, timeout=60)
    r.raise_for_status()
    queue.put((port, r.json()["session_id"]))
    while True:
        time.sleep(3600)


def _harnessrl_main(queue: Any) -> None:
    bench_proxy._server_main("proxy", queue)


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _run_arm(name: str, payloads: dict[str, bytes], plan: dict[str, dict[int, int]]) -> dict[tuple[str, int], dict]:
    import psutil

    ctx = mp.get_context("spawn")
    with bench_proxy.spawned() as procs:
        stub_port = _free_port()
        stub = ctx.Process(target=_stub_main, args=(stub_port,), daemon=True)
        stub.start()
        procs.append(stub)
        _wait_port(stub_port)
        if name == "stub":
            port, key, measured = stub_port, "none", stub
        elif name == "openenv":
            queue = ctx.Queue()
            proc = ctx.Process(target=_openenv_main, args=(_free_port(), stub_port, queue), daemon=True)
            proc.start()
            procs.append(proc)
            port, key = queue.get(timeout=120)
            measured = proc
        else:
            queue = ctx.Queue()
            proc = ctx.Process(target=_harnessrl_main, args=(queue,), daemon=True)
            proc.start()
            procs.append(proc)
            port, key = queue.get(timeout=120)
            measured = proc
        ps = psutil.Process(measured.pid)
        out = {}
        for size, by_conc in plan.items():
            for conc, n in by_conc.items():
                cpu0 = sum(ps.cpu_times()[:2]) + sum(sum(c.cpu_times()[:2]) for c in ps.children(recursive=True))
                lat, wall = asyncio.run(bench_proxy._drive(port, key, payloads[size], conc, n))
                cpu1 = sum(ps.cpu_times()[:2]) + sum(sum(c.cpu_times()[:2]) for c in ps.children(recursive=True))
                lat_ms = sorted(x * 1e3 for x in lat)
                out[(size, conc)] = {"p50": statistics.median(lat_ms), "cpu_ms": (cpu1 - cpu0) * 1e3 / (n + min(20, n)),
                                     "rps": n / wall}
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args()
    import orjson

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scale = 0.3 if args.quick else 1.0
    bodies = bench_proxy.short_bodies()
    payloads = {k: orjson.dumps(v) for k, v in bodies.items()}
    plan = {"small": {1: int(400 * scale), 32: int(2000 * scale)}, "agent": {1: int(100 * scale), 32: int(300 * scale)}}
    results = {arm: _run_arm(arm, payloads, plan) for arm in ("stub", "openenv", "harnessrl")}
    for size in plan:
        print(f"\n== {size}: body {len(payloads[size]) / 1024:.1f} KB")
        print(f"{'arm':>10} | {'p50 c=1 ms':>10} {'added vs stub':>13} | {'cpu ms/call':>11} | {'req/s c=32':>10}")
        stub = results["stub"][(size, 1)]
        for arm in ("stub", "openenv", "harnessrl"):
            one, many = results[arm][(size, 1)], results[arm][(size, 32)]
            print(f"{arm:>10} | {one['p50']:10.3f} {one['p50'] - stub['p50']:13.3f} | {one['cpu_ms']:11.3f} | "
                  f"{many['rps']:10.0f}")
    print("\nopenenv = OpenEnv 0.10.0 CaptureServer forwarding to the stub over HTTP; harnessrl = ProxyServer with "
          "an in-process instant engine (it renders the chat template; OpenEnv does not tokenize). CPU is the "
          "measured server's process only. The client shares the machine.")


if __name__ == "__main__":
    main()
