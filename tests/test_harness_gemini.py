"""Gemini CLI against the real proxy's Google route (tiny random model) in a real local sandbox:
headless, key and base URL from its own `~/.gemini/.env`, every call recorded token-faithful
with protocol `google`; its config files and output parsing on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_harness_protocol_agents import ENDPOINT, _assert_recorded, _require_agent, _rollout, engine, proxy  # noqa: F401

from harnessrl.harness.gemini_cli import GeminiCliConfig, GeminiCliHarness, dotenv, interpret_output, settings
from harnessrl.harness.options import canonical_kind
from harnessrl.harness.select import make_harness


@pytest.mark.agents
async def test_gemini_cli_rollout_is_recorded(proxy: object, sandbox_root: Path) -> None:  # noqa: F811
    _require_agent("gemini-cli")
    result, trace, _ = await _rollout(proxy, sandbox_root, GeminiCliHarness(), "gemini-cli")
    _assert_recorded(result, trace, "google")
    first = trace.turns[0]
    assert "Make hello.py print 42." in str(first.request["messages"])
    assert first.request.get("tools"), "Gemini CLI sends its tool declarations"
    assert "Make hello.py print 42." in json.dumps(first.raw_request["contents"])
    assert result.final_answer is not None or result.error is not None


def test_config_files_and_output() -> None:
    assert dotenv(ENDPOINT) == "GEMINI_API_KEY=hrl-k\nGOOGLE_GEMINI_BASE_URL=http://127.0.0.1:9\n"
    assert settings()["security"]["auth"]["selectedType"] == "gemini-api-key"
    out = 'Warning: colours\n{\n  "session_id": "s",\n  "response": "42",\n  "stats": {"a": {}}\n}\n'
    assert interpret_output(out, "").final_answer == "42"
    bad = interpret_output('{"session_id": "s", "error": {"type": "Error", "message": "no auth", "code": 41}}', "")
    assert bad.failed and bad.error_detail == "no auth"
    assert interpret_output("not json {", "").final_answer is None
    assert canonical_kind("gemini") == "gemini-cli"
    harness = make_harness("gemini-cli", {"extra_args": ["--approval-mode", "yolo"]})
    assert isinstance(harness, GeminiCliHarness) and harness.config.extra_args == ["--approval-mode", "yolo"]
    req = GeminiCliConfig().requirements()
    assert (req.protocol, req.min_context_tokens) == ("google", 16384)
    assert json.loads(json.dumps(settings()))["telemetry"] == {"enabled": False}
