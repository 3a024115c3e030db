"""OpenEnv environments end to end on tiny-random: real engine, proxy, sandbox and `openenv`.

  * a `StepEnvSessionAdapter` environment trains one white-box step (parameters change, rows
    hold trained tokens, the environment's reward is recorded as the verifier's);
  * a loop-owning session's own agent process, pointed at the proxy with the rollout's key,
    runs a rollout: the proxy recorded its call with token ids, `verify` scored it;
  * a raising `verify` is a `verifier_error` rollout;
  * a cancelled rollout closes its session (the agent process is dead) and the sandbox.
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
from harnessrl.train.run import train  # noqa: E402

pytestmark = pytest.mark.e2e
GUESS = "openenv_envs:GuessFactory"
AGENT = "openenv_envs:AgentFactory"


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
