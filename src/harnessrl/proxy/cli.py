"""Command bodies of `harnessrl serve` and `harnessrl session open` (registered by `harnessrl.cli`).

`serve` starts the embedded engine and the proxy in one process and prints the base URL
(with `open_session`, also a session key and lines to point an agent at it by hand); it runs
until Ctrl-C, then closes every session and the engine. It prints the admin listener's URL
(a loopback port of its own, never the agents' port) and its bearer token, generated per
process unless `HARNESSRL_ADMIN_TOKEN` is set. `session_open` asks a running proxy for a
session through that admin API, with that token.

What this module deliberately does not do: import torch at import time (`harnessrl --help`
stays light); the engine is imported inside `serve`.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
from rich.console import Console

from harnessrl.proxy.config import ProxyConfig

console = Console()


def serve(model: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, admin_port: int = 8001,
          open_session: bool = False,
          trace_path: Path | None = None, threads: int | None = 2, temperature: float = 1.0,
          max_tokens_cap: int = 1024) -> None:
    """Run the embedded engine behind the proxy until interrupted."""
    config = ProxyConfig(host=host, port=port, model_name=model, trace_path=trace_path, temperature=temperature,
                         max_tokens_cap=max_tokens_cap)
    from harnessrl.proxy.server import run_loop

    run_loop(_serve(model, config, admin_port, open_session, threads))


async def _serve(model: str, config: ProxyConfig, admin_port: int, open_session: bool, threads: int | None) -> None:
    from harnessrl.engine.chat import ChatLayer
    from harnessrl.engine.embedded import EmbeddedEngine
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    from harnessrl.proxy.server import ProxyServer

    model_dir = resolve_model(model)
    engine = EmbeddedEngine(model_dir, num_threads=threads)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        chat = ChatLayer(load_tokenizer(model_dir), eos_token_ids=engine.eos_token_ids)
        async with ProxyServer(engine, chat, config, admin_port=admin_port,
                               admin_token=os.environ.get("HARNESSRL_ADMIN_TOKEN") or None) as proxy:
            console.print(f"proxy serving [bold]{model}[/] at {proxy.base_url}; Ctrl-C stops")
            console.print(f"admin API at {proxy.admin_url} (POST /admin/sessions ...), token in "
                          f"'Authorization: Bearer':", soft_wrap=True)
            console.print(f"export HARNESSRL_ADMIN_TOKEN={proxy.admin_token}", soft_wrap=True, markup=False)
            if open_session:
                _, key = proxy.open_session("manual")
                _print_session(proxy.base_url, key, config.model_name)
            await stop.wait()
    finally:
        engine.close()


def session_open(url: str, token: str, rollout_id: str | None = None) -> None:
    """Open a session through a running proxy's admin API (its root URL) and print its key.

    Raises httpx.HTTPStatusError for a refused call (401: wrong token)."""
    response = httpx.post(url.rstrip("/") + "/admin/sessions", json={"rollout_id": rollout_id} if rollout_id else {},
                          headers={"authorization": f"Bearer {token}"}, timeout=10.0)
    response.raise_for_status()
    info = response.json()
    console.print(f"session {info['session_id']}")
    _print_session(info["base_url"], info["key"], "<model>")


def _print_session(base_url: str, key: str, model: str) -> None:
    console.print(f"key: {key}", soft_wrap=True)
    console.print(f"export OPENAI_BASE_URL={base_url} OPENAI_API_KEY={key}", soft_wrap=True, markup=False)
    console.print(
        f"curl -s {base_url}/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Say hi\"}}]}}'",
        soft_wrap=True, markup=False)
