"""The one-call agent program (`harnessrl.recipes.smoke_agent`) run for real against a loopback
HTTP server: the request it sends, the answer it writes, its argument checks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from harnessrl.recipes.smoke_agent import one_call_agent


def test_the_agent_makes_one_call_and_writes_the_reply(tmp_path: Path) -> None:
    seen: list[tuple[str, str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Authorization"], body))
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi there"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = one_call_agent(max_tokens=7, timeout_s=5)
        assert "{" not in script and "}" not in script, "the command harness templates file contents"
        (tmp_path / "agent.py").write_text(script)
        base = f"http://127.0.0.1:{server.server_port}/v1"
        done = subprocess.run([sys.executable, "agent.py", base, "k-1", "m", "0"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "answer.txt").read_text() == "hi there"
    assert len(seen) == 1
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k-1"
    assert body == {"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": "Say hi."}]}


@pytest.mark.parametrize(("max_tokens", "timeout_s", "field"), [(0, 5, "max_tokens"), (True, 5, "max_tokens"),
                                                              (4, 0, "timeout_s")])
def test_bad_arguments_name_the_field(max_tokens: object, timeout_s: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        one_call_agent(max_tokens, timeout_s)  # type: ignore[arg-type]
