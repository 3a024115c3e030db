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


class _FailsOnThreeTokens(FakeEngine):
    """An engine that fails the calls asking for exactly 3 tokens."""

    async def generate(self, prompt_ids, sampling, *, affinity=None, cache_scope=None):  # noqa: ANN001, ANN201
        if sampling.max_tokens == 3:
            from harnessrl.errors import EngineError

            raise EngineError("the engine went away")
        return await super().generate(prompt_ids, sampling, affinity=affinity)


async def test_hot_chat_path_gives_the_routers_bytes_and_turns(tokenizer, monkeypatch) -> None:  # noqa: ANN001
    """`POST /v1/chat/completions` through `serve_post` (the route's endpoint without the
    router) and through Starlette's router (`_keyed(chat_completions)`):
    the same status, headers and body bytes (but the random id and the clock), and the same
    recorded turns (but their timing), for answered calls and every kind of refusal."""
    import re

    import orjson

    from harnessrl.proxy import app as app_module

    real_prepare = app_module.prepare_chat

    async def buggy_prepare(deps, session, body, headers, origin=None):  # noqa: ANN001, ANN202
        if body.get("model") == "crash":
            raise RuntimeError("a proxy bug")
        return await real_prepare(deps, session, body, headers, origin)

    monkeypatch.setattr(app_module, "prepare_chat", buggy_prepare)
    tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
    config = ProxyConfig(max_body_bytes=4096, max_session_body_bytes=20_000)
    sides = {}
    for name in ("hot", "app"):
        store = SessionStore(max_session_body_bytes=config.max_session_body_bytes)
        deps = ProxyDeps(CaptureDeps(_FailsOnThreeTokens(completion_ids=[5, 6, 7]), ChatLayer(tokenizer), config),
                         store)
        app = make_app(deps, native_protocols())

        async def hot(scope, receive, send, app=app) -> None:  # noqa: ANN001
            assert await serve_post(app, scope, receive, send), scope["path"]

        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=hot if name == "hot" else app),
                                   base_url="http://127.0.0.1")
        sides[name] = (client, store, store.open("r"))

    def calls(key: str) -> list[tuple[str, bytes, dict[str, str]]]:
        auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        js = orjson.dumps
        return [
            ("", js(BODY), auth),
            ("", js({**BODY, "tools": [tool], "stop": ["x"], "user": "u"}), {**auth, "user-agent": "a" * 3000}),
            ("", js({**BODY, "stream": True, "stream_options": {"include_usage": True}}), auth),
            ("", js({**BODY, "logprobs": True}), auth),
            ("", js({**BODY, "max_tokens": 3}), auth),  # engine error: 503
            ("", js({**BODY, "model": "crash"}), auth),  # proxy bug: JSON 500
            ("", b"{not json", auth),
            ("", b"[1, 2]", auth),
            ("", b"[" * 70 + b"]" * 70, auth),
            ("", js({**BODY, "n": 2}), auth),
            ("", js({**BODY, "wat": 1}), auth),
            ("", js({"messages": []}), auth),
            ("", js({**BODY, "stop": ["s"] * 17}), auth),
            ("", js({**BODY, "stop": "s" * 300}), auth),
            ("", js({**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}), auth),  # over max_body_bytes
            ("", js(BODY), {"x-api-key": key}),
            ("?key=" + key, js(BODY), {}),
            ("", js(BODY), {"authorization": "Bearer "}),  # an empty bearer key: 401, no other form tried
            ("?key=" + key, js(BODY), {"authorization": "Bearer "}),
            ("", js(BODY), {"authorization": "Bearer nope"}),
            ("", js(BODY), {}),
        ] + [("", js({**BODY, "messages": [{"role": "user", "content": "y" * 3900}]}), auth)] * 6  # session budget

    normalized: dict[str, list[tuple[int, list[tuple[str, str]], bytes]]] = {}
    for name, (client, store, session) in sides.items():
        answers = []
        for query, body, headers in calls(session.key):
            r = await client.post("/v1/chat/completions" + query, content=body, headers=headers)
            content = re.sub(rb'"id":"chatcmpl-[0-9a-f]{24}"', b'"id":"ID"', r.content)
            content = re.sub(rb'"created":\d+', b'"created":0', content)
            answers.append((r.status_code, r.headers.multi_items(), content))
        normalized[name] = answers
    hot_answers, app_answers = normalized["hot"], normalized["app"]
    assert len(hot_answers) == len(app_answers)
    for i, (a, b) in enumerate(zip(hot_answers, app_answers, strict=True)):
        assert a == b, i
    statuses = [a[0] for a in hot_answers]
    assert statuses[:15] == [200, 200, 200, 200, 503, 500, 400, 400, 400, 400, 400, 400, 400, 400, 413]
    assert statuses[15:21] == [200, 200, 401, 401, 401, 401] and 413 in statuses[21:]
    assert b"data: [DONE]" in hot_answers[2][2]

    def turns(store: SessionStore, session_id: str) -> list[dict[str, object]]:
        trace = store.close(session_id)
        return [{k: v for k, v in t.model_dump().items() if k not in ("started_at", "latency_s")}
                for t in trace.turns] + [{"refused": trace.refused_calls, "rejected": trace.rejected_calls}]

    recorded = {name: turns(store, session.session_id) for name, (_, store, session) in sides.items()}
    assert recorded["hot"] == recorded["app"]
    assert len(recorded["hot"]) > 10


async def test_request_limits_are_found_by_the_configs_identity() -> None:
    from harnessrl.proxy.wire import RequestLimits, limits_of

    config = ProxyConfig(max_stop_strings=3)
    limits = limits_of(config)
    assert limits is limits_of(config) and limits == RequestLimits(max_stop_strings=3)
    other = config.model_copy(update={"max_tools": 7})
    assert limits_of(other) == RequestLimits(max_stop_strings=3, max_tools=7)
    assert limits_of(ProxyConfig(max_stop_strings=3)) == limits  # an equal config: equal limits


def test_completion_ids_are_random_hex_and_a_forked_child_draws_its_own() -> None:
    import os
    import re

    from harnessrl.proxy.capture import completion_id

    ids = [completion_id() for _ in range(1000)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        try:
            os.write(write, completion_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert child != completion_id() and re.fullmatch(r"chatcmpl-[0-9a-f]{24}", child)
