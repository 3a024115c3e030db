"""The shared CLI-agent runner (`harness/cli_agent.py`) and the five CLI harnesses on the fake
sandbox of `tests/fakes.py`, whose agent paths (`/sandbox/<base>/...`) are no host paths.

Properties: each harness speaks only the seam (its files written through `write_file` with
mode 0600, every path it hands the agent from `agent_path`, the key in no argv or env entry);
the runner maps exit, timeout, reported failure and a failed kill to one `HarnessResult` each;
the rollout status table holds with the real command harness on the fake sandbox.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fakes import FakeBackend, FakeSandbox, ScriptedProcess, ScriptedVerifier

from harnessrl.errors import ConfigError, SandboxError
from harnessrl.harness.claude_code import ClaudeCodeHarness
from harnessrl.harness.cli_agent import CliAgentHarness
from harnessrl.harness.codex import CodexHarness
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.harness.mini_swe_agent import MiniSweAgentHarness
from harnessrl.harness.opencode import OpencodeConfig, OpencodeHarness
from harnessrl.harness.pi import PiHarness
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.base import Sandbox, SandboxProcess
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Trace

KEY = "sk-rollout-key-123"
ENDPOINT = Endpoint(base_url="http://127.0.0.1:7000/v1", api_key=KEY, model="policy",
                    keyed_base_url=f"http://127.0.0.1:7000/r/{KEY}/v1")
TASK = Task("t/0", "test", "Say hi")
EXE = "/opt/agents/bin/agent"


@pytest.fixture(autouse=True)
def _installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CliAgentHarness, "executable", lambda self: EXE)


def _writes_log(text: str, exit_code: int | None = 0, run_s: float = 0.0, **files: str):
    """A scripted agent that appends `text` to its log (and writes `files`: 'base:rel' -> text)."""
    def agent(sandbox: FakeSandbox, argv: list[str], env: dict[str, str]) -> ScriptedProcess:
        log_file = sandbox.spawned[-1][2]
        assert log_file is not None
        sandbox.write_file(log_file, text, base="home")
        for where, content in files.items():
            base, rel = where.split(":", 1)
            sandbox.write_file(rel, content, base=base)  # type: ignore[arg-type]
        return ScriptedProcess(exit_code=exit_code, run_s=run_s)
    return agent


def test_the_fake_satisfies_the_seam() -> None:
    assert isinstance(FakeSandbox(), Sandbox) and isinstance(ScriptedProcess(), SandboxProcess)


HARNESSES = [OpencodeHarness(), PiHarness(), CodexHarness(), ClaudeCodeHarness(), MiniSweAgentHarness(),
             CommandHarness(CommandHarnessConfig(argv=["python3", "{state_dir}/a.py", "{keyed_base_url}"],
                                                 files={"a.py": "print(1)", "{home}/.config/x.json": "{api_key}"}))]


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda h: h.name)
def test_each_harness_speaks_only_the_seam(harness: CliAgentHarness) -> None:
    sandbox = FakeSandbox(agent=_writes_log("done\n"))
    result = asyncio.run(harness.run(TASK, sandbox, ENDPOINT, 10.0))
    assert (result.exit_code, result.timed_out, result.error) == (0, False, None)
    [(argv, env, log_file)] = sandbox.spawned
    assert log_file == f".harnessrl/{harness.name}.log"
    assert env["HOME"] == "/sandbox/home" and env["XDG_CONFIG_HOME"] == "/sandbox/home/.config"
    # every path handed to the agent is an agent path; no host path of the fake appears
    for value in [*argv, *env.values()]:
        assert str(sandbox.root) not in value
        if value.startswith("/") and value not in (EXE, "/bin/sh") and ":" not in value:
            assert value.startswith("/sandbox/"), value
    # the key reaches the agent only through its files (command: where its templates put it)
    if not isinstance(harness, CommandHarness):
        assert KEY not in json.dumps([argv, env])
    written = [k for k in sandbox.files if k[1] != log_file]
    assert written and all(sandbox.modes[k] == 0o600 for k in written)
    assert any(KEY in sandbox.files[k].decode() for k in written), "no config file carries the key"
    assert all(k[0] == "home" for k in written if k[1].startswith(".harnessrl/")), written
    assert sandbox.processes[0].kills == 1, "the tree was not killed after the agent exited"


def test_opencode_answer_error_and_timeout_from_its_log() -> None:
    events = [{"type": "step_start"}, {"type": "text", "part": {"text": "first"}},
              {"type": "text", "part": {"text": "final answer"}}]
    ok = FakeSandbox(agent=_writes_log("noise\n" + "\n".join(json.dumps(e) for e in events) + "\n"))
    result = asyncio.run(OpencodeHarness().run(TASK, ok, ENDPOINT, 10.0))
    assert result.final_answer == "final answer" and result.error is None
    config = json.loads(ok.text("home", ".harnessrl/opencode/opencode.json"))
    assert config["provider"]["harnessrl"]["options"] == {"baseURL": ENDPOINT.base_url, "apiKey": KEY}
    assert ok.text("home", ".harnessrl/opencode/instruction.md") == "Say hi"
    assert ok.spawned[0][0][3] == "/sandbox/home/.harnessrl/opencode/instruction.md"

    failed = FakeSandbox(agent=_writes_log('{"type": "error", "error": {"name": "APIError"}}\n', exit_code=2))
    result = asyncio.run(OpencodeHarness().run(TASK, failed, ENDPOINT, 10.0))
    assert result.error == 'opencode exited with code 2: {"name": "APIError"}'

    hung = FakeSandbox(agent=_writes_log("started\n", exit_code=None))
    result = asyncio.run(OpencodeHarness().run(TASK, hung, ENDPOINT, 0.05))
    assert (result.exit_code, result.timed_out, result.error) == (None, True, None)
    assert result.log_tail == "started\n" and hung.processes[0].kills == 1


def test_opencode_tools_and_system_prompt_reach_its_config() -> None:
    config = OpencodeConfig(tools=["bash", "read"], system_prompt="Be brief.")
    ran = FakeSandbox(agent=_writes_log("{}\n"))
    asyncio.run(OpencodeHarness(config).run(TASK, ran, ENDPOINT, 10.0))
    written = json.loads(ran.text("home", ".harnessrl/opencode/opencode.json"))
    assert written["agent"] == {"harnessrl": {"mode": "primary", "prompt": "Be brief.",
                                              "description": "the run's own short system prompt"}}
    assert written["permission"] == {"bash": "allow", "read": "allow", "webfetch": "deny", "edit": "deny",
                                     "glob": "deny", "grep": "deny", "skill": "deny", "task": "deny",
                                     "todowrite": "deny", "write": "deny"}
    argv = ran.spawned[0][0]
    assert argv[argv.index("--agent") + 1] == "harnessrl"
    # the defaults write neither: opencode's own build agent and all of its tools
    plain = OpencodeHarness().provider_config(ENDPOINT)
    assert "agent" not in plain and plain["permission"] == {"bash": "allow", "edit": "allow", "webfetch": "deny"}
    with pytest.raises(ValueError, match=r"unknown opencode tool\(s\) \['shell'\]; its tools are \['bash'"):
        OpencodeConfig(tools=["bash", "shell"])


def test_claude_code_reported_failure_with_exit_zero_is_an_error() -> None:
    line = json.dumps({"type": "result", "is_error": True, "subtype": "error_max_turns"})
    sandbox = FakeSandbox(agent=_writes_log(line + "\n"))
    result = asyncio.run(ClaudeCodeHarness().run(TASK, sandbox, ENDPOINT, 10.0))
    assert result.exit_code == 0 and result.error == "claude exited with code 0: error_max_turns"


def test_mini_and_codex_read_their_answer_files_through_the_seam() -> None:
    traj = json.dumps({"info": {"submission": "5\n", "exit_status": "Submitted"}, "messages": []})
    mini = FakeSandbox(agent=_writes_log("", **{"home:.harnessrl/mini-swe-agent/traj.json": traj}))
    assert asyncio.run(MiniSweAgentHarness().run(TASK, mini, ENDPOINT, 10.0)).final_answer == "5\n"
    cfg = json.loads(mini.text("home", ".harnessrl/mini-swe-agent/harnessrl.yaml"))
    assert cfg["environment"]["cwd"] == "/sandbox/work"
    codex = FakeSandbox(agent=_writes_log("", **{"home:.harnessrl/codex/last_message.txt": "  42\n"}))
    assert asyncio.run(CodexHarness().run(TASK, codex, ENDPOINT, 10.0)).final_answer == "42"
    # a planted link where the answer is reads as no answer
    linked = FakeSandbox(agent=_writes_log(""))
    linked.links.add(("home", ".harnessrl/codex/last_message.txt"))
    assert asyncio.run(CodexHarness().run(TASK, linked, ENDPOINT, 10.0)).final_answer is None


def test_a_kill_that_fails_raises_from_the_harness() -> None:
    def agent(sandbox: FakeSandbox, argv: list[str], env: dict[str, str]) -> ScriptedProcess:
        return ScriptedProcess(exit_code=None, kill_survives=True)

    with pytest.raises(SandboxError, match="survived SIGKILL"):
        asyncio.run(PiHarness().run(TASK, FakeSandbox(agent=agent), ENDPOINT, 0.05))


class _Sessions:
    def __init__(self) -> None:
        self.open: set[str] = set()

    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        self.open.add(rollout_id)
        return rollout_id, KEY

    def endpoint(self, key: str) -> Endpoint:
        return ENDPOINT

    def close_session(self, session_id: str) -> Trace:
        self.open.discard(session_id)
        return Trace(session_id=session_id, rollout_id=session_id)


# (agent behaviour, verifier fails) -> (status, verified)
STATUS_TABLE = [
    (("exit0", False), ("ok", True)),
    (("exit1", False), ("agent_error", True)),
    (("hang", False), ("timeout", True)),
    (("hang", True), ("verifier_error", True)),
    (("kill_survives", False), ("infra_error", False)),
]


@pytest.mark.parametrize(("case", "expected"), STATUS_TABLE)
def test_status_table_with_the_command_harness(tmp_path: Path, case: tuple, expected: tuple) -> None:
    behaviour, verifier_fails = case

    def agent(sandbox: FakeSandbox, argv: list[str], env: dict[str, str]) -> ScriptedProcess:
        sandbox.write_file("answer.txt", "hi")
        return ScriptedProcess(exit_code={"exit0": 0, "exit1": 1}.get(behaviour),
                               kill_survives=behaviour == "kill_survives")

    harness = CommandHarness(CommandHarnessConfig(argv=["python3", "a.py"], files={"a.py": "pass"},
                                                  final_answer_file="answer.txt"))
    backend, sessions, verifier = FakeBackend(tmp_path, agent=agent), _Sessions(), ScriptedVerifier(verifier_fails, "hi")
    rollout = asyncio.run(run_rollout(TASK, 0, harness, backend, sessions, verifier,
                                      RolloutLimits(agent_timeout_s=0.1), rollout_id="r"))
    status, verified = expected
    assert rollout.status == status, rollout.error
    assert verifier.scored == int(verified)
    if status in ("ok", "agent_error", "timeout"):
        assert rollout.reward == 1.0 and rollout.final_answer == "hi"
    else:
        assert rollout.reward is None
        assert ("verifier bug" if status == "verifier_error" else "survived SIGKILL") in (rollout.error or "")
    sandbox = backend.made[0]
    assert sandbox.calls[-1] == "close" and "kill_processes" in sandbox.calls and sessions.open == set()
    assert sandbox.processes[0].kills == 1


def test_a_command_file_outside_the_sandbox_stops_the_run_after_release(tmp_path: Path) -> None:
    harness = CommandHarness(CommandHarnessConfig(argv=["true"], files={"../../../escape.txt": "x"}))
    backend, sessions, verifier = FakeBackend(tmp_path), _Sessions(), ScriptedVerifier(False, "hi")
    with pytest.raises(ConfigError, match="escape.txt"):
        asyncio.run(run_rollout(TASK, 0, harness, backend, sessions, verifier, RolloutLimits(agent_timeout_s=1)))
    assert backend.made[0].calls == ["close"] and sessions.open == set() and verifier.scored == 0


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda h: h.name)
def test_every_harness_is_given_the_sandbox_route_to_the_proxy(tmp_path: Path, harness: CliAgentHarness) -> None:
    """The runner hands the harness `sandbox.agent_endpoint(...)`: a sandbox that reaches the
    host as `host.sandbox.internal` gets that address in its agent's config, never 127.0.0.1."""
    backend = FakeBackend(tmp_path, agent=_writes_log("done\n"), proxy_host="host.sandbox.internal")
    rollout = asyncio.run(run_rollout(TASK, 0, harness, backend, _Sessions(), ScriptedVerifier(False, "hi"),
                                      RolloutLimits(agent_timeout_s=5), rollout_id="r"))
    assert rollout.status == "ok", rollout.error
    sandbox = backend.made[0]
    config = "".join(sandbox.files[k].decode() for k in sandbox.files if k[1].startswith(".harnessrl/"))
    config += json.dumps(sandbox.spawned[0][:2])
    assert "host.sandbox.internal:7000" in config and "127.0.0.1" not in config
