"""The agents' hot path (`proxy.app.serve_post`): exact POST routes answered without Starlette's
middleware and router give the same answers as through them, and anything else falls through."""

from __future__ import annotations

import httpx

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
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


def test_construct_builds_what_model_construct_builds() -> None:
    from harnessrl.proxy.capture import construct
    from harnessrl.types import Reply, ReplyToolCall, Sampling, Turn

    values = dict(turn_index=3, protocol="chat.completions", request={"messages": []},
                  reply=construct(Reply, content=None, reasoning="r", tool_calls=[
                      construct(ReplyToolCall, id="call_1", name="bash", arguments="{}")]),
                  raw_request=None, raw_response=None, prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5],
                  sampling=Sampling(max_tokens=4), policy_version=2, finish_reason="stop", status="ok", error=None,
                  started_at=1.0, latency_s=0.25, headers={"user-agent": "x"}, request_kind=None,
                  usage={"prompt_tokens": 2}, notes=[])
    fast, slow = construct(Turn, **values), Turn.model_construct(**values)
    assert fast == slow and fast.model_fields_set == slow.model_fields_set
    assert fast.model_dump_json() == slow.model_dump_json()
    assert Turn.model_validate_json(fast.model_dump_json()) == slow
    fast.status = "unfaithful"  # assignment works as on any model
    assert fast.status == "unfaithful" and fast.model_dump()["status"] == "unfaithful"
    partial = construct(Turn, turn_index=1, request={}, started_at=1.0)  # not every field: model_construct's defaults
    assert partial == Turn.model_construct(turn_index=1, request={}, started_at=1.0) and partial.notes == []


async def test_request_headers_are_read_once_first_value_wins() -> None:
    from starlette.requests import Request

    from harnessrl.proxy.app import request_headers, session_key

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"authorization", b"Bearer first"), (b"x-session-id", b"s"),
                         (b"authorization", b"Bearer second")]}
    request = Request(scope)
    headers = request_headers(request)
    assert headers == {"authorization": "Bearer first", "x-session-id": "s"}
    assert request_headers(request) is headers and session_key(request) == "first"
    assert request.headers.get("authorization") == headers["authorization"]  # as Starlette reads it
