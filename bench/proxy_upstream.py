"""Benchmark: the proxy in front of an HTTP engine (a fast stub vLLM server) against OpenEnv's
interception proxy and a direct call, in one run, with the arms' repeats interleaved.

Every server runs in its own child process on a real 127.0.0.1 socket, all started before the
first measurement. Two stubs answer instantly with vLLM-shaped replies (16 fixed ids, logprobs,
usage):
  * completions stub: `/v1/completions` with a token-id prompt, as `VllmEngine` calls vLLM
    (the reply echoes `prompt_token_ids`, as vLLM does with `return_token_ids`);
  * chat stub: `/v1/chat/completions` (`bench/proxy_openenv.py`'s), what OpenEnv forwards to.
Arms, same bodies (`bench/proxy.py`'s: small ~1 KB chat call; agent ~60 KB, ~12.5k prompt ids):
  * direct-completions: the completions stub called with the token ids the proxy would send
    (the floor of `VllmEngine`'s hop);
  * harnessrl: `ProxyServer` + `VllmEngine` (`engine/vllm/http.py`) in front of the completions stub, with the
    proxy config `harnessrl train` builds for its agents' listener (`runtime.proxy_config_for`
    of the default run config; only the per-session turn cap and body budget are lifted, as one
    session takes every call) on `run_loop`, as `train` runs it: auth, validation, chat-template render
    (message-id cache warm: the same body is re-sent, as an agent re-sends its history),
    sampling, the upstream call, parse and checks, record;
  * direct-chat: the chat stub called with the chat body;
  * openenv: OpenEnv 0.10 `CaptureServer` (FastAPI + httpx) in front of the chat stub.
Latency: `--pairs` rounds (default 5); each round measures every arm once per body at
concurrency 1, in an order rotated by one arm per round, so slow phases of a shared machine
fall on every arm alike. The added latency of a round is the arm's p50 minus its direct arm's
p50 in the same round; reported as the median over rounds with its range (min-max), with the
serving process's CPU ms per call (psutil, user + system, over the round's calls warm-up
included). Throughput, once per arm after the rounds: requests/s at concurrency 32 (aiohttp
client in this process) and with `wrk` (when installed: one C thread, 32 connections, its own
process), with the serving process's CPU ms per call over the wrk run and the ceiling that gives
(1 / CPU seconds a call: what one core of its own would serve; wrk, the stub and the proxy share
the machine's cores, so the req/s figure also depends on what else runs). Goals of the proxy's
added cost: p50 <= 0.5 ms (small) and <= 1.5 ms (agent), and >= 5,000 small req/s (wrk) through
the harnessrl arm. Its one session takes every call, so its trace grows by every call (~5 KB a
small turn), as a rollout's does; first-touch page faults of that memory are part of the figure.

Usage: `.venv/bin/python bench/proxy_upstream.py [--quick] [--pairs N]` (openenv arm: `pip
install 'harnessrl[openenv]'`; skipped without it). The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def _load(name: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench_proxy = _load("bench_proxy", "proxy.py")
bench_openenv = _load("bench_proxy_openenv", "proxy_openenv.py")
OUT_IDS = bench_proxy.OUT_IDS


def _completions_stub_main(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def completions(request: Any) -> Response:
        body = orjson.loads(await request.body())
        prompt = body["prompt"]
        ids = list(OUT_IDS[: int(body.get("max_tokens") or 16)])
        reply = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "text": "ok", "token_ids": ids, "prompt_token_ids": prompt,
                              "logprobs": {"token_logprobs": [-0.25] * len(ids), "tokens": [f"token_id:{i}" for i in ids]},
                              "finish_reason": "stop" if ids and ids[-1] == 2 else "length"}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                           "total_tokens": len(prompt) + len(ids)}}
        return Response(orjson.dumps(reply), media_type="application/json")

    async def models(request: Any) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model",
                                                                  "max_model_len": 32768}]}),
                        media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio")


def _harnessrl_main(stub_port: int, queue: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from harnessrl.proxy.server import run_loop

    run_loop(_serve_harnessrl(stub_port, queue))


async def _serve_harnessrl(stub_port: int, queue: Any) -> None:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.engine.vllm.client import VllmEngine
    from harnessrl.config import load_config
    from harnessrl.proxy.server import ProxyServer
    from harnessrl.runtime import proxy_config_for

    model_dir = resolve_model(TINY_MODEL)
    engine = VllmEngine([f"http://127.0.0.1:{stub_port}"], served_model="bench", max_context_tokens=32768,
                        model_dir=model_dir, check_processed_logprobs=False)
    chat = ChatLayer(load_tokenizer(model_dir))
    # the agents' listener as `harnessrl train` configures it; one session takes every call of
    # the arm, wrk's included, so the per-session turn cap and body budget are lifted
    config = proxy_config_for(load_config(None), "bench").model_copy(
        update={"max_turns_per_session": 10**9, "max_session_body_bytes": 1 << 60})
    async with ProxyServer(engine, chat, config) as proxy:
        _, key = proxy.open_session("bench")
        queue.put((proxy.port, key))
        await asyncio.Event().wait()


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    """The ids the proxy renders for `body` (what the direct-completions arm sends)."""
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(TINY_MODEL))
    return list(tok.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def _wrk(port: int, path: str, key: str, payload: bytes, seconds: float) -> tuple[float, int] | None:
    """(2xx answers per second, answers in all) that `wrk` got; None without wrk."""
    import re
    import shutil
    import subprocess
    import tempfile

    if shutil.which("wrk") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        body_path, script = os.path.join(tmp, "body.json"), os.path.join(tmp, "post.lua")
        Path(body_path).write_bytes(payload)
        Path(script).write_text(f'wrk.method = "POST"\nwrk.body = io.open("{body_path}", "rb"):read("*a")\n'
                                f'wrk.headers["Content-Type"] = "application/json"\n'
                                f'wrk.headers["Authorization"] = "Bearer {key}"\n')
        out = subprocess.run(["wrk", "-t1", "-c32", f"-d{round(seconds)}s", "--timeout", "30s", "-s", script,
                              f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s*([0-9.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m is None or total is None:
        return None
    if bad:  # failed answers are not throughput: count the 2xx ones only
        print(f"  wrk on :{port}{path}: {bad.group(1)} of {total.group(1)} answers were not 2xx")
        return float(m.group(1)) * (1 - int(bad.group(1)) / int(total.group(1))), int(total.group(1))
    return float(m.group(1)), int(total.group(1))


def _start_arm(name: str, procs: list[Any]) -> dict[str, Any]:
    """Start arm `name`'s stub (and its proxy): its port, key, path and serving process's pid."""
    ctx = mp.get_context("spawn")
    stub_port = bench_openenv._free_port()
    chat_upstream = name in ("direct-chat", "openenv")
    target = bench_openenv._stub_main if chat_upstream else _completions_stub_main
    stub = ctx.Process(target=target, args=(stub_port,), daemon=True)
    stub.start()
    procs.append(stub)
    bench_openenv._wait_port(stub_port)
    path = "/v1/completions" if name == "direct-completions" else "/v1/chat/completions"
    if name in ("direct-completions", "direct-chat"):
        return {"port": stub_port, "key": "none", "path": path, "pid": stub.pid}
    queue = ctx.Queue()
    if name == "openenv":
        proc = ctx.Process(target=bench_openenv._openenv_main, args=(bench_openenv._free_port(), stub_port, queue),
                           daemon=True)
    else:
        proc = ctx.Process(target=_harnessrl_main, args=(stub_port, queue), daemon=True)
    proc.start()
    procs.append(proc)
    port, key = queue.get(timeout=120)
    return {"port": port, "key": key, "path": path, "pid": proc.pid}


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter wrk runs")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved latency rounds (default 5)")
    args = parser.parse_args()
    import orjson

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scale = 0.3 if args.quick else 1.0
    wrk_s = 3.0 if args.quick else 6.0
    bodies = bench_proxy.short_bodies()
    chat_payloads = {k: orjson.dumps(v) for k, v in bodies.items()}
    ids = {k: _prompt_ids(v) for k, v in bodies.items()}
    completion_payloads = {k: orjson.dumps({"model": "bench", "prompt": ids[k], "max_tokens": 16, "temperature": 1.0,
                                            "logprobs": 0, "return_token_ids": True}) for k in bodies}
    one_n = {"small": int(400 * scale), "agent": int(100 * scale)}
    many_n = {"small": int(2000 * scale), "agent": int(300 * scale)}
    names = ["direct-completions", "harnessrl", "direct-chat"]
    if importlib.util.find_spec("openenv") is not None:
        names.append("openenv")
    payloads = {n: completion_payloads if n == "direct-completions" else chat_payloads for n in names}
    floor = {"harnessrl": "direct-completions", "openenv": "direct-chat"}
    p50: dict[tuple[str, str], list[float]] = {(n, size): [] for n in names for size in bodies}
    cpu_ms: dict[tuple[str, str], list[float]] = {(n, size): [] for n in names for size in bodies}
    many: dict[tuple[str, str], float] = {}
    wrk: dict[tuple[str, str], float | None] = {}
    wrk_cpu_ms: dict[tuple[str, str], float | None] = {}
    wrk_load: dict[str, float] = {}
    with bench_proxy.spawned() as procs:
        arms = {n: _start_arm(n, procs) for n in names}
        for rnd in range(args.pairs):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for n in order:
                a = arms[n]
                for size in bodies:
                    cpu0 = _cpu_s(a["pid"])
                    lat, _ = asyncio.run(bench_proxy._drive(a["port"], a["key"], payloads[n][size], 1, one_n[size],
                                                            path=a["path"]))
                    calls = one_n[size] + min(20, one_n[size])
                    cpu_ms[(n, size)].append((_cpu_s(a["pid"]) - cpu0) * 1e3 / calls)
                    p50[(n, size)].append(statistics.median(x * 1e3 for x in lat))
            print(f"round {rnd + 1}/{args.pairs}: " + ", ".join(
                f"{n} small {p50[(n, 'small')][-1]:.3f} ms" for n in names))
        for n in names:
            a = arms[n]
            for size in bodies:
                _, wall = asyncio.run(bench_proxy._drive(a["port"], a["key"], payloads[n][size], 32, many_n[size],
                                                         path=a["path"]))
                many[(n, size)] = many_n[size] / wall
                cpu0 = _cpu_s(a["pid"])
                got = _wrk(a["port"], a["path"], a["key"], payloads[n][size], wrk_s) if wrk_s > 0 else None
                wrk[(n, size)] = None if got is None else got[0]
                wrk_cpu_ms[(n, size)] = None if got is None else (_cpu_s(a["pid"]) - cpu0) * 1e3 / got[1]
                if n == "harnessrl" and size == "small":
                    wrk_load["small"] = os.getloadavg()[0]
    goals = {"small": 0.5, "agent": 1.5}
    for size in bodies:
        print(f"\n== {size}: chat body {len(chat_payloads[size]) / 1024:.1f} KB, {len(ids[size])} prompt ids; "
              f"{args.pairs} interleaved rounds of {one_n[size]} calls")
        print(f"{'arm':>18} | {'p50 c=1 ms, median [range]':>27} | {'added ms, median [range]':>26} | "
              f"{'CPU ms/call':>11} | {'req/s c=32':>10} {'req/s wrk':>9} | {'CPU ms/call wrk':>15} "
              f"{'ceiling req/s':>13}")
        for n in names:
            added = ([a - b for a, b in zip(p50[(n, size)], p50[(floor[n], size)], strict=True)]
                     if n in floor else None)
            w, wc = wrk[(n, size)], wrk_cpu_ms[(n, size)]
            print(f"{n:>18} | {_spread(p50[(n, size)]):>27} | {'-' if added is None else _spread(added):>26} | "
                  f"{statistics.median(cpu_ms[(n, size)]):11.3f} | {many[(n, size)]:10.0f} "
                  f"{'-' if w is None else f'{w:.0f}':>9} | {'-' if wc is None else f'{wc:.3f}':>15} "
                  f"{'-' if not wc else f'{1e3 / wc:.0f}':>13}")
        added = statistics.median(a - b for a, b in zip(p50[("harnessrl", size)], p50[("direct-completions", size)],
                                                        strict=True))
        print(f"goal: harnessrl added p50 <= {goals[size]} ms: {added:.3f} ms -> {'met' if added <= goals[size] else 'NOT met'}")
    w, wc = wrk[("harnessrl", "small")], wrk_cpu_ms[("harnessrl", "small")]
    if w is not None and wc:
        print(f"goal: >= 5,000 small req/s (wrk) through harnessrl: {w:.0f} -> {'met' if w >= 5000 else 'NOT met'} "
              f"(load average {wrk_load['small']:.2f} at its end); the proxy process's own ceiling, one core at "
              f"{wc:.3f} ms CPU a call: {1e3 / wc:.0f} req/s -> {'met' if 1e3 / wc >= 5000 else 'NOT met'}")
    print(f"\nadded = p50 minus the p50 of the same upstream called directly in the same round (harnessrl: the "
          f"completions stub with the rendered ids; openenv: the chat stub with the chat body). The client shares "
          f"the machine; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
