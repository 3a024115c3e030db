"""Memory check: the proxy's RSS over many sessions opened, used and closed.

Each run is its own process: a `ProxyServer` on 127.0.0.1 with an instant engine (no compute,
16 fixed ids) and the real SmolLM2 tokenizer, and a raw-socket HTTP/1.1 client in the same
event loop (prebuilt request bytes, one keep-alive connection per session; the client keeps
nothing per finished session). A session makes `--turns` chat calls whose history grows as an
agent's does (each turn adds the reply and a ~200-character tool result), then is closed
through `ProxyServer.close_session`, as the rollout runner does. `--concurrency` sessions run
at once.

Two configurations:
  * `evict` (the default proxy): traces go to a trace file at close; a closed session leaves
    only its revoked-key record (bounded by `max_revoked_keys`) in memory.
  * `keep` (the baseline, what the proxy did before): no trace file and every closed trace
    kept in memory (`max_closed_traces` = the number of sessions).

RSS (VmRSS, after `gc.collect()`) is read after a warm-up of `--warmup` sessions (tokenizer
caches, allocator pools) and at the end; the growth is reported in total and per session,
with the ratio keep/evict per session.

Hostile bodies (`--hostile`, its own process, same server, tokenizer and raw-socket client):
  * `ignored`: `--hostile-calls` (30) ok calls of one session, each with a 6 MiB `user`
    field (a field the proxy ignores); the session is closed and its trace written;
  * `rejected`: 20 calls of another session, each replaying a tool call whose arguments are
    6 MiB, refused (the prompt exceeds the engine's context: 400);
    (these two with `max_session_body_bytes` at 1 GiB, so that bound does not hide them)
  * `budget`: calls of 6 MiB message content in a third session until the proxy refuses them
    (`max_session_body_bytes`).
RSS (after `gc.collect()`) before each phase, after its calls with the session still open (what
the trainer holds while the rollout runs) and after the close, the trace line the session wrote
(what `rollouts.jsonl` would hold) and, as the baseline measured in the same run, the same
figures for the same number of calls with the same bodies minus the large field (growth below
1 MB counts as 1 MB in the ratio).

Usage: `.venv/bin/python bench/proxy_memory.py [--sessions 5000] [--turns 20]
[--baseline-sessions 1000] [--concurrency 32]`; `.venv/bin/python bench/proxy_memory.py
--hostile [--hostile-calls 30]`. The baseline runs fewer sessions by default
(its memory grows with every turn kept); its per-session figure is what is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy import InstantEngine  # bench/proxy.py, beside this script

SYSTEM = "You are a coding agent. Use the bash tool to inspect and edit files. " * 4
TOOL_RESULT = "total 12\n-rw-r--r-- 1 agent agent  220 main.py\n-rw-r--r-- 1 agent agent 1024 test_main.py\n" * 2


def rss_mb() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def request_bytes(key: str, messages: list[dict[str, Any]]) -> bytes:
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": 16}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return status, await reader.readexactly(length)


async def one_session(proxy: Any, index: int, turns: int) -> None:
    session_id, key = proxy.open_session(f"r{index}")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Task {index}: make the tests pass."}]
    try:
        for turn in range(turns):
            writer.write(request_bytes(key, messages))
            status, body = await read_response(reader)
            assert status == 200, body[:300]
            reply = json.loads(body)["choices"][0]["message"]["content"] or ""
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"[turn {turn}] {TOOL_RESULT}"}]
    finally:
        writer.close()
    trace = proxy.close_session(session_id)
    assert len(trace.turns) == turns and all(t.status == "ok" for t in trace.turns)


async def run(mode: str, sessions: int, turns: int, concurrency: int, warmup: int) -> dict[str, float]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    tmp = Path(tempfile.mkdtemp(prefix="proxy-memory-"))
    if mode == "evict":
        config = ProxyConfig(port=0, trace_path=tmp / "traces.jsonl", sampling=SamplingConfig(max_tokens=16))
    else:
        config = ProxyConfig(port=0, trace_path=None, max_closed_traces=sessions + warmup,
                             sampling=SamplingConfig(max_tokens=16))
    chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)), eos_token_ids=(2,))
    async with ProxyServer(InstantEngine(), chat, config) as proxy:
        counter = iter(range(sessions + warmup))

        async def worker(limit: int) -> None:
            for i in counter:
                if i >= limit:
                    return
                await one_session(proxy, i, turns)

        await asyncio.gather(*(worker(warmup) for _ in range(concurrency)))
        counter = iter(range(warmup, warmup + sessions))
        before = rss_mb()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(warmup + sessions) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        after = rss_mb()
        remembered = proxy.store.closed_sessions
    file_mb = (tmp / "traces.jsonl").stat().st_size / 2**20 if mode == "evict" else 0.0
    shutil.rmtree(tmp)
    return {"sessions": sessions, "turns": turns, "rss_before_mb": before, "rss_after_mb": after,
            "growth_mb": after - before, "growth_kb_per_session": (after - before) * 1024 / sessions,
            "calls_per_s": sessions * turns / elapsed, "seconds": elapsed, "trace_file_mb": file_mb,
            "closed_sessions_remembered": remembered}


def raw_request(key: str, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


BIG = 6 * 1024 * 1024
"""Bytes of the large field of a hostile call."""


def hostile_body(kind: str, index: int, big: bool) -> bytes:
    """A chat body of phase `kind` (module docstring); `big=False` is its baseline (the same call
    without the large field). Each body differs (`index`), as an attacker's would."""
    filler = (f"{index:08d}" + "x" * 56) * (BIG // 64) if big else f"{index:08d}"
    user = [{"role": "user", "content": f"Task {index}: make the tests pass."}]
    if kind == "ignored":
        return json.dumps({"model": "m", "messages": user, "max_tokens": 16, "user": filler}).encode()
    if kind == "rejected":
        call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": filler})}}
        messages = [*user, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        return json.dumps({"model": "m", "messages": messages, "max_tokens": 16}).encode()
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": filler}], "max_tokens": 16}).encode()


async def hostile_phase(proxy: Any, kind: str, calls: int, big: bool) -> dict[str, Any]:
    session_id, key = proxy.open_session(f"{kind}-{big}")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port, limit=2**24)
    statuses: dict[int, int] = {}
    before = rss_mb()
    try:
        for i in range(calls):
            writer.write(raw_request(key, hostile_body(kind, i, big)))
            status, _ = await read_response(reader)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()
    live = rss_mb()  # what the trainer holds while the rollout runs
    path = proxy.config.trace_path
    offset = path.stat().st_size if path.exists() else 0
    trace = proxy.close_session(session_id)
    line_mb = (path.stat().st_size - offset) / 2**20
    del trace
    after = rss_mb()
    return {"kind": kind, "big": big, "calls": calls, "statuses": statuses, "live_mb": live - before,
            "growth_mb": after - before, "trace_line_mb": line_mb}


async def run_hostile(calls: int) -> list[dict[str, Any]]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    tmp = Path(tempfile.mkdtemp(prefix="proxy-memory-"))
    engine = InstantEngine()
    engine.max_context_tokens = 8192  # a 6 MiB argument is far past it: the call is refused
    chat = ChatLayer(load_tokenizer(resolve_model(TINY_MODEL)), eos_token_ids=(2,))
    rows = []
    for phases, budget in (((("ignored", calls), ("rejected", 20)), 2**30), ((("budget", 24),), None)):
        # the first two phases without the session budget (what they measure is not that bound)
        knob = {} if budget is None or "max_session_body_bytes" not in ProxyConfig.model_fields \
            else {"max_session_body_bytes": budget}  # (a proxy without the bound runs these phases as they are)
        config = ProxyConfig(port=0, trace_path=tmp / "traces.jsonl", **knob, sampling=SamplingConfig(max_tokens=16))
        async with ProxyServer(engine, chat, config) as proxy:
            await hostile_phase(proxy, "ignored", 3, False)  # warm-up: caches, allocator pools
            for kind, n in phases:
                rows.append(await hostile_phase(proxy, kind, n, False))
                rows.append(await hostile_phase(proxy, kind, n, True))
    shutil.rmtree(tmp)
    return rows


def _child(args: tuple[Any, ...], queue: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from harnessrl.proxy.server import run_loop

    queue.put(run_loop(run_hostile(*args[1:]) if args[0] == "hostile" else run(*args)))


def in_child(mode: str, *args: int) -> Any:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=((mode, *args), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def hostile_main(calls: int) -> None:
    rows = in_child("hostile", calls)
    print(f"{'phase':9} {'calls':>5} {'statuses':>18} {'RSS open':>9} {'closed':>9} {'trace line':>11}"
          f"   baseline (no large field): open, closed, line")
    for base, big in zip(rows[::2], rows[1::2], strict=True):
        status = ",".join(f"{k}x{v}" for k, v in sorted(big["statuses"].items()))
        print(f"{big['kind']:9} {big['calls']:5d} {status:>18} {big['live_mb']:7.1f}MB {big['growth_mb']:7.1f}MB "
              f"{big['trace_line_mb']:9.2f}MB   {base['live_mb']:6.1f}MB {base['growth_mb']:6.1f}MB "
              f"{base['trace_line_mb']:6.2f}MB; open ratio {big['live_mb'] / max(base['live_mb'], 1.0):.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--baseline-sessions", type=int, default=1000,
                        help="sessions of the keep-everything baseline (0 skips it)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--hostile", action="store_true", help="the hostile-body phases instead (module docstring)")
    parser.add_argument("--hostile-calls", type=int, default=30)
    args = parser.parse_args()
    if args.hostile:
        hostile_main(args.hostile_calls)
        return
    rows = [("evict", in_child("evict", args.sessions, args.turns, args.concurrency, args.warmup))]
    if args.baseline_sessions > 0:
        rows.append(("keep", in_child("keep", args.baseline_sessions, args.turns, args.concurrency, args.warmup)))
    print(f"{'mode':6} {'sessions':>8} {'turns':>5} {'RSS before':>10} {'RSS after':>10} {'growth':>9} "
          f"{'KB/session':>10} {'calls/s':>8} {'remembered':>10}")
    for mode, r in rows:
        print(f"{mode:6} {r['sessions']:8d} {r['turns']:5d} {r['rss_before_mb']:8.1f}MB {r['rss_after_mb']:8.1f}MB "
              f"{r['growth_mb']:7.1f}MB {r['growth_kb_per_session']:10.2f} {r['calls_per_s']:8.0f} "
              f"{r['closed_sessions_remembered']:10d}")
    if len(rows) == 2:
        evict, keep = rows[0][1], rows[1][1]
        ratio = keep["growth_kb_per_session"] / max(evict["growth_kb_per_session"], 1e-9)
        print(f"per-session growth, keep / evict: {ratio:.0f}x (trace file written: {evict['trace_file_mb']:.1f} MB)")


if __name__ == "__main__":
    main()
