"""OpenEnv environments end to end on tiny-random: real engine, proxy, sandbox and `openenv`.

  * a `StepEnvSessionAdapter` environment trains one white-box step (parameters change, rows
    hold trained tokens, the environment's reward is recorded as the verifier's);
  * a loop-owning session's own agent process, pointed at the proxy with the rollout's key,
    runs a rollout: the proxy recorded its call with token ids, `verify` scored it;
  * a raising `verify` is a `verifier_error` rollout;
  * a cancelled rollout closes its session (the agent process is dead) and the sandbox;
  * a loop-owning factory written here (`SandboxAgentFactory`) starts a real CLI agent
    (mini-swe-agent, argv/env/config from its harness's `AgentSpec`) inside the rollout's
    bubblewrapped harnessrl sandbox through `create(..., sandbox=...)`: harnessrl records its
    calls, `verify` reads its trajectory from the sandbox, and the sandbox's teardown leaves
    neither the process nor the directory, also when the rollout is cancelled.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("openenv.core.harness")

import openenv_envs as envs  # noqa: E402

from harnessrl.config import load_config  # noqa: E402
from harnessrl.rollout.runner import RolloutLimits, run_rollout  # noqa: E402
from harnessrl.runtime import start_runtime  # noqa: E402
from harnessrl.sandbox.local import leftover_sandboxes  # noqa: E402
from harnessrl.train.run import run as train  # noqa: E402

pytestmark = pytest.mark.e2e
GUESS = "openenv_envs:GuessFactory"
AGENT = "openenv_envs:AgentFactory"
SANDBOXED = "test_openenv_e2e:SandboxAgentFactory"


def _cfg(tmp_path: Path, factory: str, *extra: str):
    return load_config(None, [
        "engine.model=tiny-random", 'tasks.kind="openenv"', f'tasks.factory="{factory}"',
        'harness.kind="white_box"', "harness.options={max_turns = 2}", "sampling.max_tokens=16",
        "rollout.group_size=2", "rollout.agent_timeout_s=120", f'sandbox.root_dir="{tmp_path / "sbx"}"', *extra])


def test_step_environment_trains_one_white_box_step(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, GUESS, "train.steps=1", "train.learning_rate=1e-3",
               'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    n_created = len(envs.CREATED)
    asyncio.run(train(cfg, run_dir))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    assert metrics[0]["tokens_trained"] > 0 and metrics[0]["param_delta_l2"] > 0.0
    assert metrics[0]["invariant/untraceable_trained_tokens"] == 0
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2
    for r in rollouts:
        assert r["status"] == "ok" and r["harness"] == "white_box" and r["task_id"] == "openenv/0"
        # the environment's own reward is the verifier's; shaping stays in train_reward
        assert r["reward"] == r["reward_parts"]["env_reward"] and r["reward"] in (0.0, 1.0)
        assert "step_count" in r["reward_parts"] and "train_reward" in r
        turns = r["trace"]["turns"]
        assert turns and turns[0]["completion_ids"]
        assert "Guess the secret" in json.dumps(turns[0]["request"]["messages"])
        assert [t["function"]["name"] for t in turns[0]["request"]["tools"]] == ["guess"]
    made = envs.CREATED[n_created:]
    # group seeds: both rollouts of group 0 got seed 0 (the run may have started later groups
    # before it stopped: those sessions are closed too)
    assert [m["seed"] for m in made].count(0) == 2 and len(made) % 2 == 0
    assert {m["episode_id"] for m in made} <= set(envs.CLOSED)
    assert leftover_sandboxes(tmp_path / "sbx") == []


async def _one_rollout(cfg, **kw):  # noqa: ANN001, ANN003
    async with start_runtime(cfg) as rt:
        task = rt.tasks.get(0)
        return await run_rollout(task, 0, rt.harness, rt.backend, rt.proxy, rt.verifier_for(task),
                                 RolloutLimits(agent_timeout_s=60, verify_timeout_s=30), **kw)


def test_loop_owning_session_agent_goes_through_the_proxy(tmp_path: Path) -> None:
    n_created = len(envs.CREATED)
    r = asyncio.run(_one_rollout(_cfg(tmp_path, AGENT)))
    made = envs.CREATED[n_created]
    assert made["base_url"].startswith("http://127.0.0.1:") and made["base_url"].endswith("/v1")
    assert r.status == "ok", r.error
    assert r.reward == 1.0 and r.reward_parts["exit_code"] == 0.0
    # harnessrl recorded the agent's call itself, token-faithful
    assert len(r.trace.turns) == 1
    turn = r.trace.turns[0]
    assert turn.completion_ids and len(turn.completion_logprobs) == len(turn.completion_ids)
    assert made["episode_id"] in envs.CLOSED
    assert leftover_sandboxes(tmp_path / "sbx") == []


def test_raising_verify_is_a_verifier_error_rollout(tmp_path: Path) -> None:
    r = asyncio.run(_one_rollout(_cfg(tmp_path, GUESS, "tasks.kwargs={fail_verify = true}")))
    assert r.status == "verifier_error" and r.reward is None
    assert "RuntimeError: the grader is down" in (r.error or "")
    assert envs.CREATED[-1]["episode_id"] in envs.CLOSED


def test_cancelled_rollout_closes_the_session_and_its_agent(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, AGENT, "tasks.kwargs={hang = true}")
    n_created = len(envs.CREATED)

    async def main() -> None:
        work = asyncio.ensure_future(_one_rollout(cfg))
        while len(envs.CREATED) == n_created:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        work.cancel()
        with pytest.raises(asyncio.CancelledError):
            await work

    asyncio.run(main())
    episode = envs.CREATED[n_created]["episode_id"]
    assert episode in envs.CLOSED
    assert leftover_sandboxes(tmp_path / "sbx") == []


def test_session_with_only_its_own_trace_trains_only_valid_turns(tmp_path: Path) -> None:
    from harnessrl.train.samples import build_rows

    r = asyncio.run(_one_rollout(_cfg(tmp_path, "openenv_envs:TraceOnlyFactory")))
    assert r.status == "ok", r.error
    statuses = [t.status for t in r.trace.turns]
    assert statuses == ["ok"] + ["unfaithful"] * len(envs.BAD_ENTRIES) + ["ok"]
    rows, stats = build_rows(r)
    assert stats.excluded["unfaithful"] == len(envs.BAD_ENTRIES)
    trained = [tok for row in rows for tok, m in zip(row.input_ids, row.completion_mask) if m]
    assert trained == [7, 8, 7, 9]  # the good entry and the token-string one continuing it, nothing else
    assert len(rows) == 1 and list(rows[0].input_ids) == [1, 2, 3, 7, 8, 4, 7, 9]


def test_example_step_environment_runs_through_harnessrl_rollout(tmp_path: Path) -> None:
    """examples/openenv/guess.toml as documented, on the tiny model."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.cli", "rollout", "--config", "examples/openenv/guess.toml",
         "--set", "engine.model=tiny-random", "--set", "sampling.max_tokens=8", "--set", "rollout.group_size=2",
         "--set", f'sandbox.root_dir="{tmp_path / "sbx"}"', "--limit", "1", "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 and all(r["status"] == "ok" for r in rollouts)
    assert all(r["reward"] == r["reward_parts"]["env_reward"] for r in rollouts)
    assert all("Guess a number from 1 to 5" in json.dumps(r["trace"]["turns"][0]["request"]) for r in rollouts)


