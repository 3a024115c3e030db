"""Pi, Codex CLI and Claude Code against the real proxy (tiny random model) in real local
sandboxes, each over its own protocol: pi over chat completions (and the Responses API and
Anthropic Messages through its `api` switch), Codex over the Responses API, Claude Code over
Anthropic Messages. The agent tests are marked `agents` (they install the agent from npm
when it is missing, and skip with the reason when the registry cannot be reached).

Random weights produce garbage, so each test asserts what holds whatever the model says:
at least one call recorded with faithful ids and the expected protocol, a well-formed
harness result, and no process or directory left behind."""

from __future__ import annotations

import socket
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harnessrl.errors import ConfigError, HarnessInstallError
from harnessrl.harness.base import HarnessResult
from harnessrl.harness.claude_code import ClaudeCodeConfig, ClaudeCodeHarness
from harnessrl.harness.codex import CodexConfig, CodexHarness
from harnessrl.harness.install import agent_spec, install_agent, installed_agent_dirs, read_install_record
from harnessrl.harness.pi import PiConfig, PiHarness
from harnessrl.harness.select import make_harness
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Trace, check_turn_faithful

MODEL_NAME = "tiny"
ENDPOINT = Endpoint(base_url="http://127.0.0.1:9/v1", api_key="hrl-k", model="m",
                    keyed_base_url="http://127.0.0.1:9/r/hrl-k/v1")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[object]:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    # agents send 10-20k-token prompts (system prompt + tools); RoPE extends past the config length
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=0, max_context_tokens=32768)
    yield eng
    eng.close()


@pytest.fixture
async def proxy(engine: object) -> AsyncIterator[object]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    config = ProxyConfig(port=0, model_name=MODEL_NAME, sampling=SamplingConfig(max_tokens=16))
    async with ProxyServer(engine, ChatLayer(engine.tokenizer), config) as server:  # type: ignore[attr-defined]
        yield server


def _require_agent(name: str) -> None:
    """Install `name` when missing; skip only when it is missing and npm's registry unreachable."""
    if read_install_record(name) is not None:
        return
    host = "registry.npmjs.org"
    try:
        socket.create_connection((host, 443), timeout=3.0).close()
    except OSError:
        pytest.skip(f"{name} is not installed and {host} cannot be reached (run: harnessrl harness install {name})")
    try:
        install_agent(name, log=lambda line: print(line, file=sys.stderr))
    except HarnessInstallError as exc:
        pytest.fail(f"installing {agent_spec(name).package} failed: {exc}")


async def _rollout(proxy: object, root: Path, harness: object, name: str) -> tuple[HarnessResult, Trace, Path]:
    backend = LocalSandboxBackend(SandboxConfig(root_dir=root), ro_binds=installed_agent_dirs(),
                                  proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)  # type: ignore[attr-defined]
    sandbox = await backend.create(name, {"hello.py": "print('hi')\n"})
    session_id, key = proxy.open_session(name)  # type: ignore[attr-defined]
    try:
        result = await harness.run(Task(f"t/{name}", "test", "Make hello.py print 42."),  # type: ignore[attr-defined]
                                   sandbox, sandbox.agent_endpoint(proxy.endpoint(key)), 240.0)  # type: ignore[attr-defined]
        trace = proxy.close_session(session_id)  # type: ignore[attr-defined]
        home = sandbox.home
    finally:
        await sandbox.close()
    return result, trace, home


def _assert_recorded(result: HarnessResult, trace: Trace, protocol: str) -> None:
    assert not result.timed_out, result.log_tail
    assert result.exit_code is not None and (result.error is None) == (result.exit_code == 0), result
    ok = [t for t in trace.turns if t.status == "ok"]
    assert ok, f"no successful turn recorded: {[t.error for t in trace.turns]}\n{result.log_tail}"
    for turn in ok:
        assert turn.protocol == protocol
        assert check_turn_faithful(turn) is None, check_turn_faithful(turn)
        assert turn.completion_ids and turn.sampling is not None and turn.sampling.max_tokens <= 16
        # one neutral record whatever the protocol; the protocol's own bodies beside it
        assert turn.reply is not None and isinstance(turn.request.get("messages"), list)
        assert (turn.raw_request is None) == (turn.raw_response is None) == (protocol == "chat.completions")


