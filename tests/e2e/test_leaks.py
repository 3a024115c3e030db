"""Leak test: 50 rollouts with injected faults leave zero processes and zero sandbox directories.

Faults, by group (each group's task decides its agent's behaviour):
  * the agent kills itself with SIGKILL while its model call is in flight (killed mid-turn);
  * the agent hangs past its timeout (with a `setsid` child that left its process group);
  * the verifier crashes;
  * the agent forks a background daemon (`nohup ... &`) and exits;
  * a well-behaved agent, for contrast.
Checked by listing processes carrying a sandbox marker and directories under the sandbox root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.base import Reward
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.runner import RolloutLimits
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig, leftover_processes, leftover_sandboxes
from harnessrl.tasks.base import Task

FAULTS = ("killed_mid_turn", "hangs", "verifier_crash", "daemon", "clean")

AGENT = """
import json, os, signal, subprocess, sys, threading, time, urllib.request
base_url, key, mode = sys.argv[1], sys.argv[2], open(sys.argv[3]).read().strip()
def call():
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": mode}]}).encode()
    req = urllib.request.Request(base_url + "/chat/completions", data=body,
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60).read()
if mode == "killed_mid_turn":
    threading.Thread(target=call, daemon=True).start()
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
call()
if mode == "hangs":
    subprocess.Popen(["setsid", "sleep", "1000"])
    time.sleep(1000)
if mode == "daemon":
    subprocess.Popen("nohup sleep 1000 >/dev/null 2>&1 &", shell=True)
open("answer.txt", "w").write("1")
"""


class FaultyTasks:
    def __len__(self) -> int:
        return len(FAULTS)

    def get(self, seed: int) -> Task:
        mode = FAULTS[seed % len(FAULTS)]
        return Task(task_id=f"fault/{mode}/{seed}", family="fault", instruction=mode,
                    hidden_tests={"answer": "1"}, metadata={"mode": mode})


class FaultyVerifier:
    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        if task.metadata["mode"] == "verifier_crash":
            raise RuntimeError("verifier bug")
        text = sandbox.read_file("answer.txt").decode() if (sandbox.workdir / "answer.txt").exists() else ""  # type: ignore[attr-defined]
        return Reward(value=1.0 if text == "1" else 0.0)


@pytest.fixture
def sandbox_root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "sandboxes"


@pytest.mark.e2e
async def test_fifty_faulty_rollouts_leave_nothing(tiny_model_dir: Path, sandbox_root: Path) -> None:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    harness = CommandHarness(CommandHarnessConfig(
        argv=["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", "{instruction_file}"],
        files={"agent.py": AGENT}))
    engine = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=0)
    groups = []
    try:
        async with ProxyServer(engine, ChatLayer(load_tokenizer(tiny_model_dir)),
                               ProxyConfig(port=0, sampling=SamplingConfig(max_tokens=4))) as proxy:
            orch = Orchestrator(FaultyTasks(), harness, LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root, kill_grace_s=0.5), proxy_port=proxy.port,
                                                                    proxy_socket=proxy.agent_socket_path),
                                proxy, lambda task: FaultyVerifier(), group_size=5,
                                max_concurrent_rollouts=10, limits=RolloutLimits(agent_timeout_s=4.0))
            orch.allow(10)
            orch.start()
            try:
                groups = [await orch.get_group() for _ in range(10)]
            finally:
                await orch.close()
            assert proxy.store.live_sessions == 0
    finally:
        engine.close()
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 50
    by_mode = Counter((r.task_id.split("/")[1], r.status) for r in rollouts)
    odd = [(r.task_id, r.status, r.error) for r in rollouts if r.status not in ("ok", "timeout", "verifier_error", "agent_error")]
    assert not odd, odd
    assert by_mode[("hangs", "timeout")] == 10, [(r.task_id, r.status, r.error) for r in rollouts if "hangs" in r.task_id]
    assert by_mode[("verifier_crash", "verifier_error")] == 10
    assert by_mode[("killed_mid_turn", "agent_error")] == 10
    assert by_mode[("clean", "ok")] == 10 and by_mode[("daemon", "ok")] == 10
    assert all(r.reward is None for r in rollouts if r.status == "verifier_error")
    assert leftover_processes(sandbox_root) == []
    assert leftover_sandboxes(sandbox_root) == []
