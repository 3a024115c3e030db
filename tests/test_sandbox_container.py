"""The podman sandbox backend (`sandbox/podman.py`) for real: the seam, its limits, orphan
cleanup and a whole rollout (the attack suite runs against podman in `test_sandbox_attacks.py`).

Every test starts real containers of the image `scripts/podman-image` builds (Debian bookworm
minbase + python3, no registry) in harnessrl's podman store. Skipped where podman cannot run
(not root, no podman, no image: the reason is printed); `.ci/run` builds the image and sets
`HARNESSRL_REQUIRE_PODMAN=1`, under which a missing runtime fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from fakes import FakeEngine, FakeSessions
from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import SandboxError
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rewards.select import verifier_for
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.base import Sandbox, SandboxProcess
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.podman import (
    OWNER_LABEL,
    SANDBOX_LABEL,
    PodmanSandboxBackend,
    podman_argv,
    remove_containers,
    remove_orphans,
)
from harnessrl.sandbox.podman_host import CGROUP_PARENT, kill_members
from harnessrl.sandbox.sweep import OWNERS, sweep
from harnessrl.tasks.base import Task
from harnessrl.tasks.humaneval import HumanEvalSource, load_problems
from harnessrl.tasks.stdio import StdioSource
from sandbox_kits import KITS, assert_no_podman_leftovers, podman_problem

if podman_problem() is not None and os.environ.get("HARNESSRL_REQUIRE_PODMAN") == "1":
    raise RuntimeError(f"HARNESSRL_REQUIRE_PODMAN=1 but podman sandboxes cannot run: {podman_problem()}")
pytestmark = pytest.mark.skipif(podman_problem() is not None,
                                reason=f"podman sandboxes cannot run here: {podman_problem()}")


@pytest.fixture
async def proxy(tokenizer) -> AsyncIterator[ProxyServer]:
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0, sampling=SamplingConfig(max_tokens=8))) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_container_left() -> Iterator[None]:
    yield
    assert_no_podman_leftovers()


def _backend(root: Path, proxy: ProxyServer | None = None, **config: object) -> PodmanSandboxBackend:
    return KITS["podman"].backend(root, proxy, **config)


# ---- the seam ---------------------------------------------------------------------------------


async def test_files_exec_spawn_and_close(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("seam", {"in.txt": "hello\n", "sub/deep.txt": "x"})
    assert isinstance(sb, Sandbox)
    try:
        assert sb.agent_path("work", "in.txt") == str(sb.workdir / "in.txt")
        with pytest.raises(SandboxError, match="escapes"):
            sb.agent_path("work", "../x")
        sb.write_file(".harnessrl/conf.json", '{"k": 1}\n', base="home", mode=0o600)
        r = await sb.exec("cat in.txt; cat $HOME/.harnessrl/conf.json; echo more >> in.txt; echo new > sub/made.txt; "
                          "echo err >&2; pwd; id -u; exit 3", 60)
        assert r.returncode == 3 and not r.timed_out, r
        assert r.stdout.splitlines() == ["hello", '{"k": 1}', str(sb.workdir), str(sb.owner)]
        assert r.stderr == "err\n"
        # the agent's writes land on the host, readable through the seam
        assert sb.read_file("in.txt") == b"hello\nmore\n" and sb.read_file("sub/made.txt") == b"new\n"
        assert (await sb.exec(["no-such-program"], 30)).returncode == 127
        # a timeout kills the container, whatever the command does with SIGTERM
        slow = await sb.exec("trap '' TERM; sleep 60", 1.0)
        assert slow.timed_out and slow.duration_s < 20, slow
        # a spawned agent with its log; kill_tree stops its container, children included
        secret = "s3cret value=1 # not a comment"
        agent = await sb.spawn(["bash", "-c", 'echo "started $SECRET_X"; sleep 60 & sleep 60'],
                               env={"SECRET_X": secret}, log_file=".harnessrl/a.log")
        assert isinstance(agent, SandboxProcess)
        assert not any(secret in arg for arg in psutil.Process(agent.pid).cmdline())  # env not in argv
        await _command_started(sb, ["bash", "sleep", "sleep"])
        assert await agent.wait(0.1) is None
        assert await agent.kill_tree() == 3
        assert agent.returncode is not None and sb.list_processes() == []
        assert sb.read_file(".harnessrl/a.log", base="home") == f"started {secret}\n".encode()
        done = await sb.spawn(["bash", "-c", "exit 7"])
        assert await done.wait(60) == 7
    finally:
        await sb.close()
    await sb.close()  # idempotent
    assert not sb.root.exists()
    with pytest.raises(SandboxError, match="closed"):
        await sb.exec("true", 5)


async def test_cancelled_exec_leaves_no_container(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("cancel", {})
    try:
        task = asyncio.ensure_future(sb.exec("sleep 60", 120))
        for _ in range(200):
            if sb.list_processes():
                break
            await asyncio.sleep(0.05)
        assert sb.list_processes()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sb.list_processes() == []
    finally:
        await sb.close()


async def test_kill_members_kills_every_process_of_the_containers_from_the_host(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("hostkill", {})
    try:
        # PID 1 ignores SIGTERM; a grandchild left the session: SIGKILL through the cgroup ends both
        proc = await sb.spawn(["bash", "-c", "trap '' TERM; setsid sleep 60 & sleep 60"])
        # the command's own processes, not runc's: while the container is created its members
        # are `runc init` (up to three), and killing those fails the creation instead
        await _command_started(sb, ["bash", "sleep", "sleep"])
        members = sb.list_processes()
        t0 = time.monotonic()
        assert 1 <= kill_members(sb.sandbox_id) <= 3  # the rest may die with PID 1 before their turn
        killed_s = time.monotonic() - t0
        # dead on return, not merely gone from cgroup.procs (which an exiting process leaves first)
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in members)
        assert killed_s < 0.5, f"{killed_s:.2f} s"  # no podman process in the way (podman rm: ~1 s)
        assert await proc.wait(30) == 137  # SIGKILL, podman's 128+9
        assert kill_members(sb.sandbox_id) == 0
    finally:
        await sb.close()


async def _command_started(sb: Sandbox, names: list[str]) -> None:
    """Wait (20 s at most) until the sandbox's processes are the command's own, `names` (their
    command names): not runc's `runc init` members of a container being created, nor a fork
    that has not exec'd yet."""
    found: list[str] = []
    for _ in range(400):
        found = []
        for pid in sb.list_processes():
            try:
                found.append(psutil.Process(pid).name())
            except psutil.NoSuchProcess:
                continue
        if sorted(found) == sorted(names):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the command's processes {names} did not start: {found}")


