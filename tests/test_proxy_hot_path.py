"""The agents' hot path (`proxy.app.serve_post`): exact POST routes answered without Starlette's
middleware and router give the same answers as through them, and anything else falls through."""

from __future__ import annotations

import httpx

from fakes import FakeEngine
from harnessrl.engine.chat import ChatLayer
from harnessrl.proxy.app import ProxyDeps, make_app, serve_post
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import native_protocols
from harnessrl.proxy.sessions import SessionStore

BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}


async def test_hot_path_answers_as_the_app_does(tokenizer) -> None:  # noqa: ANN001
    store = SessionStore()
    deps = ProxyDeps(CaptureDeps(FakeEngine(completion_ids=[5, 6, 7]), ChatLayer(tokenizer), ProxyConfig()), store)
    app = make_app(deps, native_protocols())
    taken: list[tuple[str, str, bool]] = []

    async def hot(scope, receive, send) -> None:  # noqa: ANN001 - the way ProxyServer._route dispatches
        served = await serve_post(app, scope, receive, send)
        taken.append((scope["method"], scope["path"], served))
        if not served:
            await app(scope, receive, send)

    clients = {name: httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://127.0.0.1")
               for name, a in (("hot", hot), ("app", app))}
    session = store.open("r")
    auth = {"authorization": f"Bearer {session.key}"}
    calls = [
        ("POST", "/v1/chat/completions", BODY, auth),  # hot
        ("POST", "/v1/chat/completions", BODY, {"authorization": "Bearer nope"}),  # hot: 401
        ("POST", "/v1/chat/completions", {"messages": "x"}, auth),  # hot: 400
        ("POST", f"/r/{session.key}/v1/chat/completions", BODY, {}),  # keyed path: through the router
        ("GET", "/v1/models", None, auth),  # GET: through the router
        ("POST", "/v1/nowhere", BODY, auth),  # unknown: the router's 404
    ]
    answers: dict[str, list[tuple[int, object]]] = {"hot": [], "app": []}
    for name, client in clients.items():
        for method, path, body, headers in calls:
            r = await client.request(method, path, json=body, headers=headers)
            payload = r.json()
            if r.status_code == 200 and "id" in payload:
                payload = {k: v for k, v in payload.items() if k not in ("id", "created")}
            answers[name].append((r.status_code, payload))
    assert answers["hot"] == answers["app"]
    assert [a[0] for a in answers["hot"]] == [200, 401, 400, 200, 200, 404]
    assert [t[2] for t in taken] == [True, True, True, False, False, False]
    # per client: the two answered calls and the refused body (an error turn); the 401 is no turn
    assert len(store.close(session.session_id).turns) == 2 * 3
