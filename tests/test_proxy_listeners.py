"""The real proxy server's listeners: agents on TCP and on a private Unix socket, the admin API
on its own loopback port behind a per-server bearer token, never on the agents' listeners."""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator

import httpx
import pytest

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.proxy.app import ADMIN_MAX_BODY_BYTES
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def proxy(tokenizer) -> AsyncIterator[ProxyServer]:
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0, sampling=SamplingConfig(max_tokens=8))) as server:
        yield server


async def test_admin_listener_is_separate_and_token_protected(proxy: ProxyServer) -> None:
    assert proxy.admin_port not in (0, proxy.port) and len(proxy.admin_token) >= 32
    auth = {"authorization": f"Bearer {proxy.admin_token}"}
    async with httpx.AsyncClient(base_url=proxy.admin_url, timeout=10) as admin, \
            httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1"), timeout=10) as agents:
        assert (await agents.post("/admin/sessions", headers=auth)).status_code == 404
        assert (await admin.post("/admin/sessions")).status_code == 401
        r = await admin.post("/admin/sessions", headers=auth, content=b"x" * (ADMIN_MAX_BODY_BYTES + 1))
        assert r.status_code == 413
        assert proxy.store.live_sessions == 0
        s = (await admin.post("/admin/sessions", headers=auth, json={"rollout_id": "r"})).json()
        assert s["base_url"] == proxy.base_url  # the agents' listener, not the admin one
        chat = await agents.post("/v1/chat/completions", json={"messages": USER},
                                 headers={"authorization": f"Bearer {s['key']}"})
        assert chat.status_code == 200
        # agent routes are not served on the admin listener
        assert (await admin.post("/v1/chat/completions", json={"messages": USER},
                                 headers={"authorization": f"Bearer {s['key']}"})).status_code == 404
        trace = (await admin.delete(f"/admin/sessions/{s['session_id']}", headers=auth)).json()
        assert [t["status"] for t in trace["turns"]] == ["ok"]


async def test_agents_unix_socket_serves_the_agent_routes(proxy: ProxyServer) -> None:
    path = proxy.agent_socket_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    session_id, key = proxy.open_session("unix")
    transport = httpx.AsyncHTTPTransport(uds=str(path))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=10) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER}, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200
        admin = await client.post("/admin/sessions", headers={"authorization": f"Bearer {proxy.admin_token}"})
        assert admin.status_code == 404
    assert len(proxy.close_session(session_id).turns) == 1


async def test_socket_directory_removed_at_close(tokenizer) -> None:
    server = ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0))
    await server.start()
    directory = server.agent_socket_path.parent
    assert directory.is_dir()
    await server.aclose()
    assert not directory.exists()
