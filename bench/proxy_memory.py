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

Usage: `.venv/bin/python bench/proxy_memory.py [--sessions 5000] [--turns 20]
[--baseline-sessions 1000] [--concurrency 32]`. The baseline runs fewer sessions by default
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
    from harnessrl.engine.chat import ChatLayer
    from harnessrl.engine.model_store import TINY_MODEL, load_tokenizer, resolve_model
    from harnessrl.proxy.config import ProxyConfig
    from harnessrl.proxy.server import ProxyServer

    tmp = Path(tempfile.mkdtemp(prefix="proxy-memory-"))
    if mode == "evict":
        config = ProxyConfig(port=0, trace_path=tmp / "traces.jsonl", max_tokens_cap=16)
    else:
        config = ProxyConfig(port=0, trace_path=None, max_tokens_cap=16, max_closed_traces=sessions + warmup)
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


def _child(args: tuple[str, int, int, int, int], queue: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from harnessrl.proxy.server import run_loop

    queue.put(run_loop(run(*args)))


def in_child(mode: str, sessions: int, turns: int, concurrency: int, warmup: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=((mode, sessions, turns, concurrency, warmup), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--baseline-sessions", type=int, default=1000,
                        help="sessions of the keep-everything baseline (0 skips it)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
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
