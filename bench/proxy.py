"""Benchmark: the proxy's own cost per call, against the same engine behind a bare server.

Both servers run uvicorn on a real 127.0.0.1 socket in a child process, with the same
instant, deterministic engine (echoes the prompt, returns 16 fixed ids):
  * baseline: a bare Starlette route that reads the body and calls `engine.generate`
    on fixed prompt ids (what "the engine called directly over loopback" costs);
  * proxy: `ProxyServer` (auth, validation, chat-template render, sampling, parse, record).
Chat-template rendering is measured separately in this process (an external engine would
render anyway), cold and with the chat layer's message-id cache warm, and the warm figure is
subtracted to give the proxy's own added latency (the bench re-sends one body, as an agent
re-sends its history, so the server's cache is warm).

Reported for a small call (~1 KB body, 171 prompt ids) and an agent-sized one (~60 KB body,
~12.5k prompt ids): p50/p99 latency at concurrency 1, 8, 32 from an aiohttp client in this
process; server CPU ms per call; requests/s; and, when `wrk` is installed, the throughput
ceiling with `wrk` (C, one thread, 32 keep-alive connections, its own process) as the load
generator. Each figure comes with its ratio to the baseline measured in the same run.

Usage: `.venv/bin/python bench/proxy.py [--quick] [--wrk-only]` (`--wrk-only`: only the wrk
ceiling of the small call, baseline, proxy, and the proxy with malloc set as in a CPU training
process, each `--wrk-s` seconds). The load average is
printed with the figures: numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

OUT_IDS = tuple(range(1000, 1015)) + (2,)
WRK_CONNECTIONS = 32


class InstantEngine:
    """Deterministic engine with no compute: echoes the prompt, returns `OUT_IDS`."""

    policy_version = 0
    max_context_tokens = 65536
    eos_token_ids = (2,)

    def forget(self, affinity: str) -> None:
        return None

    async def generate(self, prompt_ids: list[int], sampling: Any, *, affinity: str | None = None,
                       cache_scope: str | None = None) -> Any:
        from harnessrl.types import Completion

        ids = OUT_IDS[: sampling.max_tokens]
        return Completion(tuple(prompt_ids), ids, tuple(-0.25 for _ in ids), "stop", 0)

    def close(self) -> None:
        return None


def make_body(kind: str) -> dict[str, Any]:
    """`small`: one short user message (~1 KB). `agent`: an agent's history, 4 tools and 23
    tool calls with their outputs (~60 KB body, ~12.5k prompt ids with the SmolLM2 tokenizer)."""
    import orjson

    words = ("the proxy records every token id the engine consumed and sampled while agents "
             "run their own loops over files tests and shell commands ").split()
    if kind == "small":
        text = " ".join(words[(i * 7) % len(words)] for i in range(150))
        return {"model": "bench", "messages": [{"role": "system", "content": "You are a careful coding agent."},
                                               {"role": "user", "content": text}]}
    tools = [{"type": "function", "function": {"name": name, "description": f"{name}: " + " ".join(words[:12]),
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "path": {"type": "string"}},
                             "required": ["command"]}}} for name in ("bash", "read_file", "write_file", "search")]
    messages = [{"role": "system", "content": "You are a careful coding agent. " + " ".join(words) * 6},
                {"role": "user", "content": "Fix the failing test in the repository. " + " ".join(words) * 3}]
    for turn in range(23):
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "bash", "arguments": orjson.dumps({"command": f"cat src/module_{turn}.py"}).decode()}}
        messages.append({"role": "assistant", "content": f"Looking at module {turn}.", "tool_calls": [call]})
        lines = [f"def handler_{turn}_{j}(request, limit={j * 3}):\n    items = [x for x in request.items if x.id > {j}]\n"
                 f"    return {{'count': len(items), 'name': 'handler_{turn}_{j}'}}\n" for j in range(2)]
        lines.append(" ".join(words[(i * 5 + turn) % len(words)] for i in range(340)) + "\n")
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": "".join(lines)})
    return {"model": "bench", "messages": messages, "tools": tools}

def _server_main(kind: str, queue: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from harnessrl.proxy.server import run_loop

    if kind == "proxy-retained":  # malloc as in a CPU training process (`train/setup.retain_freed_memory`)
        from harnessrl.train.setup import retain_freed_memory

        assert retain_freed_memory("cpu"), "mallopt is glibc's"
        kind = "proxy"
    run_loop(_serve(kind, queue))  # as `harnessrl serve` runs (uvloop, serving GC threshold)


async def _serve(kind: str, queue: Any) -> None:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    engine = InstantEngine()
    if kind == "proxy":
        chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)))
        # one session takes every call of the run: no per-session turn cap (wrk sends tens of thousands)
        config = ProxyConfig(port=0, max_turns_per_session=10**9, max_session_body_bytes=1 << 60,
                             sampling=SamplingConfig(max_tokens=64))
        async with ProxyServer(engine, chat, config) as proxy:
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


async def _drive(port: int, key: str, payload: bytes, concurrency: int, n: int,
                 path: str = "/v1/chat/completions") -> tuple[list[float], float]:
    """POST `payload` to `path` `n` times over `concurrency` keep-alive connections (after a
    warm-up of min(20, n) calls on one); returns (each call's seconds, wall seconds).
    Raises AssertionError naming the status and body of a non-200 answer."""
    import aiohttp

    url = f"http://127.0.0.1:{port}{path}"
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    latencies: list[float] = []
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def worker() -> None:
            for _ in counter:
                t0 = time.perf_counter()
                async with http.post(url, data=payload, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, (r.status, await r.text())
                latencies.append(time.perf_counter() - t0)

        for _ in range(min(20, n)):  # warm-up on one connection
            async with http.post(url, data=payload, headers=headers) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall


def short_bodies() -> dict[str, dict[str, Any]]:
    """The "small" and "agent" request bodies of `make_body`, each with `max_tokens` 16."""
    bodies = {"small": make_body("small"), "agent": make_body("agent")}
    for body in bodies.values():
        body["max_tokens"] = 16
    return bodies


@contextlib.contextmanager
def spawned() -> Iterator[list[Any]]:
    """A list to put started `multiprocessing` processes in; on exit each is terminated (last
    started first) and joined for at most 10 s."""
    procs: list[Any] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.terminate()
            p.join(10)


def _wrk(port: int, key: str, payload: bytes, connections: int, duration_s: float) -> float | None:
    """Requests/s that `wrk` (one C thread, keep-alive) gets; None when wrk is not installed.

    Raises:
        RuntimeError: a response was not 2xx (the proxy must answer every call).
    """
    import re
    import shutil
    import subprocess
    import tempfile

    if shutil.which("wrk") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        body_path, script_path = os.path.join(tmp, "body.json"), os.path.join(tmp, "post.lua")
        with open(body_path, "wb") as f:
            f.write(payload)
        with open(script_path, "w") as f:
            f.write(f'wrk.method = "POST"\nwrk.body = io.open("{body_path}", "rb"):read("*a")\n'
                    f'wrk.headers["Content-Type"] = "application/json"\n'
                    f'wrk.headers["Authorization"] = "Bearer {key}"\n')
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{round(duration_s)}s", "-s", script_path,
                              f"http://127.0.0.1:{port}/v1/chat/completions"],
                             capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw failed requests:\n{out}")
    match = re.search(r"Requests/sec:\s*([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1))


def _wait_listening(port: int, timeout_s: float = 60.0) -> None:
    """Return once 127.0.0.1:`port` accepts a connection; RuntimeError after `timeout_s`."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s") from None
            time.sleep(0.05)