@pytest.mark.agents
@pytest.mark.parametrize(("api", "protocol"), [("openai-completions", "chat.completions"),
                                               ("openai-responses", "responses"),
                                               ("anthropic-messages", "messages")])
async def test_pi_rollout_is_recorded(proxy: object, sandbox_root: Path, api: str, protocol: str) -> None:
    _require_agent("pi")
    result, trace, _ = await _rollout(proxy, sandbox_root, PiHarness(PiConfig(api=api, output_tokens=16)), "pi")
    _assert_recorded(result, trace, protocol)
    first = trace.turns[0].request if protocol == "chat.completions" else trace.turns[0].raw_request
    assert first.get("stream") is True
    if protocol != "chat.completions":  # the neutral record holds the chat layer's messages
        assert "Make hello.py print 42." in str(trace.turns[0].request["messages"])
    if api == "openai-completions":
        user = next(m for m in first["messages"] if m["role"] == "user")
        assert user["content"][0]["type"] == "text"  # pi sends user content as a list of parts
        assert "Make hello.py print 42." in user["content"][0]["text"]


@pytest.mark.agents
async def test_codex_rollout_is_recorded(proxy: object, sandbox_root: Path) -> None:
    _require_agent("codex")
    result, trace, _ = await _rollout(proxy, sandbox_root, CodexHarness(), "codex")
    _assert_recorded(result, trace, "responses")
    assert all(t.raw_request.get("stream") is True for t in trace.turns)
    assert {t.request_kind for t in trace.turns} <= {"turn", "compaction"}
    assert trace.turns[0].request_kind == "turn" and trace.turns[0].headers["originator"] == "codex_exec"


@pytest.mark.agents
async def test_claude_code_rollout_is_recorded(proxy: object, sandbox_root: Path) -> None:
    _require_agent("claude-code")
    harness = ClaudeCodeHarness(ClaudeCodeConfig(max_turns=2, output_tokens=16))
    result, trace, _ = await _rollout(proxy, sandbox_root, harness, "claude-code")
    _assert_recorded(result, trace, "messages")
    assert any("Make hello.py print 42." in str(t.request["messages"]) for t in trace.turns)


def test_configs_point_agents_at_the_proxy_with_the_key() -> None:
    pi = PiHarness(PiConfig(api="anthropic-messages")).models_config(ENDPOINT)["providers"]["harnessrl"]
    assert (pi["baseUrl"], pi["apiKey"], pi["models"][0]["id"]) == ("http://127.0.0.1:9", "hrl-k", "m")
    codex = tomllib.loads(CodexHarness(CodexConfig()).config_toml(ENDPOINT))
    assert codex["model_providers"]["harnessrl"] == {"name": "harnessrl proxy", "wire_api": "responses",
                                                     "base_url": "http://127.0.0.1:9/r/hrl-k/v1"}
    assert (codex["model"], codex["approval_policy"], codex["analytics"]) == ("m", "never", {"enabled": False})
    env = ClaudeCodeHarness().settings(ENDPOINT)["env"]
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"], env["ANTHROPIC_SMALL_FAST_MODEL"]) == (
        "http://127.0.0.1:9", "hrl-k", "m")


def test_make_harness_builds_the_protocol_agents() -> None:
    assert make_harness("pi", {"api": "openai-responses"}).config.api == "openai-responses"  # type: ignore[attr-defined]
    assert make_harness("codex", {}).name == "codex"
    assert make_harness("claude-code", {"max_turns": 3}).config.max_turns == 3  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="harness.options.api"):
        make_harness("pi", {"api": "grpc"})
