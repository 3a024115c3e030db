"""`harnessrl view RUN_DIR`: the viewer served on loopback.

Routes (GET only): `/` the page, `/api/index.json` the index payload (`index.index_json`),
`/api/rollout/<i>.json` one rollout's payload (`detail.rollout_detail`), built when asked and
kept in a small LRU. Anything else is 404; a bad rollout number is 404 with a JSON error.
Bound to 127.0.0.1 only: the page shows prompts and replies of the run.
"""

from __future__ import annotations

import functools
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson

from harnessrl.hooks import Hooks
from harnessrl.view.detail import rollout_detail
from harnessrl.view.index import RunIndex, index_json
from harnessrl.view.page import render_page

_ROLLOUT = re.compile(r"^/api/rollout/(\d+)\.json$")


class ViewServer:
    """A threaded HTTP server for one run index; `url` once started.

    Args:
        index: the run's index.
        tokenizer, hooks: what `rollout_detail` rebuilds rows with.
        port: TCP port on 127.0.0.1 (0 picks a free one).
    """

    def __init__(self, index: RunIndex, tokenizer: Any, hooks: Hooks, port: int = 0) -> None:
        self.index = index
        lock = threading.Lock()  # the tokenizer and builder run one request at a time
        payload = index_json(index)
        page = render_page(payload, "server").encode()
        index_body = orjson.dumps(payload)

        @functools.lru_cache(maxsize=64)
        def detail(i: int) -> bytes:
            with lock:
                return orjson.dumps(rollout_detail(index, i, tokenizer, hooks))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    return self._send(200, page, "text/html; charset=utf-8")
                if path == "/api/index.json":
                    return self._send(200, index_body, "application/json")
                if (m := _ROLLOUT.match(path)) is not None:
                    try:
                        return self._send(200, detail(int(m.group(1))), "application/json")
                    except IndexError as exc:
                        return self._send(404, orjson.dumps({"error": str(exc)}), "application/json")
                return self._send(404, b'{"error": "not found"}', "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> ViewServer:
        """Serve on a background thread; returns self."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="harnessrl-view", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted."""
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()