def _measure(kind: str, payloads: dict[str, bytes], plan: dict[str, dict[int, int]],
             wrk_s: float) -> dict[tuple[str, int | str], dict[str, float]]:
    import psutil

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_server_main, args=(kind, queue), daemon=True)
    proc.start()
    try:
        port, key = queue.get(timeout=120)
        _wait_listening(port)  # the baseline announces its port before uvicorn listens on it
        ps = psutil.Process(proc.pid)
        results: dict[tuple[str, int | str], dict[str, float]] = {}
        for size, by_conc in plan.items():
            for conc, n in by_conc.items():
                cpu0 = sum(ps.cpu_times()[:2])
                lat, wall = asyncio.run(_drive(port, key, payloads[size], conc, n))
                cpu_s = sum(ps.cpu_times()[:2]) - cpu0
                lat_ms = sorted(x * 1e3 for x in lat)
                results[(size, conc)] = {"p50": statistics.median(lat_ms), "p99": lat_ms[int(0.99 * (len(lat_ms) - 1))],
                                         "cpu_ms": cpu_s * 1e3 / (n + min(20, n)), "rps": n / wall}
            cpu0 = sum(ps.cpu_times()[:2])
            rps = _wrk(port, key, payloads[size], WRK_CONNECTIONS, wrk_s)
            if rps is not None:
                cpu_s = sum(ps.cpu_times()[:2]) - cpu0
                results[(size, "wrk")] = {"rps": rps, "cpu_ms": cpu_s * 1e3 / max(rps * wrk_s, 1.0)}
        return results
    finally:
        proc.terminate()
        proc.join(10)


