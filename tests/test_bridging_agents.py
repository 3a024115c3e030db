"""Bridged rendering with real agent programs (mini-swe-agent, opencode, pi) in real sandboxes,
against the real proxy server, with a scripted engine: the first reply runs a command, the
agent replays that reply with the command's output in its own way, the second reply finishes.

The first reply is sampled the way models do and re-rendering does not
reproduce (a non-canonical tokenisation; compact tool-call JSON). Every agent turn after the
first starts with the previous turn's exact prompt + completion ids
(`bridged_from`), the samples builder merges them all CLEAN, and no sampled token is left
untrained (the figures of docs/benchmarks.md on real agents' replay formats)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fakes import FakeEngine
from harnessrl.harness.install import installed_agent_dirs, read_install_record
from harnessrl.harness.mini_swe_agent import MiniSweAgentConfig, MiniSweAgentHarness
from harnessrl.harness.opencode import OpencodeConfig, OpencodeHarness
from harnessrl.harness.pi import PiConfig, PiHarness
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.train.samples import build_rows
from harnessrl.types import Rollout

pytestmark = pytest.mark.agents

COMMAND = "echo $((6*7)) > answer.txt"
TOOL_CALL = 'I will compute it.\n<tool_call>\n{"name":"bash","arguments":{"command":"%s"}}\n</tool_call>' % COMMAND
"""Compact JSON, as models often write it (the hermes re-render writes `{"name": "bash", ...}`)."""
MINI_ACTION = "THOUGHT: I will compute it.\n\n```mswea_bash_command\n%s\n```" % COMMAND
MINI_SUBMIT = "THOUGHT: Done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


def scripted_engine(tokenizer, action: str, final: str) -> FakeEngine:
    """Replies `action` until a prompt holds it (the agent replayed it), then `final`; a title
    request (opencode's) gets a title. `action` is sampled with "compute" split in two ids,
    a tokenisation the tokenizer itself would not produce (as sampling does), so re-rendering
    the replayed reply cannot give back the sampled ids."""
    engine = FakeEngine()

    def reply(k: int) -> list[int]:
        prompt = tokenizer.decode(engine.calls[k][0])
        head = prompt[:600].lower()
        text = "Computing" if "title" in head else final if COMMAND in prompt else action
        cut = text.find("compute") + 3 if text is action else 0
        return tokenizer.encode(text[:cut], add_special_tokens=False) + \
            tokenizer.encode(text[cut:], add_special_tokens=False) + [2]

    engine.completion_ids = reply
    return engine


@pytest.fixture
async def served(tokenizer) -> AsyncIterator[object]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    class Served:
        async def run(self, agent: str, harness: object, action: str, final: str, root: Path):
            if read_install_record(agent) is None:
                pytest.skip(f"{agent} is not installed (harnessrl harness install {agent})")
            engine = scripted_engine(tokenizer, action, final)
            config = ProxyConfig(port=0, model_name="tiny", sampling=SamplingConfig(max_tokens=256))
            async with ProxyServer(engine, ChatLayer(tokenizer), config) as server:
                backend = LocalSandboxBackend(SandboxConfig(root_dir=root), ro_binds=installed_agent_dirs(),
                                              proxy_port=server.port, proxy_socket=server.agent_socket_path)
                sandbox = await backend.create(agent, {})
                session_id, key = server.open_session(agent)
                try:
                    result = await harness.run(Task("t/42", "test", "Write 6*7 to answer.txt."),  # type: ignore[attr-defined]
                                               sandbox, sandbox.agent_endpoint(server.endpoint(key)), 120.0)
                    answer = (sandbox.workdir / "answer.txt").read_text() if (sandbox.workdir / "answer.txt").exists() else ""
                    trace = server.close_session(session_id)
                finally:
                    await sandbox.close()
            return result, trace, answer

    yield Served()


def check_bridged(trace) -> None:
    main = [t for t in trace.turns if t.status == "ok" and "title" not in str(t.request["messages"][0]).lower()[:600]]
    assert len(main) >= 2, [(t.status, t.error) for t in trace.turns]
    for prev, turn in zip(main, main[1:]):
        head = prev.prompt_ids + prev.completion_ids
        assert turn.prompt_ids[:len(head)] == head, turn.notes
        assert f"bridged_from={prev.turn_index}" in turn.notes
    rows, stats = build_rows(Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok",
                                     reward=1.0, trace=trace))
    print(f"turns={len(trace.turns)} main={len(main)} fractions={stats.fractions()} "
          f"main_sampled={stats.main_sampled_tokens} untrained={stats.untrained_sampled_tokens}")
    assert stats.fractions()["clean"] == 1.0 and stats.num_clean == len(main) - 1
    assert stats.untrained_sampled_tokens == 0
    assert sum(len(t.completion_ids) for t in main) == stats.main_sampled_tokens <= stats.tokens_trained


async def test_mini_swe_agent_turns_are_bridged(served, sandbox_root: Path) -> None:
    harness = MiniSweAgentHarness(MiniSweAgentConfig(step_limit=4, model_retry_attempts=1))
    result, trace, answer = await served.run("mini-swe-agent", harness, MINI_ACTION, MINI_SUBMIT, sandbox_root)
    assert answer.strip() == "42", result.log_tail
    check_bridged(trace)


async def test_opencode_turns_are_bridged(served, sandbox_root: Path) -> None:
    harness = OpencodeHarness(OpencodeConfig(output_tokens=256))
    result, trace, answer = await served.run("opencode", harness, TOOL_CALL, "Done.", sandbox_root)
    assert answer.strip() == "42", result.log_tail
    check_bridged(trace)


async def test_pi_turns_are_bridged(served, sandbox_root: Path) -> None:
    harness = PiHarness(PiConfig(output_tokens=256))
    result, trace, answer = await served.run("pi", harness, TOOL_CALL, "Done.", sandbox_root)
    assert answer.strip() == "42", result.log_tail
    check_bridged(trace)
