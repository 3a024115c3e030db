"""The podman sandbox backend (`sandbox/podman.py`) for real: the seam, its limits, the attack
suite of `test_sandbox_attacks.py` run from inside containers, and a whole rollout.

Every test starts real containers of the image `.ci/podman-image` builds (Debian bookworm
minbase + python3, no registry) in harnessrl's podman store. Skipped where podman cannot run
(not root, no podman, no image: the reason is printed); `.ci/run` builds the image and sets
`HARNESSRL_REQUIRE_PODMAN=1`, under which a missing runtime fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from fakes import FakeEngine
from harnessrl.engine.chat import ChatLayer
from harnessrl.errors import SandboxError
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.base import Sandbox, SandboxProcess
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.podman import (
    CGROUP_PARENT,
    OWNER_LABEL,
    SANDBOX_LABEL,
    PodmanSandbox,
    PodmanSandboxBackend,
    podman_argv,
    podman_problem,
    remove_containers,
    remove_orphans,
)
from harnessrl.tasks.base import Task

_PROBLEM = podman_problem(PodmanSandboxConfig())
if _PROBLEM is not None and os.environ.get("HARNESSRL_REQUIRE_PODMAN") == "1":
    raise RuntimeError(f"HARNESSRL_REQUIRE_PODMAN=1 but podman sandboxes cannot run: {_PROBLEM}")
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"podman sandboxes cannot run here: {_PROBLEM}")


@pytest.fixture
async def proxy(tokenizer) -> AsyncIterator[ProxyServer]:
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0, max_tokens_cap=8)) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_container_left() -> object:
    yield
    left = subprocess.run([*podman_argv(PodmanSandboxConfig()), "ps", "-a", "-q", "--filter", f"label={SANDBOX_LABEL}"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert left == [], "containers left after every sandbox closed"
    cgroups = list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/*/"))
    assert cgroups == [], "sandbox cgroups left after every sandbox closed"


def _backend(root: Path, proxy: ProxyServer | None = None, ro_binds: tuple[Path, ...] = (),
             **config: object) -> PodmanSandboxBackend:
    cfg = PodmanSandboxConfig(root_dir=root, **config)  # type: ignore[arg-type]
    if proxy is None:
        return PodmanSandboxBackend(cfg, ro_binds=ro_binds)
    return PodmanSandboxBackend(cfg, ro_binds=ro_binds, proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)


async def _py(sandbox: PodmanSandbox, code: str, timeout_s: float = 60.0) -> dict:
    """Run `code` with the image's python3; it prints one JSON object, returned here."""
    result = await sandbox.exec(["python3", "-c", textwrap.dedent(code)], timeout_s)
    assert result.returncode == 0, result
    return json.loads(result.stdout.strip().splitlines()[-1])


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
        assert r.stdout.splitlines() == ["hello", '{"k": 1}', str(sb.workdir), "1000"]
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
        for _ in range(200):
            if len(sb.list_processes()) >= 3:
                break
            await asyncio.sleep(0.05)
        assert await agent.wait(0.1) is None
        assert await agent.kill_tree() >= 3
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


# ---- attacks from inside (the cases of test_sandbox_attacks.py) ----------------------------------


async def test_no_capability_and_unprivileged_user(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("caps", {})
    try:
        out = await _py(sb, """
            import json, os
            caps = dict(l.split(":\\t") for l in open("/proc/self/status").read().splitlines() if l.startswith("Cap"))
            nnp = [l for l in open("/proc/self/status").read().splitlines() if l.startswith("NoNewPrivs")]
            print(json.dumps({"caps": {k: int(v, 16) for k, v in caps.items()}, "uid": os.getuid(), "nnp": nnp}))
        """)
        assert out["caps"] == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}
        assert out["uid"] == 1000 and out["nnp"] == ["NoNewPrivs:\t1"]
    finally:
        await sb.close()


