"""Rollouts on a Ray cluster: a real 3-node cluster on this machine (`ray.cluster_utils.Cluster`,
at this machine's own address, one CPU and a 100 MB object store per node, no dashboard; the
proxy's agents listener stays on loopback, which every node of this machine reaches).

`harnessrl rollout` and `harnessrl train` run as real processes joined to it: a command agent
(a Python program in a bubblewrap sandbox on its node, reaching the proxy through the node's
relay) and the white-box loop (sampling in the driver, tools and verifier on the node). Asserted
from the run's `rollouts.jsonl` / `metrics.jsonl`: rollouts spread over the nodes (node id per
rollout), every agent's call reached the proxy, a node whose raylet is killed mid-run ends its
rollouts as `infra_error` while the run finishes on the others, and no node worker, sandbox
process (the dead node's included), sandbox directory (except at most the dead node's, when Ray
ended its worker before it removed it), raylet or GCS process is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'harnessrl[ray]') is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

from harnessrl.config import load_config  # noqa: E402
from harnessrl.recipes.smoke_agent import one_call_agent  # noqa: E402
from harnessrl.sandbox.local import leftover_sandboxes  # noqa: E402
from harnessrl.sandbox.procs import leftover_processes  # noqa: E402
from proc_checks import alive, cmdline  # noqa: E402

HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 << 20}
HEAD_ARGS = {**NODE_ARGS, "include_dashboard": False,
             # a dead node is noticed within ~2 s (the default is ~30 s)
             "_system_config": {"health_check_initial_delay_ms": 500, "health_check_period_ms": 500,
                                "health_check_failure_threshold": 4}}

# One chat call through the proxy, its reply written as the answer, then the sleep seconds.
AGENT = one_call_agent(max_tokens=4, timeout_s=60)


def _ray_processes(session_dir: str) -> list[int]:
    """Pids of raylet / GCS / worker processes of the cluster whose session is `session_dir`."""
    name = Path(session_dir).name
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if name in cmd and ("raylet" in cmd or "gcs_server" in cmd or "default_worker" in cmd):
            found.append(proc.pid)
    return found


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(initialize_head=True, head_node_args=dict(HEAD_ARGS))
    for _ in range(2):
        c.add_node(**NODE_ARGS)
    c.wait_for_nodes()
    session_dir = c.head_node.get_session_dir_path()
    try:
        yield c
    finally:
        c.shutdown()
        deadline = time.monotonic() + 15
        while _ray_processes(session_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ray_processes(session_dir) == [], "a raylet, GCS or worker process outlived the cluster"


def _node_ids(c: Cluster) -> set[str]:
    return {n.node_id for n in c.list_all_nodes()}


def _write_config(tmp_path: Path, c: Cluster, sleep_s: float, **rollout: object) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in rollout.items())
    text = f"""
[engine]
model = "tiny-random"
[sampling]
max_tokens = 8
[harness]
kind = "command"
[harness.options]
argv = ["python3", "{{state_dir}}/agent.py", "{{base_url}}", "{{api_key}}", "{{model}}", "{sleep_s}"]
final_answer_file = "answer.txt"
files = {{ "agent.py" = {json.dumps(AGENT)} }}
[rollout]
executor = "ray"
agent_timeout_s = 120
{extra}[rollout.ray]
address = "{c.address}"
max_sandboxes_per_node = 1
call_grace_s = 30
[sandbox]
root_dir = "{tmp_path / 'sandboxes'}"
isolation = "required"
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    load_config(path, [])  # the test's own config is valid
    return path