def test_ctrl_c_kills_a_loop_owning_sessions_agent(tmp_path: Path) -> None:
    """`harnessrl rollout` on sessions whose agents hang: SIGINT to the process group exits 130
    and leaves no agent process (closed through session.close) and no sandbox directory."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    import psutil

    root = Path(__file__).resolve().parents[1]
    marker = f"openenv-hang-{uuid.uuid4().hex[:8]}"
    envs_path = Path(__file__).with_name("openenv_envs.py")
    args = [sys.executable, "-m", "harnessrl.cli", "rollout", "--out", str(tmp_path / "run"), "--limit", "1"]
    for s in ["engine.model=\"tiny-random\"", 'tasks.kind="openenv"', f'tasks.factory="{envs_path}:AgentFactory"',
              f'tasks.kwargs={{hang = true, marker = "{marker}"}}', 'harness.kind="white_box"',
              "rollout.group_size=2", "rollout.agent_timeout_s=300", f'sandbox.root_dir="{tmp_path / "sbx"}"']:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def agents() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(marker in part for part in (p.info["cmdline"] or [])):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    try:
        deadline = time.monotonic() + 180
        while len(agents()) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
            assert time.monotonic() < deadline, "the sessions' agents never started"
            time.sleep(0.2)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 130, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
    assert took < 15.0
    assert agents() == []
    assert leftover_sandboxes(tmp_path / "sbx") == []


def test_trainable_session_training_trace_is_imported(tmp_path: Path) -> None:
    r = asyncio.run(_one_rollout(_cfg(tmp_path, "openenv_envs:TrainableOnlyFactory")))
    assert r.status == "ok", r.error
    (turn,) = r.trace.turns
    assert turn.status == "ok" and turn.protocol == "openenv"
    assert (turn.prompt_ids, turn.completion_ids, turn.completion_logprobs) == ([1, 2, 3], [7, 8], [-0.5, -0.25])


# --- a loop-owning factory whose agent runs in the rollout's harnessrl sandbox -------------

from openenv.core.env_server.mcp_types import Tool  # noqa: E402
from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult  # noqa: E402

from harnessrl.harness.cli_agent import AgentPaths, base_env  # noqa: E402
from harnessrl.harness.mini_swe_agent import MiniSweAgentConfig, MiniSweAgentHarness, trajectory_info  # noqa: E402
from harnessrl.sandbox.blocking import BlockingProcess, BlockingSandbox  # noqa: E402
from harnessrl.sandbox.bwrap import bwrap_path  # noqa: E402
from harnessrl.tasks.base import Task  # noqa: E402
from harnessrl.types import Endpoint  # noqa: E402

SPAWNED: list[dict[str, object]] = []
"""Every `SandboxAgentFactory.create`: episode id, endpoint, agent pid, sandbox paths."""
HANG = ("import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "open('netns.txt', 'w').write(os.readlink('/proc/self/ns/net')); time.sleep(600)  # {marker}")


class SandboxAgentSession(ResourceSession):
    """A loop-owning session whose agent is a process of the rollout's sandbox."""

    def __init__(self, episode_id: str, sandbox: BlockingSandbox, proc: BlockingProcess,
                 traj_rel: str | None) -> None:
        self.episode_id, self.sandbox, self.proc, self.traj_rel = episode_id, sandbox, proc, traj_rel

    def initial_messages(self) -> list[dict[str, object]]:
        return [{"role": "user", "content": "Print the sum 2+3."}]

    def list_tools(self) -> list[Tool]:
        return []

    def call_tool(self, name: str, arguments: dict[str, object]) -> ToolResult:
        raise KeyError(f"Unknown tool: {name}")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        code = self.proc.wait(timeout_s)
        if code is None:
            raise TimeoutError(f"agent still running after {timeout_s} s")
        return code

    def verify(self, transcript: list[dict[str, object]], final_state: object = None) -> VerifyResult:
        # the agent's own record, read back through the seam (the agent is dead by now)
        raw = self.sandbox.read_file(self.traj_rel, base="home")
        status = trajectory_info(raw.decode()).get("exit_status")
        code = dict(final_state or {}).get("exit_code")
        return VerifyResult(env_reward=1.0 if code == 0 and status else 0.0, done=True,
                            metrics={"exit_code": float(code if code is not None else -1),
                                     "alive_at_verify": float(self.proc.returncode is None)})

    def close(self) -> None:
        # nothing to kill: the agent is the sandbox's process, ended by its teardown
        with envs._LOCK:
            envs.CLOSED.append(self.episode_id)