async def test_a_container_killed_from_the_host_while_it_is_created_exits_137(sandbox_root: Path) -> None:
    # the disk watchdog's kill reaching `runc init`: podman reports "runc create failed" (126),
    # the sandbox reports the kill
    sb = await _backend(sandbox_root).create("earlykill", {})
    try:
        proc = await sb.spawn(["sleep", "60"], log_file="agent.log")
        for _ in range(20000):
            if sb.list_processes():
                break
            await asyncio.sleep(0.001)
        await sb._disk_stop()
        assert await proc.wait(30) == 137
        assert proc.returncode == 137
        later = await sb.exec(["sh", "-c", "exit 126"], 60)  # a status of the command's own is kept
        assert later.returncode == 126, later
    finally:
        await sb.close()


async def test_memory_and_cpu_limits(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root, memory_bytes=96 << 20, cpus=0.5).create("limits", {})
    try:
        small = await sb.exec(["python3", "-c", "b = bytearray(32 << 20); print(len(b))"], 60)
        assert small.returncode == 0 and small.stdout.strip() == str(32 << 20), small
        big = await sb.exec(["python3", "-c", "b = bytearray(256 << 20); print('allocated')"], 60)
        assert big.returncode == 137 and "allocated" not in big.stdout, big  # OOM-killed
        assert not Path("oom").exists()  # conmon's OOM marker stays in the sandbox's private state
        quota = await sb.exec("cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us "
                              "2>/dev/null || cat /sys/fs/cgroup/cpu.max", 30)
        numbers = [int(x) for x in quota.stdout.split()]
        assert numbers[0] / numbers[1] == 0.5, quota
    finally:
        await sb.close()