async def test_open_by_handle_at_is_refused(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("handle", {})
    try:
        out = await _py(sb, """
            import ctypes, json, os
            libc = ctypes.CDLL(None, use_errno=True)
            class Handle(ctypes.Structure):
                _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("f", ctypes.c_ubyte * 128)]
            h, mount_id = Handle(), ctypes.c_int()
            h.bytes = 128
            libc.name_to_handle_at(-100, b"/", ctypes.byref(h), ctypes.byref(mount_id), 0)
            mount_fd = os.open("/", os.O_RDONLY)
            fd = libc.open_by_handle_at(mount_fd, ctypes.byref(h), os.O_RDONLY)
            print(json.dumps({"fd": fd, "errno": ctypes.get_errno()}))
        """)
        assert out["fd"] == -1 and out["errno"] == 1, out  # EPERM: no CAP_DAC_READ_SEARCH
    finally:
        await sb.close()


async def test_read_only_binds_and_image_stay_read_only(sandbox_root: Path, tmp_path: Path) -> None:
    tree = tmp_path / "agent-tree"
    tree.mkdir()
    (tree / "cli.js").write_text("original\n")
    sb = await _backend(sandbox_root, ro_binds=(tree,)).create("ro", {})
    try:
        attack = (f"cat {tree}/cli.js; mount -o remount,rw {tree}; mount -o remount,rw /usr; "
                  f"unshare -rm sh -c 'mount -o remount,rw {tree}'; "
                  f"echo changed > {tree}/cli.js; touch /usr/owned; touch /owned; touch {sandbox_root}/owned; "
                  f"grep -E ' {tree} | / ' /proc/self/mounts")
        r = await sb.exec(attack, 60)
        assert r.stdout.startswith("original\n"), r
        assert (tree / "cli.js").read_text() == "original\n"
        assert not (sandbox_root / "owned").exists()
        mounts = [line.split() for line in r.stdout.splitlines()[1:]]
        assert len(mounts) == 2 and all(m[3].startswith("ro") for m in mounts), r.stdout
        assert "Read-only file system" in r.stderr, r.stderr
        # the next container starts from the unchanged image
        assert (await sb.exec("test ! -e /owned && test ! -e /usr/owned", 30)).returncode == 0
    finally:
        await sb.close()


async def test_other_sandboxes_files_processes_and_keys_unreachable(sandbox_root: Path) -> None:
    backend = _backend(sandbox_root)
    victim = await backend.create("victim", {"secret.txt": "victim-file-secret"})
    attacker = await backend.create("attacker", {})
    key = "sk-victim-0123456789abcdef"
    try:
        agent = await victim.spawn(["sleep", "60"], env={"OPENAI_API_KEY": key})
        for _ in range(200):
            if victim.list_processes():
                break
            await asyncio.sleep(0.05)
        out = await _py(attacker, f"""
            import glob, json, os
            found = []
            for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
                try:
                    if ("{key[:8]}" + "{key[8:]}").encode() in open(path, "rb").read():  # not in our argv
                        found.append(path)
                except OSError:
                    pass
            try:
                listed = os.listdir("{sandbox_root}")
            except OSError as e:
                listed = [repr(e)]
            try:
                text = open("{victim.workdir}/secret.txt").read()
            except OSError as e:
                text = repr(e)
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
            print(json.dumps({{"found": found, "listed": listed, "text": text, "pids": pids}}))
        """)
        assert out["found"] == []
        assert out["listed"] == [attacker.root.name]  # only its own directory is bound
        assert "victim-file-secret" not in out["text"]
        assert str(agent.pid) not in out["pids"] and len(out["pids"]) <= 2, out["pids"]  # python (+ its /proc read)
        assert (victim.workdir / "secret.txt").read_text() == "victim-file-secret"
    finally:
        await attacker.close()
        await victim.close()


async def test_only_the_proxy_is_reachable(proxy: ProxyServer, sandbox_root: Path) -> None:
    other = socket.create_server(("127.0.0.1", 0))  # a host loopback service that is not the proxy
    sb = await _backend(sandbox_root, proxy).create("net", {})
    session_id, key = proxy.open_session("net")
    endpoint = sb.agent_endpoint(proxy.endpoint(key))
    assert endpoint.base_url.startswith(f"http://127.0.0.1:{proxy.port}/")
    try:
        out = await _py(sb, f"""
            import json, socket, urllib.request, urllib.error
            def connect(host, port):
                try:
                    socket.create_connection((host, port), timeout=3).close()
                    return "connected"
                except OSError as e:
                    return type(e).__name__
            def resolve(name):
                try:
                    return socket.getaddrinfo(name, 80)[0][4][0]
                except OSError as e:
                    return type(e).__name__
            body = json.dumps({{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
            headers = {{"Authorization": "Bearer {key}", "Content-Type": "application/json"}}
            req = urllib.request.Request("{endpoint.base_url}/chat/completions", data=body, headers=headers)
            chat = urllib.request.urlopen(req, timeout=30).status
            try:
                admin = urllib.request.urlopen(urllib.request.Request(
                    "{endpoint.base_url.removesuffix('/v1')}/admin/sessions", data=b"{{}}",
                    headers={{"Authorization": "Bearer {proxy.admin_token}"}}), timeout=5).status
            except urllib.error.HTTPError as e:
                admin = e.code
            print(json.dumps({{"chat": chat, "admin_via_proxy_port": admin,
                              "admin_port": connect("127.0.0.1", {proxy.admin_port}),
                              "other_port": connect("127.0.0.1", {other.getsockname()[1]}),
                              "internet": connect("1.1.1.1", 53), "dns": resolve("example.com")}}))
        """)
        assert out["chat"] == 200
        assert out["admin_via_proxy_port"] == 404  # the agents' listener serves no admin route
        assert out["admin_port"] == "ConnectionRefusedError"
        assert out["other_port"] == "ConnectionRefusedError"
        assert out["internet"] == "OSError"  # ENETUNREACH: nothing but lo in the container
        assert out["dns"] == "gaierror"
        trace = proxy.close_session(session_id)
        assert [t.status for t in trace.turns] == ["ok"]  # the call went through the forwarder, recorded
        assert proxy.store.live_sessions == 0
    finally:
        other.close()
        await sb.close()


async def test_fork_bomb_is_bounded(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root, max_processes=64).create("bomb", {})
    try:
        out = await _py(sb, """
            import json, os, time
            children = 0
            try:
                for _ in range(10_000):
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                    children += 1
                error = None
            except OSError as e:
                error = e.errno
            print(json.dumps({"children": children, "errno": error}))
        """)
        assert out["errno"] == 11 and out["children"] < 64, out  # EAGAIN at pids.max
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 3", 15)
        assert r.returncode is not None
        assert (await asyncio.create_subprocess_exec("true")).pid > 0
    finally:
        await sb.close()
    assert sb.list_processes() == []


async def test_disk_fill_is_stopped_and_tmp_is_bounded(sandbox_root: Path) -> None:
    limit = 64 << 20
    sb = await _backend(sandbox_root, disk_bytes=limit, disk_poll_s=0.05, file_size_bytes=8 << 20,
                        tmp_bytes=4 << 20).create("disk", {})
    try:
        tmp = await sb.exec("head -c 8388608 /dev/zero > /tmp/fill; head -c 8388608 /dev/zero > /dev/shm/fill; "
                            "ls -l /tmp/fill /dev/shm/fill", 60)
        sizes = [int(line.split()[4]) for line in tmp.stdout.splitlines()]
        assert len(sizes) == 2 and all(s <= 4 << 20 for s in sizes), tmp
        assert "No space left on device" in tmp.stderr
        r = await sb.exec("for i in $(seq 256); do head -c 8388608 /dev/zero > f$i; sleep 0.01; done; echo finished",
                          120)
        assert "finished" not in r.stdout and sb.disk_exceeded, r
        from harnessrl.sandbox.local import disk_usage

        assert disk_usage(sb.root) < 8 * limit
        with pytest.raises(SandboxError, match="disk_bytes"):
            await sb.exec("true", 5)
    finally:
        await sb.close()


async def test_setsid_daemon_does_not_outlive_its_command_or_close(sandbox_root: Path) -> None:
    sb = await _backend(sandbox_root).create("daemon", {})
    token = f"{secrets.randbelow(10**6) + 10**6}.4545"  # unique to this run
    try:
        # an exec'd command that leaves a daemon (no marker, cwd /, new session) behind
        r = await sb.exec(f"env -i setsid sh -c 'cd /; exec sleep {token}' & sleep 0.5; echo left", 30)
        assert r.stdout.strip() == "left"
        assert _daemons(token) == []  # the container ended with its command
        await sb.spawn(["bash", "-c", f"env -i setsid sh -c 'cd /; exec sleep {token}' & sleep 60"])
        for _ in range(200):
            if _daemons(token):
                break
            await asyncio.sleep(0.05)
        daemons = _daemons(token)
        assert daemons, "the daemon did not start"
        assert all("HARNESSRL_SANDBOX_ID" not in p.environ() for p in daemons)
    finally:
        await sb.close()
    assert _daemons(token) == []


def _daemons(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["cmdline"] == ["sleep", token] and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


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


@pytest.mark.e2e
@pytest.mark.agents
def test_harnessrl_rollout_runs_mini_swe_agent_in_containers(tmp_path: Path, sandbox_root: Path) -> None:
    """`harnessrl rollout` with `sandbox.kind = "podman"`: mini-swe-agent (its install tree
    bound read-only) runs in a container and reaches the proxy through the forwarder."""
    from harnessrl.config import load_config
    from harnessrl.harness.install import agent_executable
    from harnessrl.rollout.evaluate import run_evaluation

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