class SandboxAgentFactory(ResourceSessionFactory):
    """`create` spawns the agent inside the harnessrl sandbox it is handed, pointed at the
    proxy endpoint it is handed: mini-swe-agent (`agent="mini"`), or a hanging python3
    (`agent="hang"`) that records its network namespace first."""

    def __init__(self, agent: str = "mini", marker: str = "") -> None:
        self.agent, self.marker = agent, marker

    def create(self, task: object, seed: int | None = None, episode_id: str | None = None, *,
               base_url: str, api_key: str, model: str, sandbox: BlockingSandbox) -> SandboxAgentSession:
        endpoint = Endpoint(base_url=base_url, api_key=api_key, model=model)
        if self.agent == "mini":
            harness = MiniSweAgentHarness(MiniSweAgentConfig(step_limit=1, model_retry_attempts=1))
            paths = AgentPaths(sandbox, harness.name)
            spec = harness.spec(Task("openenv/mini", "openenv", "Print the sum 2+3."), endpoint, paths)
            for f in spec.files:
                sandbox.write_file(f.rel_path, f.content, base=f.base, mode=f.mode)
            proc = sandbox.spawn(spec.argv, env=base_env(paths, spec.env), log_file=paths.log_rel)
            traj_rel = spec.output[1] if spec.output else None
        else:
            paths = AgentPaths(sandbox, "hang")
            proc = sandbox.spawn(["python3", "-c", HANG.format(marker=self.marker)],
                                 env=base_env(paths), log_file=paths.log_rel)
            traj_rel = None
        with envs._LOCK:
            SPAWNED.append({"episode_id": episode_id, "base_url": base_url, "pid": proc.pid,
                            "root": sandbox.workdir.parent, "work": sandbox.workdir})
        return SandboxAgentSession(str(episode_id), sandbox, proc, traj_rel)