async def test_orphan_cleanup_touches_only_our_dead_runs_containers(sandbox_root: Path) -> None:
    cfg = PodmanSandboxConfig(root_dir=sandbox_root)
    base = podman_argv(cfg)
    run = ["run", "-d", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    tag = secrets.token_hex(4)

    def start(*labels: str) -> str:
        args = [a for label in labels for a in ("--label", label)]
        return subprocess.run([*base, *run, *args, cfg.image, "sleep", "60"], check=True, capture_output=True,
                              text=True).stdout.strip()

    foreign = start(f"other.tool={tag}")  # not harnessrl's
    dead = start(f"{SANDBOX_LABEL}=orphan-{tag}", f"{OWNER_LABEL}=999999999-{tag}")  # its run is gone
    live = start(f"{SANDBOX_LABEL}=live-{tag}", f"{OWNER_LABEL}={os.getpid()}-{tag}")  # this run's
    try:
        assert PodmanSandboxBackend(cfg).check_isolation("required") == []  # a run's start sweeps
        assert remove_orphans(cfg) == 0

        def running(cid: str) -> bool:
            return bool(subprocess.run([*base, "ps", "-q", "--filter", f"id={cid}"], capture_output=True,
                                       text=True).stdout.strip())

        assert not running(dead) and running(live) and running(foreign)
        assert remove_containers(cfg, f"{SANDBOX_LABEL}=live-{tag}") == 1  # by exact label
        assert not running(live) and running(foreign)
    finally:
        subprocess.run([*base, "rm", "-f", "-t", "0", "--ignore", foreign, dead, live], capture_output=True)


OWNER = """\
import asyncio, sys
from pathlib import Path
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.podman import PodmanSandboxBackend

async def main() -> None:
    sb = await PodmanSandboxBackend(PodmanSandboxConfig(root_dir=Path(sys.argv[1]))).create("killed", {"a.txt": "x"})
    await sb.spawn(["sleep", "300"])
    while not sb.list_processes():
        await asyncio.sleep(0.05)
    print(sb.sandbox_id, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_a_killed_runs_podman_sandbox_is_swept_with_its_containers(sandbox_root: Path) -> None:
    base = podman_argv(PodmanSandboxConfig())
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(sandbox_root)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        assert sandbox_id.startswith("killed-"), owner.communicate(timeout=60)
        os.kill(owner.pid, signal.SIGKILL)  # no teardown: its container, cgroups and directory stay
        owner.wait()

        def containers() -> list[str]:
            return subprocess.run([*base, "ps", "-a", "-q", "--filter", f"label={SANDBOX_LABEL}={sandbox_id}"],
                                  capture_output=True, text=True, check=True).stdout.split()

        assert len(containers()) == 1 and (sandbox_root / sandbox_id / "work" / "a.txt").exists()
        assert list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/{sandbox_id}"))

        swept = sweep(sandbox_root, proxy_tmp=sandbox_root)

        assert swept.sandboxes == [sandbox_id] and not swept.errors, swept
        assert swept.owners[0].startswith(f"{owner.pid}-") and swept.processes >= 1 and swept.cgroups >= 1, swept
        assert containers() == []
        assert not (sandbox_root / sandbox_id).exists()
        assert not list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/{sandbox_id}"))
        assert not (sandbox_root / OWNERS / f"{sandbox_id}.sandbox").exists()
        assert not sweep(sandbox_root, proxy_tmp=sandbox_root), "a second sweep finds nothing"
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
        sweep(sandbox_root, proxy_tmp=sandbox_root)


# ---- a whole rollout ------------------------------------------------------------------------------

AGENT = """\
import json, sys, urllib.request
base_url, key = sys.argv[1], open(sys.argv[2]).read().strip()
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": open("task.txt").read()}]})
req = urllib.request.Request(base_url + "/chat/completions", data=body.encode(),
                             headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=60))
