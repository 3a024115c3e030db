"""Command bodies of `harnessrl serve` and `harnessrl session open` (registered by `harnessrl.cli`).

`serve` starts the embedded engine and the proxy in one process and prints the base URL
(with `open_session`, also a session id, its key, and the lines to point an agent at it and
to read its trace back by hand); it runs until Ctrl-C, then closes every session and the
engine. It serves with a run's config (`RunConfig`): the engine settings (`[engine]`: model,
dtype, context, batch) and the sampling the proxy enforces (`[sampling]`: temperature, top_p,
top_k, the max_tokens cap), so a trained checkpoint (`RUN/checkpoints/step-N`, a HF model
directory) is served as it was trained. It prints the admin listener's URL
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
from typing import TYPE_CHECKING

import httpx
from rich.console import Console

from harnessrl.proxy.config import ProxyConfig, proxy_config
from harnessrl.proxy.server import run_loop
from harnessrl.runtime import serving

if TYPE_CHECKING:
    from harnessrl.config import RunConfig

console = Console()


def serve(cfg: RunConfig, host: str = "127.0.0.1", port: int = 8000, admin_port: int = 8001,
          open_session: bool = False, trace_path: Path | None = None) -> None:
    """Run the engine of `cfg.engine` behind the proxy, enforcing `cfg.sampling`, until
    interrupted.

    Raises:
        ModelLoadError: `cfg.engine.model` cannot be found or loaded.
        ConfigError: the host or a port cannot be bound.
    """
    config = proxy_config_for_serve(cfg, host=host, port=port, trace_path=trace_path)

    run_loop(_serve(cfg, config, admin_port, open_session))


def proxy_config_for_serve(cfg: RunConfig, host: str, port: int, trace_path: Path | None = None) -> ProxyConfig:
    """The proxy settings `serve` uses: the run's `[proxy]` bounds and sampling, enforced, on
    `host:port` (`proxy_config`)."""
    return proxy_config(cfg.proxy, cfg.sampling, host=host, port=port, model_name=cfg.engine.model,
                        trace_path=trace_path)


async def _serve(cfg: RunConfig, config: ProxyConfig, admin_port: int, open_session: bool) -> None:
    model = cfg.engine.model
    # the runtime's serving part (`runtime.serving`): launched vLLM servers awaited, Ctrl-C stops them
    async with serving(cfg.engine, cfg.seed, config, admin_port=admin_port,
                       admin_token=os.environ.get("HARNESSRL_ADMIN_TOKEN") or None) as served:
        engine, proxy = served.engine, served.proxy
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        console.print(f"proxy serving [bold]{model}[/] at {proxy.base_url}; Ctrl-C stops", soft_wrap=True)
        s = config.sampling
        console.print(f"sampling (enforced): temperature {s.temperature}, top_p {s.top_p}, "
                      f"top_k {s.top_k}, max_tokens {s.max_tokens}; context "
                      f"{engine.max_context_tokens} tokens", soft_wrap=True)
        console.print(f"admin API at {proxy.admin_url} (POST /admin/sessions ...), token in "
                      f"'Authorization: Bearer':", soft_wrap=True)
        console.print(f"export HARNESSRL_ADMIN_TOKEN={proxy.admin_token}", soft_wrap=True, markup=False)
        if open_session:
            session_id, key = proxy.open_session("manual")
            console.print(f"session {session_id}", soft_wrap=True)
            _print_session(proxy.base_url, key, config.model_name)
            _print_trace_command(proxy.admin_url, session_id)
        await stop.wait()


def session_open(url: str, token: str, rollout_id: str | None = None) -> None:
    """Open a session through a running proxy's admin API (its root URL) and print its key.

    Raises httpx.HTTPStatusError for a refused call (401: wrong token)."""
    response = httpx.post(url.rstrip("/") + "/admin/sessions", json={"rollout_id": rollout_id} if rollout_id else {},
                          headers={"authorization": f"Bearer {token}"}, timeout=10.0)
    response.raise_for_status()
    info = response.json()
    console.print(f"session {info['session_id']}")
    _print_session(info["base_url"], info["key"], "<model>")
    _print_trace_command(url.rstrip("/"), info["session_id"])


def _print_session(base_url: str, key: str, model: str) -> None:
    console.print(f"key: {key}", soft_wrap=True)
    console.print(f"export OPENAI_BASE_URL={base_url} OPENAI_API_KEY={key}", soft_wrap=True, markup=False)
    console.print(
        f"curl -s {base_url}/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Say hi\"}}]}}'",
        soft_wrap=True, markup=False)


def _print_trace_command(admin_url: str, session_id: str) -> None:
    console.print(f"curl -s -H \"Authorization: Bearer $HARNESSRL_ADMIN_TOKEN\" "
                  f"{admin_url}/admin/sessions/{session_id}/trace", soft_wrap=True, markup=False)