def _sandboxed_cfg(tmp_path: Path, *kwargs: str):
    return _cfg(tmp_path, SANDBOXED, "sandbox.use_bwrap=true", f"tasks.kwargs={{{', '.join(kwargs)}}}")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.agents
@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
def test_loop_owning_factory_runs_a_cli_agent_in_the_bubblewrapped_sandbox(tmp_path: Path) -> None:
    from harnessrl.harness.install import agent_executable

    try:
        agent_executable("mini-swe-agent")
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"mini-swe-agent is not installed (make agents): {exc}")
    n = len(SPAWNED)
    r = asyncio.run(_one_rollout(_sandboxed_cfg(tmp_path, 'agent = "mini"')))
    made = SPAWNED[n]
    # the endpoint the factory got is the sandbox's route to the proxy
    assert str(made["base_url"]).startswith("http://127.0.0.1:") and str(made["base_url"]).endswith("/v1")
    assert r.status == "ok", (r.error, r.reward_parts)
    # harnessrl recorded the agent's call itself, token-faithful (step_limit=1: one call)
    assert len(r.trace.turns) == 1
    turn = r.trace.turns[0]
    assert turn.status == "ok" and turn.completion_ids
    assert len(turn.completion_logprobs) == len(turn.completion_ids)
    assert "Print the sum 2+3." in json.dumps(turn.request["messages"])
    # verify ran on the dead agent and read its trajectory from the sandbox
    assert r.reward == 1.0 and r.reward_parts["exit_code"] == 0.0 and r.reward_parts["alive_at_verify"] == 0.0
    assert made["episode_id"] in envs.CLOSED
    assert not _alive(int(made["pid"]))
    assert not Path(str(made["root"])).exists()
    assert leftover_sandboxes(tmp_path / "sbx") == []


@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
def test_cancelled_rollout_kills_the_sandboxed_agent(tmp_path: Path) -> None:
    import os
    import uuid

    import psutil

    marker = f"openenv-sbx-{uuid.uuid4().hex[:8]}"
    cfg = _sandboxed_cfg(tmp_path, 'agent = "hang"', f'marker = "{marker}"')
    n = len(SPAWNED)
    netns: list[str] = []

    async def main() -> None:
        work = asyncio.ensure_future(_one_rollout(cfg))
        while len(SPAWNED) == n or not (Path(str(SPAWNED[n]["work"])) / "netns.txt").exists():
            assert not work.done(), work.result()
            await asyncio.sleep(0.05)
        netns.append((Path(str(SPAWNED[n]["work"])) / "netns.txt").read_text())
        assert _alive(int(SPAWNED[n]["pid"]))
        work.cancel()
        with pytest.raises(asyncio.CancelledError):
            await work

    asyncio.run(main())
    made = SPAWNED[n]
    # the agent ran in the sandbox's own network namespace (bubblewrap), not the host's
    assert netns[0].startswith("net:[") and netns[0] != os.readlink("/proc/self/ns/net")
    assert not _alive(int(made["pid"]))
    survivors = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                survivors.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert survivors == []
    assert made["episode_id"] in envs.CLOSED
    assert not Path(str(made["root"])).exists()
    assert leftover_sandboxes(tmp_path / "sbx") == []


async def test_blocking_sandbox_spawns_from_a_worker_thread_and_refuses_the_loop_thread(tmp_path: Path) -> None:
    from harnessrl.errors import SandboxError
    from harnessrl.sandbox.blocking import BlockingSandbox
    from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig

    sandbox = await LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=False)).create("b", {})
    try:
        view = BlockingSandbox(sandbox, asyncio.get_running_loop())

        def agent() -> tuple[int | None, int | None]:
            view.write_file("run.py", "open('out.txt', 'w').write('42')\n")
            proc = view.spawn(["python3", "run.py"])
            return proc.wait(30), proc.returncode

        assert await asyncio.to_thread(agent) == (0, 0)
        assert view.read_file("out.txt") == b"42"
        with pytest.raises(SandboxError, match="event loop's own thread"):
            view.spawn(["true"])
    finally:
        await sandbox.close()
    assert leftover_sandboxes(tmp_path / "sbx") == []