def _run(args: list[str], timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([HARNESSRL, *args], capture_output=True, text=True, timeout=timeout_s, env=env)


def _rollouts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_spreads_over_the_nodes_and_agents_reach_the_proxy(cluster: Cluster, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, cluster, 0.5, group_size=3, max_concurrent_rollouts=3)
    out = tmp_path / "out"
    done = _run(["rollout", "--config", str(cfg), "--out", str(out), "--limit", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    rollouts = _rollouts(out / "rollouts.jsonl")
    assert len(rollouts) == 6
    assert [r["status"] for r in rollouts] == ["ok"] * 6, [r["error"] for r in rollouts]
    # one sandbox per node at a time, 3 at once: every node ran rollouts
    assert {r["metadata"]["node_id"] for r in rollouts} == _node_ids(cluster)
    for r in rollouts:  # the agent's one call crossed its node's relay and was recorded
        assert len(r["trace"]["turns"]) == 1
        assert len(r["trace"]["turns"][0]["completion_ids"]) >= 1
        assert r["final_answer"] is not None
    assert leftover_sandboxes(tmp_path / "sandboxes") == []
    assert leftover_processes(tmp_path / "sandboxes") == []


def test_train_on_the_cluster_with_the_white_box_loop(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = _run(["train", "--out", str(out), "--set", "engine.model=tiny-random", "--set", "harness.kind=white_box",
                 "--set", "rollout.group_size=3", "--set", "rollout.max_concurrent_rollouts=3",
                 "--set", "sampling.max_tokens=16", "--set", "train.steps=2", "--set", "train.max_staleness=0",
                 "--set", "train.learning_rate=1e-3",
                 "--set", 'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
                 "--set", "rollout.executor=ray", "--set", f'rollout.ray.address="{cluster.address}"',
                 "--set", "rollout.ray.max_sandboxes_per_node=1",
                 "--set", f'sandbox.root_dir="{tmp_path / "sandboxes"}"'])
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert all(m["tokens_trained"] > 0 for m in metrics)
    assert metrics[0]["step0/ratio_abs_dev"] < 1e-3
    rollouts = _rollouts(out / "rollouts.jsonl")
    assert len(rollouts) >= 6 and all(r["status"] == "ok" for r in rollouts), [r["error"] for r in rollouts]
    assert {r["metadata"]["node_id"] for r in rollouts} == _node_ids(cluster)
    assert leftover_sandboxes(tmp_path / "sandboxes") == []
    assert leftover_processes(tmp_path / "sandboxes") == []


def _node_workers() -> list[psutil.Process]:
    """The live `NodeWorker` actor processes (of this module's one run at a time)."""
    return [p for p in psutil.process_iter() if alive(p) and cmdline(p)[:1]
            and cmdline(p)[0].startswith("ray::NodeWorker")]


def _run_killing_a_node(cluster: Cluster, tmp_path: Path, args: list[str],
                        timeout_s: float) -> tuple[str, int, str, list[psutil.Process]]:
    """Run `harnessrl ARGS`, kill a worker node (no grace) once the agents of the first 3
    rollouts (one per node) made their call and sleep, and wait at most `timeout_s` for the
    run to end; returns (the killed node's id, the exit status, stderr, the run's node workers
    and sandbox processes as they were just before the kill). A new node replaces it
    afterwards, so the module's later tests get 3 nodes again."""
    victim = next(iter(cluster.worker_nodes))
    victim_id = victim.node_id
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([HARNESSRL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while len(list((tmp_path / "sandboxes").glob("*/work/answer.txt"))) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first rollouts never started"
            time.sleep(0.2)
        sandboxed = [psutil.Process(pid) for pid in leftover_processes(tmp_path / "sandboxes")]
        workers = _node_workers()
        assert len(workers) == 3 and len(sandboxed) >= 3, (workers, sandboxed)
        cluster.remove_node(victim, allow_graceful=False)
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
    return victim_id, proc.returncode, stderr, workers + sandboxed


def _assert_none_survives(processes: list[psutil.Process], sandboxes: Path, grace_s: float = 10.0) -> None:
    """Within `grace_s` seconds none of `processes` (the run's node workers and sandbox
    processes, the dead node's included) runs, and no sandbox process is left under `sandboxes`."""
    deadline = time.monotonic() + grace_s
    while [p for p in processes if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, " ".join(cmdline(p))[:120]) for p in processes if alive(p)]
    assert left == [], f"a node worker or sandbox process of the run outlived it: {left}"
    assert leftover_processes(sandboxes) == []


def test_a_node_killed_mid_run_ends_its_rollouts_as_infra_error(cluster: Cluster, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, cluster, 15, group_size=3, max_concurrent_rollouts=3)
    out = tmp_path / "out"
    victim_id, _, stderr, processes = _run_killing_a_node(
        cluster, tmp_path, ["rollout", "--config", str(cfg), "--out", str(out), "--limit", "2"], 240)
    rollouts = _rollouts(out / "rollouts.jsonl")
    assert len(rollouts) == 6, stderr[-3000:]
    lost = [r for r in rollouts if r["metadata"].get("node_id") == victim_id]
    assert len(lost) == 1, "the victim ran exactly one rollout (its slot never freed)"
    assert lost[0]["status"] == "infra_error" and "died" in lost[0]["error"]
    # it ended when its node died, not when its agent would have (15 s after its call)
    assert lost[0]["timings_s"]["agent_s"] < 14
    rest = [r for r in rollouts if r is not lost[0]]
    assert [r["status"] for r in rest] == ["ok"] * 5, [r["error"] for r in rest]
    rest_nodes = {r["metadata"]["node_id"] for r in rest}
    assert victim_id not in rest_nodes and len(rest_nodes) == 2, "the run went on on the 2 live nodes"
    _assert_none_survives(processes, tmp_path / "sandboxes")
    # the dead node's worker closes its sandbox when it sees its raylet die, unless Ray ended
    # the worker first; nothing else is left
    # (a sandbox started as root keeps its device nodes beside it, in `.dev-<sandbox id>`)
    left = leftover_sandboxes(tmp_path / "sandboxes")
    owners = {p.name.removeprefix(".dev-") for p in left}
    assert len(owners) <= 1 and all(o.startswith(lost[0]["rollout_id"]) for o in owners), left


async def test_cancelling_the_run_closes_every_node_sandbox(cluster: Cluster, tmp_path: Path) -> None:
    from harnessrl.rollout.orchestrator import Orchestrator
    from harnessrl.rollout.runner import RolloutLimits
    from harnessrl.runtime import start_runtime

    cfg = load_config(_write_config(tmp_path, cluster, 60, group_size=3, max_concurrent_rollouts=3), [])
    sandboxes = tmp_path / "sandboxes"
    async with start_runtime(cfg) as rt:
        orch = Orchestrator(rt.tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for, group_size=3,
                            max_concurrent_rollouts=3, limits=RolloutLimits(120, 30))
        orch.allow(1)
        orch.start()
        deadline = time.monotonic() + 120
        while len(list(sandboxes.glob("*/work/answer.txt"))) < 3:  # every node's agent sleeps
            assert time.monotonic() < deadline, "the rollouts never started"
            await asyncio.sleep(0.2)
        assert rt.proxy.store.live_sessions == 3
        t0 = time.monotonic()
        await orch.close()
        closed_s = time.monotonic() - t0
        assert rt.proxy.store.live_sessions == 0
        assert leftover_sandboxes(sandboxes) == [], "a node kept a cancelled rollout's sandbox"
        assert leftover_processes(sandboxes) == [], "a cancelled agent outlived its rollout"
        assert {n.running for n in rt.backend.nodes.nodes} == {0}
    assert closed_s < 20, f"cancelling took {closed_s:.1f} s (the agents sleep 60 s)"
    assert not ray.is_initialized(), "the run left Ray joined"


async def test_the_node_relay_carries_bytes_both_ways_to_its_tcp_upstream(tmp_path: Path) -> None:
    from harnessrl.sandbox.tcp_relay import TcpRelay

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the client's EOF crosses the relay
        writer.write(b"echo:" + data)
        await writer.drain()
        writer.close()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    relay = await TcpRelay.start("127.0.0.1", port)
    try:
        assert relay.socket_path.stat().st_mode & 0o777 == 0o600
        assert relay.socket_path.parent.stat().st_mode & 0o777 == 0o700
        payload = os.urandom(300_000)
        reader, writer = await asyncio.open_unix_connection(str(relay.socket_path))
        writer.write(payload)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"echo:" + payload
        writer.close()
    finally:
        await relay.aclose()
        upstream.close()
    assert not relay.socket_path.parent.exists()
    with pytest.raises(ValueError, match="port 0"):
        await TcpRelay.start("127.0.0.1", 0)


def test_ray_config_errors_name_the_key() -> None:
    from harnessrl.errors import ConfigError

    cfg = load_config(None, ["rollout.executor=ray", "rollout.ray.max_sandboxes_per_node=2"])
    assert cfg.rollout.executor == "ray" and cfg.rollout.ray.max_sandboxes_per_node == 2
    with pytest.raises(ConfigError, match="executor"):
        load_config(None, ["rollout.executor=kubernetes"])
    with pytest.raises(ConfigError, match="max_sandboxes_per_node"):
        load_config(None, ["rollout.ray.max_sandboxes_per_node=0"])
    with pytest.raises(ConfigError, match="adress"):
        load_config(None, ["rollout.ray.adress=1"])


def test_train_goes_on_when_a_node_dies_mid_step(cluster: Cluster, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, cluster, 8, group_size=3, max_concurrent_rollouts=3)
    out = tmp_path / "run"
    victim_id, returncode, stderr, processes = _run_killing_a_node(
        cluster, tmp_path,
        ["train", "--config", str(cfg), "--out", str(out), "--set", "train.steps=2",
         "--set", "train.max_staleness=0", "--set", "train.learning_rate=1e-3",
         "--set", 'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"'], 300)
    assert returncode == 0, stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2], "both steps ran"
    rollouts = _rollouts(out / "rollouts.jsonl")
    lost = [r for r in rollouts if r["metadata"].get("node_id") == victim_id]
    assert [r["status"] for r in lost] == ["infra_error"] and "died" in lost[0]["error"]
    rest = [r for r in rollouts if r["metadata"].get("node_id") != victim_id]
    assert len(rest) >= 5 and all(r["status"] == "ok" for r in rest), [r["error"] for r in rest]
    _assert_none_survives(processes, tmp_path / "sandboxes")


async def test_a_node_that_cannot_isolate_stops_a_required_run(cluster: Cluster, tmp_path: Path) -> None:
    from harnessrl.errors import SandboxError
    from harnessrl.runtime import start_runtime

    cfg = load_config(_write_config(tmp_path, cluster, 0), ["sandbox.use_bwrap=false"])  # isolation = "required"
    with pytest.raises(SandboxError, match=r"Ray node [0-9a-f]+ cannot run the run's sandboxes: "
                                           r"sandbox.isolation = 'required' but bubblewrap is not used"):
        async with start_runtime(cfg):
            pass
    assert not ray.is_initialized(), "the failed start left Ray joined"


async def test_each_node_checks_its_file_table_for_the_sandboxes_it_holds_at_once(cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    from harnessrl.errors import SandboxError
    from harnessrl.runtime import start_runtime
    from harnessrl.sandbox.filetable import FILE_TABLE_SHARE, file_max

    limit = file_max()
    if limit is None:
        pytest.skip("fs.file-max is unreadable here")
    per_sandbox = 128 * 512  # sandbox.max_processes x sandbox.max_open_files (the defaults)
    over = int(limit * FILE_TABLE_SHARE) // per_sandbox + 1  # one sandbox fits, `over` do not
    if over > 4096:
        pytest.skip(f"fs.file-max {limit:,}: {over} sandboxes a node is past any config here")
    path = _write_config(tmp_path, cluster, 0, max_concurrent_rollouts=over)
    cfg = load_config(path, [f"rollout.ray.max_sandboxes_per_node={over}"])
    with pytest.raises(SandboxError, match=rf"Ray node [0-9a-f]+ cannot run the run's sandboxes: .*"
                                           rf"x {over} sandboxes = {over * per_sandbox:,}"):
        async with start_runtime(cfg):
            pass
    assert not ray.is_initialized(), "the failed start left Ray joined"