def _render_ms(bodies: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float, int]]:
    """Per body: median render ms with the per-message id cache cleared (cold) and warm, and
    the number of prompt ids."""
    from harnessrl.chat.layer import ChatLayer, normalize_messages, normalize_tools
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model

    chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)))
    assert chat.segments is not None
    out = {}
    for size, body in bodies.items():
        msgs, tools = normalize_messages(body["messages"]), normalize_tools(body.get("tools"))
        cold, warm = [], []
        for _ in range(15):
            chat.segments.clear()
            t0 = time.perf_counter()
            ids = chat.render(msgs, tools)
            t1 = time.perf_counter()
            assert chat.render(msgs, tools) == ids
            t2 = time.perf_counter()
            chat.render(msgs, tools)
            warm.append((time.perf_counter() - t2) * 1e3)
            cold.append((t1 - t0) * 1e3)
        out[size] = (statistics.median(cold), statistics.median(warm), len(ids))
    return out


def _report(size: str, payload: bytes, render: tuple[float, float, int], plan: dict[int, int],
            base: dict[tuple[str, int | str], dict[str, float]], proxy: dict[tuple[str, int | str], dict[str, float]]) -> None:
    cold_ms, warm_ms, n_ids = render
    print(f"\n== {size}: body {len(payload) / 1024:.1f} KB, {n_ids} prompt ids; chat-template render "
          f"{cold_ms:.2f} ms cold, {warm_ms:.2f} ms with the message-id cache warm (in-process medians)")
    print(f"{'conc':>4} | {'base p50':>8} {'proxy p50':>9} {'added p50 excl. render':>22} | "
          f"{'base p99':>8} {'proxy p99':>9} | {'cpu ms/call b/p (ratio)':>24} | {'req/s b/p (ratio)':>22}")
    for conc in plan:
        b, p = base[(size, conc)], proxy[(size, conc)]
        added = p["p50"] - b["p50"] - warm_ms
        print(f"{conc:>4} | {b['p50']:8.3f} {p['p50']:9.3f} {added:22.3f} | {b['p99']:8.3f} {p['p99']:9.3f} | "
              f"{b['cpu_ms']:6.3f}/{p['cpu_ms']:6.3f} ({p['cpu_ms'] / b['cpu_ms']:4.1f}x)    | "
              f"{b['rps']:7.0f}/{p['rps']:7.0f} ({p['rps'] / b['rps']:4.2f}x)")
    if (size, "wrk") in proxy and (size, "wrk") in base:
        b, p = base[(size, "wrk")], proxy[(size, "wrk")]
        print(f" wrk | throughput ceiling, {WRK_CONNECTIONS} keep-alive connections, load generator in its own "
              f"process | {b['cpu_ms']:6.3f}/{p['cpu_ms']:6.3f} ({p['cpu_ms'] / b['cpu_ms']:4.1f}x)    | "
              f"{b['rps']:7.0f}/{p['rps']:7.0f} ({p['rps'] / b['rps']:4.2f}x)")


def _wrk_only(payload: bytes, wrk_s: float) -> None:
    """The small call's wrk ceiling, baseline then proxy, then the proxy with malloc set as a CPU
    training process sets it (`proxy-retained`: one arena, no trim; the agents' listener of
    `harnessrl train` runs in that process), with the load average before each."""
    for kind in ("baseline", "proxy", "proxy-retained"):
        load = os.getloadavg()[0]
        result = _measure(kind, {"small": payload}, {"small": {}}, wrk_s)[("small", "wrk")]
        print(f"{kind:>14}: {result['rps']:7.0f} req/s with wrk ({WRK_CONNECTIONS} connections, {wrk_s:g} s), "
              f"server CPU {result['cpu_ms']:.3f} ms/call (ceiling {1e3 / result['cpu_ms']:.0f} req/s per core); "
              f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--wrk-only", action="store_true", help="only the small call's wrk ceiling")
    parser.add_argument("--wrk-s", type=float, default=None, help="seconds of each wrk run")
    args = parser.parse_args()
    import orjson

    if args.wrk_only:
        _wrk_only(orjson.dumps(make_body("small")), args.wrk_s or 5.0)
        return

    scale = 0.3 if args.quick else 1.0
    bodies = {"small": make_body("small"), "agent": make_body("agent")}
    payloads = {k: orjson.dumps(v) for k, v in bodies.items()}
    plan = {"small": {1: int(600 * scale), 8: int(1500 * scale), 32: int(3000 * scale)},
            "agent": {1: int(120 * scale), 8: int(200 * scale), 32: int(300 * scale)}}
    wrk_s = args.wrk_s or (2.0 if args.quick else 5.0)
    print(f"load average {os.getloadavg()[0]:.2f} at start")
    render = _render_ms(bodies)
    base = _measure("baseline", payloads, plan, wrk_s)
    proxy = _measure("proxy", payloads, plan, wrk_s)
    for size in ("small", "agent"):
        _report(size, payloads[size], render[size], plan[size], base, proxy)
    print("\nadded p50 = proxy p50 - baseline p50 - warm render median (the bench re-sends one body, so the "
          "proxy's message-id cache is warm, as for an agent's re-sent history; new text costs the cold rate)."
          "\nLatencies in ms; ratios proxy/baseline; the aiohttp client shares the machine with the server."
          f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
