"""CLI agent harnesses against the real proxy (tiny random model) in real local sandboxes.

Properties, one per test: the generic command harness reaches the proxy with the templated
key and the call is recorded token-faithfully; the endpoint stays out of the agent's env;
a non-zero exit is reported, not raised; an agent that hangs (with a child that left its
session) is killed at its timeout with nothing left alive; mini-swe-agent and opencode each
complete a rollout that the proxy records (marked `agents`).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from harnessrl.errors import ConfigError, HarnessInstallError
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.harness.install import agent_spec, install_agent, installed_agent_dirs, read_install_record
from harnessrl.harness.mini_swe_agent import COMPACT_SYSTEM, MiniSweAgentConfig, MiniSweAgentHarness
from harnessrl.harness.opencode import OpencodeConfig, OpencodeHarness
from harnessrl.sandbox.local import LocalSandbox, LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Trace, check_turn_faithful

MODEL_NAME = "tiny"

AGENT_SCRIPT = """
import json, os, sys, urllib.request
base_url, api_key, model, instruction_file = sys.argv[1:5]
body = {"model": model, "max_tokens": 8,
        "messages": [{"role": "user", "content": open(instruction_file).read()}]}
req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + api_key,
                                      "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=60))
open("answer.txt", "w").write(reply["choices"][0]["message"]["content"] or "")
json.dump(dict(os.environ), open(os.path.join(os.environ["HOME"], "env.json"), "w"))
print("agent done")
"""


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[object]:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=0)
    yield eng
    eng.close()


@pytest.fixture
async def proxy(engine: object) -> AsyncIterator[object]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    config = ProxyConfig(port=0, model_name=MODEL_NAME, sampling=SamplingConfig(max_tokens=32))
    async with ProxyServer(engine, ChatLayer(engine.tokenizer), config) as server:  # type: ignore[attr-defined]
        yield server


def _backend(root: Path, proxy: object) -> LocalSandboxBackend:
    """Sandboxes whose agents reach `proxy` (through its agent socket under bubblewrap)."""
    return LocalSandboxBackend(SandboxConfig(root_dir=root), ro_binds=installed_agent_dirs(),
                               proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)  # type: ignore[attr-defined]


def _open(proxy: object, rollout_id: str, sandbox: LocalSandbox) -> tuple[str, Endpoint]:
    session_id, key = proxy.open_session(rollout_id)  # type: ignore[attr-defined]
    return session_id, sandbox.agent_endpoint(proxy.endpoint(key))  # type: ignore[attr-defined]


def _assert_faithful_turns(trace: Trace) -> None:
    ok = [t for t in trace.turns if t.status == "ok"]
    assert ok, f"no successful turn recorded: {[t.error for t in trace.turns]}"
    for turn in ok:
        assert check_turn_faithful(turn) is None, check_turn_faithful(turn)
        assert turn.completion_ids, "a turn with no sampled ids"
        assert turn.usage["completion_tokens"] == len(turn.completion_ids)


async def test_command_harness_calls_proxy_with_templated_key(proxy: object, sandbox_root: Path) -> None:
    sandbox = await _backend(sandbox_root, proxy).create("cmd", {"README.md": "hello\n"})
    session_id, endpoint = _open(proxy, "cmd", sandbox)
    harness = CommandHarness(
        CommandHarnessConfig(
            name="script-agent",
            argv=["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", "{model}", "{instruction_file}"],
            files={"agent.py": AGENT_SCRIPT, "{home}/.config/agent/config.json": '{"url": "{base_url}"}'},
            final_answer_file="answer.txt",
        )
    )
    try:
        result = await harness.run(Task("t/0", "test", "Say  hi\n  {api_key}"), sandbox, endpoint, 60.0)
        trace = proxy.close_session(session_id)  # type: ignore[attr-defined]
        assert (result.exit_code, result.timed_out, result.error) == (0, False, None), result.log_tail
        assert "agent done" in result.log_tail
        # one call, recorded with faithful ids; the answer file holds the reply the agent got
        assert len(trace.turns) == 1
        _assert_faithful_turns(trace)
        assert result.final_answer == trace.turns[0].reply.content
        # the instruction was passed verbatim: placeholders inside it are not expanded
        assert trace.turns[0].request["messages"][0]["content"] == "Say  hi\n  {api_key}"
        config = json.loads((sandbox.home / ".config/agent/config.json").read_text())
        assert config == {"url": endpoint.base_url}
        # the endpoint is not in the agent's environment; its log is in home, not the workdir
        env = json.loads((sandbox.home / "env.json").read_text())
        assert endpoint.api_key not in json.dumps(env)
        assert env["HOME"] == str(sandbox.home)
        assert (sandbox.home / ".harnessrl" / "script-agent.log").is_file()
        assert sorted(p.name for p in sandbox.workdir.iterdir()) == ["README.md", "answer.txt"]
    finally:
        await sandbox.close()


async def test_command_harness_reports_nonzero_exit(proxy: object, sandbox_root: Path) -> None:
    sandbox = await _backend(sandbox_root, proxy).create("fail", {})
    _, endpoint = _open(proxy, "fail", sandbox)
    harness = CommandHarness(CommandHarnessConfig(argv=["python3", "-c", "print('boom'); raise SystemExit(3)"]))
    try:
        result = await harness.run(Task("t/1", "test", "x"), sandbox, endpoint, 30.0)
    finally:
        await sandbox.close()
    assert result.exit_code == 3 and not result.timed_out
    assert result.error == "command exited with code 3: boom"
    assert result.final_answer is None


async def test_command_harness_timeout_kills_whole_tree(proxy: object, sandbox_root: Path) -> None:
    sandbox = await _backend(sandbox_root, proxy).create("hang", {})
    _, endpoint = _open(proxy, "hang", sandbox)
    # a child that leaves the agent's session, another one in it, and the agent sleeping forever
    script = (
        "import subprocess, time\n"
        "subprocess.Popen(['setsid', 'sleep', '1000'])\n"
        "subprocess.Popen(['sleep', '1000'])\n"
        "print('started', flush=True)\n"
        "time.sleep(1000)\n"
    )
    harness = CommandHarness(CommandHarnessConfig(argv=["python3", "-c", script]))
    assert isinstance(sandbox, LocalSandbox)
    try:
        t0 = time.monotonic()
        result = await harness.run(Task("t/2", "test", "x"), sandbox, endpoint, 1.5)
        elapsed_s = time.monotonic() - t0
        # killed by the harness itself, before the sandbox's own teardown runs
        alive = [p for p in sandbox.list_processes() if psutil.pid_exists(p)]
    finally:
        await sandbox.close()
    assert result.timed_out and result.exit_code is None and result.error is None
    assert "started" in result.log_tail
    assert 1.5 <= elapsed_s < 1.5 + 0.5 + 2.0, elapsed_s
    assert alive == []


async def test_command_harness_refuses_file_outside_sandbox(proxy: object, sandbox_root: Path) -> None:
    sandbox = await _backend(sandbox_root, proxy).create("esc", {})
    _, endpoint = _open(proxy, "esc", sandbox)
    harness = CommandHarness(CommandHarnessConfig(argv=["true"], files={"../../../../escape.txt": "x"}))
    try:
        with pytest.raises(ConfigError, match="escape.txt"):
            await harness.run(Task("t/3", "test", "x"), sandbox, endpoint, 10.0)
    finally:
        await sandbox.close()


def _registry_reachable(host: str) -> bool:
    try:
        socket.create_connection((host, 443), timeout=3.0).close()
    except OSError:
        return False
    return True


def _require_agent(name: str) -> None:
    """Install `name` when missing; skip only when it is missing and its registry unreachable."""
    if read_install_record(name) is not None:
        return
    host = "pypi.org" if agent_spec(name).manager == "pip" else "registry.npmjs.org"
    if not _registry_reachable(host):
        pytest.skip(f"{name} is not installed and {host} cannot be reached (run: harnessrl harness install {name})")
    try:
        install_agent(name, log=lambda line: print(line, file=sys.stderr))
    except HarnessInstallError as exc:
        pytest.fail(f"installing {name} failed: {exc}")


@pytest.mark.agents
@pytest.mark.parametrize(("client", "tool_calls"), [("direct", False), ("litellm", False), ("direct", True)])
async def test_mini_swe_agent_rollout_is_recorded(proxy: object, sandbox_root: Path, client: str,
                                                  tool_calls: bool) -> None:
    """mini through the proxy with either model client: the direct one (the default, mini's
    OpenRouter classes over `requests`) and mini's litellm classes, the same request; and the
    direct client's tool-call protocol (its `bash` tool sent; random weights call no tool, so
    mini answers with format errors until its limits)."""
    _require_agent("mini-swe-agent")
    sandbox = await _backend(sandbox_root, proxy).create("mini", {"hello.py": "print('hi')\n"})
    session_id, endpoint = _open(proxy, "mini", sandbox)
    harness = MiniSweAgentHarness(MiniSweAgentConfig(step_limit=2, model_retry_attempts=1,
                                                     model_client=client, tool_calls=tool_calls))
    try:
        result = await harness.run(Task("t/4", "test", "Print the sum 2+3."), sandbox, endpoint, 180.0)
        trace = proxy.close_session(session_id)  # type: ignore[attr-defined]
        traj = json.loads((sandbox.home / ".harnessrl/mini-swe-agent/traj.json").read_text())
    finally:
        await sandbox.close()
    assert not result.timed_out, result.log_tail
    # random weights: the agent stops at its step limit (or on repeated format errors)
    assert result.exit_code == 0 and result.error is None, result.log_tail
    assert traj["info"]["exit_status"] in ("LimitsExceeded", "RepeatedFormatError", "Submitted")
    assert 1 <= len(trace.turns) <= 2
    _assert_faithful_turns(trace)
    first = trace.turns[0].request
    assert first["model"] == MODEL_NAME
    if tool_calls:
        assert [t["function"]["name"] for t in first["tools"]] == ["bash"]
        assert "harnessrl_mini_client.ProxyToolCallModel" in json.dumps(traj)
    else:
        assert "tools" not in first  # text protocol
        assert ("harnessrl_mini_client.ProxyTextbasedModel" in json.dumps(traj)) == (client == "direct")
    # the default compact templates: the one-line system message, then the worked tasks and this one
    assert first["messages"][0]["content"] == COMPACT_SYSTEM
    assert first["messages"][1]["content"].rstrip().endswith("Task: Print the sum 2+3.")
    agent = {k.lower(): v for k, v in trace.turns[0].headers.items()}.get("user-agent", "")
    assert agent.startswith("python-requests/" if client == "direct" else "OpenAI/Python"), agent
    assert set(first) <= {"model", "messages", "stop", "max_tokens", "temperature", "tools"}, sorted(first)


@pytest.mark.agents
async def test_opencode_sends_only_the_chosen_tools_and_its_short_prompt(proxy: object, sandbox_root: Path) -> None:
    """`tools` and `system_prompt` cut opencode's first prompt (7,496 tokens by default with the
    SmolLM2 tokenizer: 9 tools, a 9.6k-character system prompt) to what the task needs."""
    _require_agent("opencode")
    sandbox = await _backend(sandbox_root, proxy).create("opencode", {"fig.txt": "42\n"})
    session_id, endpoint = _open(proxy, "opencode", sandbox)
    prompt = "You answer with tools. Use bash to run commands."
    harness = OpencodeHarness(OpencodeConfig(context_tokens=8192, output_tokens=8, tools=["bash", "read"],
                                             system_prompt=prompt))
    try:
        await harness.run(Task("t/6", "test", "What is the number in fig.txt?"), sandbox, endpoint, 90.0)
        trace = proxy.close_session(session_id)  # type: ignore[attr-defined]
    finally:
        await sandbox.close()
    main = [t for t in trace.turns if t.request.get("tools")]
    assert main, [t.request["messages"][0] for t in trace.turns]
    first = main[0]
    assert sorted(t["function"]["name"] for t in first.request["tools"]) == ["bash", "read"]
    system = first.request["messages"][0]
    assert system["role"] == "system" and system["content"].startswith(prompt + "\n")
    assert len(system["content"]) < 1000  # opencode's environment block follows the prompt
    assert 1000 < len(first.prompt_ids) < 2600, len(first.prompt_ids)  # 2,270 measured


@pytest.mark.agents
async def test_opencode_rollout_is_recorded(proxy: object, sandbox_root: Path) -> None:
    _require_agent("opencode")
    sandbox = await _backend(sandbox_root, proxy).create("opencode", {"hello.py": "print('hi')\n"})
    session_id, endpoint = _open(proxy, "opencode", sandbox)
    harness = OpencodeHarness(OpencodeConfig(context_tokens=8192, output_tokens=32))
    instruction = "Fix  hello.py:\n  print 42 instead."
    try:
        # random text may keep opencode going (it continues after truncated replies): the
        # timeout bounds it, and a timed-out rollout must be well-formed too
        result = await harness.run(Task("t/5", "test", instruction), sandbox, endpoint, 60.0)
        trace = proxy.close_session(session_id)  # type: ignore[attr-defined]
    finally:
        await sandbox.close()
    if result.timed_out:
        assert result.exit_code is None and result.error is None
    else:
        assert result.exit_code is not None and (result.error is None) == (result.exit_code == 0), result.log_tail
    assert '"type":"step_start"' in result.log_tail or '"type":"text"' in result.log_tail, result.log_tail
    _assert_faithful_turns(trace)
    assert all(t.request.get("stream") is True for t in trace.turns)
    # the instruction arrives verbatim (no added quotes, spaces and newlines kept)
    users = [m["content"] for t in trace.turns for m in t.request["messages"] if m["role"] == "user"]
    assert instruction in users
    # the title call came to the proxy too (small_model = the policy model)
    assert any("title" in str(t.request["messages"][0].get("content", "")).lower() for t in trace.turns)
