"""Benchmark: the proxy's own cost per call, against the same engine behind a bare server.

Both servers run uvicorn on a real 127.0.0.1 socket in a child process, with the same
instant, deterministic engine (echoes the prompt, returns 16 fixed ids); an aiohttp client
in this process drives them:
  * baseline: a bare Starlette route that reads the body and calls `engine.generate`
    on fixed prompt ids (what "the engine called directly over loopback" costs);
  * proxy: `ProxyServer` (auth, validation, chat-template render, sampling, parse, record).
Chat-template rendering is measured separately in this process (an external engine would
render anyway) and subtracted to give the proxy's own added latency.

Reported for a small call (~1 KB body) and an agent-sized one (~60 KB body, ~12k prompt ids):
p50/p99 latency at concurrency 1, 8, 32; server CPU ms per call; requests/s at concurrency 32;
each as a ratio to the baseline measured in the same run.

Usage: `.venv/bin/python bench/proxy.py [--quick]`. Numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

OUT_IDS = tuple(range(1000, 1015)) + (2,)


class InstantEngine:
    """Deterministic engine with no compute: echoes the prompt, returns `OUT_IDS`."""

    policy_version = 0
    max_context_tokens = 65536
    eos_token_ids = (2,)

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        from harnessrl.types import Completion

        ids = OUT_IDS[: sampling.max_tokens]
        return Completion(tuple(prompt_ids), ids, tuple(-0.25 for _ in ids), "stop", 0)

    def load_weights(self, state_dict: dict, version: int) -> None:
        return None

    def close(self) -> None:
        return None


def make_body(kind: str) -> dict[str, Any]:
    words = ("the proxy records every token id the engine consumed and sampled while agents "
             "run their own loops over files tests and shell commands ").split()
    n_words = 150 if kind == "small" else 8600
    text = " ".join(words[(i * 7) % len(words)] for i in range(n_words))
    body: dict[str, Any] = {"model": "bench", "messages": [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": text}]}
    if kind == "agent":
        body["tools"] = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
    return body


def _server_main(kind: str, queue: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(kind, queue))


async def _serve(kind: str, queue: Any) -> None:
    from harnessrl.engine.chat import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.proxy.config import ProxyConfig
    from harnessrl.proxy.server import ProxyServer

    engine = InstantEngine()
    if kind == "proxy":
        chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)))
        async with ProxyServer(engine, chat, ProxyConfig(port=0, max_tokens_cap=64)) as proxy:
            _, key = proxy.open_session("bench")
            queue.put((proxy.port, key))
            await asyncio.Event().wait()
    else:
        await _serve_baseline(engine, queue)


async def _serve_baseline(engine: InstantEngine, queue: Any) -> None:
    import socket

    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from harnessrl.types import Sampling

    prompt, sampling = list(range(100, 400)), Sampling(max_tokens=64)

    async def direct(request: Any) -> Response:
        await request.body()
        c = await engine.generate(prompt, sampling)
        return Response(orjson.dumps({"ids": c.completion_ids, "lp": c.completion_logprobs}),
                        media_type="application/json")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = Starlette(routes=[Route("/v1/chat/completions", direct, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    queue.put((sock.getsockname()[1], "none"))
    await server.serve(sockets=[sock])


async def _drive(port: int, key: str, payload: bytes, concurrency: int, n: int) -> tuple[list[float], float]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    latencies: list[float] = []
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def worker() -> None:
            for _ in counter:
                t0 = time.perf_counter()
                async with http.post(url, data=payload, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        for _ in range(min(20, n)):  # warm-up on one connection
            async with http.post(url, data=payload, headers=headers) as r:
                await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall


def _measure(kind: str, payloads: dict[str, bytes], plan: dict[str, dict[int, int]]) -> dict[tuple[str, int], dict[str, float]]:
    import psutil

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_server_main, args=(kind, queue), daemon=True)
    proc.start()
    try:
        port, key = queue.get(timeout=120)
        ps = psutil.Process(proc.pid)
        results: dict[tuple[str, int], dict[str, float]] = {}
        for size, by_conc in plan.items():
            for conc, n in by_conc.items():
                cpu0 = sum(ps.cpu_times()[:2])
                lat, wall = asyncio.run(_drive(port, key, payloads[size], conc, n))
                cpu_s = sum(ps.cpu_times()[:2]) - cpu0
                lat_ms = sorted(x * 1e3 for x in lat)
                results[(size, conc)] = {"p50": statistics.median(lat_ms), "p99": lat_ms[int(0.99 * (len(lat_ms) - 1))],
                                         "cpu_ms": cpu_s * 1e3 / (n + min(20, n)), "rps": n / wall}
        return results
    finally:
        proc.terminate()
        proc.join(10)


def _render_ms(bodies: dict[str, dict[str, Any]]) -> dict[str, tuple[float, int]]:
    from harnessrl.engine.chat import ChatLayer, normalize_messages, normalize_tools
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model

    chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)))
    out = {}
    for size, body in bodies.items():
        msgs, tools = normalize_messages(body["messages"]), normalize_tools(body.get("tools"))
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            ids = chat.render(msgs, tools)
            times.append((time.perf_counter() - t0) * 1e3)
        out[size] = (statistics.median(times), len(ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args()
    import orjson

    scale = 0.3 if args.quick else 1.0
    bodies = {"small": make_body("small"), "agent": make_body("agent")}
    payloads = {k: orjson.dumps(v) for k, v in bodies.items()}
    plan = {"small": {1: int(600 * scale), 8: int(1500 * scale), 32: int(3000 * scale)},
            "agent": {1: int(120 * scale), 8: int(200 * scale), 32: int(300 * scale)}}
    render = _render_ms(bodies)
    base = _measure("baseline", payloads, plan)
    proxy = _measure("proxy", payloads, plan)
    for size in ("small", "agent"):
        r_ms, n_ids = render[size]
        print(f"\n== {size}: body {len(payloads[size]) / 1024:.1f} KB, {n_ids} prompt ids, "
              f"chat-template render {r_ms:.2f} ms (in-process, median)")
        print(f"{'conc':>4} | {'base p50':>8} {'proxy p50':>9} {'added p50 excl. render':>22} | "
              f"{'base p99':>8} {'proxy p99':>9} | {'cpu ms/call b/p (ratio)':>24} | {'req/s b/p (ratio)':>22}")
        for conc in plan[size]:
            b, p = base[(size, conc)], proxy[(size, conc)]
            added = p["p50"] - b["p50"] - r_ms
            print(f"{conc:>4} | {b['p50']:8.3f} {p['p50']:9.3f} {added:22.3f} | {b['p99']:8.3f} {p['p99']:9.3f} | "
                  f"{b['cpu_ms']:6.3f}/{p['cpu_ms']:6.3f} ({p['cpu_ms'] / b['cpu_ms']:4.1f}x)    | "
                  f"{b['rps']:7.0f}/{p['rps']:7.0f} ({p['rps'] / b['rps']:4.2f}x)")
    print("\nadded p50 = proxy p50 - baseline p50 - render median (latencies in ms; ratios proxy/baseline)")


if __name__ == "__main__":
    main()