open("answer.txt", "w").write(str(sum(json.load(open("numbers.json")))))
print("model said", repr(reply["choices"][0]["message"]["content"]))
"""


async def test_a_rollout_runs_the_command_harness_in_a_container(proxy: ProxyServer, sandbox_root: Path) -> None:
    harness = CommandHarness(CommandHarnessConfig(
        name="container-agent", argv=["python3", "{state_dir}/agent.py", "{base_url}", "{state_dir}/key"],
        files={"agent.py": AGENT, "key": "{api_key}"}))
    backend = _backend(sandbox_root, proxy)
    task = Task("sum/0", "procedural", "Add the numbers in numbers.json; write the sum to answer.txt.",
                workspace={"numbers.json": "[19, 23]", "task.txt": "add them"},
                hidden_tests={"answer": "42", "answer_kind": "int"})
    rollout = await run_rollout(task, 0, harness, backend, proxy, ExactMatchVerifier(),
                                RolloutLimits(agent_timeout_s=120, verify_timeout_s=60))
    assert rollout.status == "ok", rollout.error
    assert rollout.reward == 1.0
    assert rollout.trace is not None and [t.status for t in rollout.trace.turns] == ["ok"]
    assert proxy.store.live_sessions == 0


def _code_tasks() -> dict[str, tuple[Task, str, str]]:
    """family -> (task, a right solution.py, a wrong one)."""
    he = HumanEvalSource()
    task = next(he.get(i) for i in range(len(he)) if he.get(i).task_id == "HumanEval/0")
    problem = load_problems()["HumanEval/0"]
    stdio = StdioSource(Path(__file__).resolve().parents[1] / "examples" / "stdio_tasks.jsonl")
    sum_two = next(stdio.get(i) for i in range(len(stdio)) if stdio.get(i).task_id == "sum-two")
    return {
        "humaneval": (task, problem["prompt"] + problem["canonical_solution"],
                      problem["prompt"] + "    return False\n"),
        "stdio": (sum_two, "a, b = map(int, input().split())\nprint(a + b)\n",
                  "a, b = map(int, input().split())\nprint(a + abs(b))\n"),  # fails "10 -3" only
    }


@pytest.mark.parametrize("family", ["humaneval", "stdio"])
async def test_unit_test_and_stdio_tasks_are_scored_in_containers(sandbox_root: Path, family: str) -> None:
    """The verifiers' own programs run as the containers' uid 1000 (the verify directory is
    theirs): a right solution scores 1.0, a wrong one what it earns, never an unscored rollout."""
    task, right, wrong = _code_tasks()[family]
    backend = _backend(sandbox_root)
    for source, expected in ((right, 1.0), (wrong, 0.0 if family == "humaneval" else 0.75)):
        harness = CommandHarness(CommandHarnessConfig(argv=["cp", "{state_dir}/solution.py", "solution.py"],
                                                      files={"solution.py": source}))
        rollout = await run_rollout(task, 0, harness, backend, FakeSessions(), verifier_for(task),
                                    RolloutLimits(agent_timeout_s=60, verify_timeout_s=90))
        assert (rollout.status, rollout.reward) == ("ok", expected), (rollout.error, rollout.reward_parts)


async def test_writing_past_disk_bytes_in_a_container_scores_zero(sandbox_root: Path) -> None:
    task, right, _ = _code_tasks()["humaneval"]
    harness = CommandHarness(CommandHarnessConfig(
        argv=["bash", "-c", "cp {state_dir}/solution.py solution.py && head -c 8388608 /dev/zero > big && sleep 30"],
        files={"solution.py": right}))
    backend = _backend(sandbox_root, disk_bytes=1 << 20, disk_poll_s=0.05)
    rollout = await run_rollout(task, 0, harness, backend, FakeSessions(), verifier_for(task),
                                RolloutLimits(agent_timeout_s=60, verify_timeout_s=60))
    assert rollout.reward == 0.0 and "disk_bytes" in rollout.metadata["failure_cause"], rollout


@pytest.mark.e2e
@pytest.mark.agents
def test_harnessrl_rollout_runs_mini_swe_agent_in_containers(tmp_path: Path, sandbox_root: Path) -> None:
    """`harnessrl rollout` with `sandbox.kind = "podman"`: mini-swe-agent (its install tree
    bound read-only) runs in a container and reaches the proxy through the forwarder."""
    from harnessrl.config import load_config
    from harnessrl.harness.install import agent_executable
    from harnessrl.run_rollouts import run_evaluation

    try:
        agent_executable("mini-swe-agent")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"mini-swe-agent not installed ({exc}); run `harnessrl harness install mini-swe-agent`")
    cfg = load_config(None, ["engine.model=tiny-random", "harness.kind=mini-swe-agent", "rollout.group_size=1",
                             "harness.options={step_limit = 2, max_format_errors = 2}", "sandbox.kind=podman",
                             f'sandbox.root_dir="{sandbox_root}"'])
    out = tmp_path / "eval"
    assert run_evaluation(cfg, out, limit=1) == 0
    [rollout] = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rollout["status"] == "ok", (rollout["error"], rollout["metadata"])
    assert len(rollout["trace"]["turns"]) >= 1 and all(t["status"] == "ok" for t in rollout["trace"]["turns"])
    assert rollout["metadata"]["exit_code"] == 0, rollout["metadata"]


async def test_each_sandbox_has_a_uid_of_its_own_and_a_private_root(sandbox_root: Path) -> None:
    """Every container was host uid 1000: one container took the user's 128 inotify instances
    and a sibling got EMFILE, and a setuid-1000 file an agent planted ran for any host user (the
    sandbox root was 0755). Now each sandbox is a uid of its own and the root is 0700."""
    hog_code = (
        "import ctypes, os, sys, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "n = 0\n"
        "while n < 100000 and libc.inotify_init() >= 0:\n"
        "    n += 1\n"
        "open('held', 'w').write(str(n))\n"
        "time.sleep(60)\n")
    one_code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "print(libc.inotify_init(), ctypes.get_errno())\n")
    backend = _backend(sandbox_root)
    hog = await backend.create("inotify-hog", {"hog.py": hog_code})
    sibling = await backend.create("inotify-sibling", {"one.py": one_code})
    try:
        proc = await hog.spawn(["python3", "-I", "hog.py"])
        for _ in range(600):
            if (hog.workdir / "held").exists() and hog.read_file("held"):
                break
            await asyncio.sleep(0.1)
        held = int(hog.read_file("held"))
        assert held >= 16, held  # the hog ran out of its user's instances
        r = await sibling.exec(["python3", "-I", "one.py"], 60)
        fd, err = map(int, r.stdout.split())
        assert fd >= 0, (fd, err, held)  # not EMFILE: the sibling's budget is its own
        assert os.stat(sandbox_root).st_mode & 0o777 == 0o700
        ids = [(await sb.exec(["id", "-u"], 30)).stdout.strip() for sb in (hog, sibling)]
        assert ids[0] != ids[1] and "0" not in ids and "1000" not in ids, ids
        await proc.kill_tree()
    finally:
        await hog.close()
        await sibling.close()
