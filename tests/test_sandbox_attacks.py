"""Attacks from inside real sandboxes, as a hostile agent would run them, against every backend.

Each case runs the attack as a command in a real sandbox of each kit of `sandbox_kits.py`:
`bwrap` (a `LocalSandbox` under bubblewrap) and `podman` (a `PodmanSandbox`, one container per
command), with the real proxy behind its agent socket and a FakeEngine, and asserts it fails,
with the harm checked from the host side where there is any: no capability (CapEff 0),
`open_by_handle_at` refused, a read-only bind cannot be remounted or written, another
sandbox's files, processes and key unreachable, the admin API and every other host loopback
port unreachable, no DNS, a fork bomb bounded by the pids cgroup, a disk fill stopped by the
watchdog and `/tmp` bounded, a `setsid` daemon that cleared its environment gone after
`close()` (also for a local sandbox without bubblewrap, `plain`), and the proxy reachable
through the endpoint the sandbox gives the agent. Expectations that truly differ (uid, how
many pids an agent sees, which system mount is read-only) are the kit's.

The bwrap cases skip only where bubblewrap is absent (CI installs it); the podman cases skip
where podman cannot run, and fail instead under `HARNESSRL_REQUIRE_PODMAN=1` (`.ci/run`).
Cases bounded by a pids cgroup skip where the local kits have no writable one.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import stat
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.sandbox.base import Sandbox
from harnessrl.sandbox.hostdir import disk_usage
from sandbox_kits import KITS, Kit, assert_no_podman_leftovers, kit_available


@pytest.fixture
async def proxy(tokenizer) -> AsyncIterator[ProxyServer]:
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0, sampling=SamplingConfig(max_tokens=8))) as server:
        yield server


@pytest.fixture(params=["bwrap", "podman"])
def kit(request: pytest.FixtureRequest) -> Iterator[Kit]:
    """The backend under attack; a podman case also checks no container outlived it."""
    kit_available(request.param)
    yield KITS[request.param]
    if request.param == "podman":
        assert_no_podman_leftovers()


def _chat_call(base_url: str, key: str) -> str:
    """Python lines for `_py`, unindented: one chat call to the proxy at `base_url` with `key`
    from inside a sandbox; `status` is its HTTP status."""
    return textwrap.dedent(f"""
        import json, urllib.request
        body = json.dumps({{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
        req = urllib.request.Request("{base_url}/chat/completions", data=body,
                                     headers={{"Authorization": "Bearer {key}", "Content-Type": "application/json"}})
        status = urllib.request.urlopen(req, timeout=30).status
    """)


async def _py(sandbox: Sandbox, code: str, timeout_s: float = 60.0) -> dict:
    """Run `code` with the sandbox's python3; it prints one JSON object, returned here."""
    result = await sandbox.exec(["python3", "-c", textwrap.dedent(code)], timeout_s)
    assert result.returncode == 0, result
    return json.loads(result.stdout.strip().splitlines()[-1])


async def test_no_capability_and_unprivileged_user(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root).create("caps", {})
    try:
        out = await _py(sb, """
            import json, os
            caps = dict(l.split(":\\t") for l in open("/proc/self/status").read().splitlines() if l.startswith("Cap"))
            nnp = [l for l in open("/proc/self/status").read().splitlines() if l.startswith("NoNewPrivs")]
            print(json.dumps({"caps": {k: int(v, 16) for k, v in caps.items()}, "uid": os.getuid(), "nnp": nnp}))
        """)
        assert out["caps"] == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}
        assert out["uid"] != 0 and (kit.uid is None or out["uid"] == kit.uid), out
        assert out["nnp"] == ["NoNewPrivs:\t1"], out
    finally:
        await sb.close()


async def test_open_by_handle_at_is_refused(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root).create("handle", {})
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


async def test_read_only_binds_stay_read_only(kit: Kit, sandbox_root: Path, tmp_path: Path) -> None:
    tree = tmp_path / "agent-tree"
    tree.mkdir()
    (tree / "cli.js").write_text("original\n")
    sb = await kit.backend(sandbox_root, ro_binds=(tree,)).create("ro", {})
    try:
        inner = sb.tree_path(tree)  # where the sandbox mounts it (not its host path)
        attack = (f"cat {inner}/cli.js; mount -o remount,rw {inner}; mount -o remount,rw /usr; "
                  f"unshare -rm sh -c 'mount -o remount,rw {inner}'; "
                  f"echo changed > {inner}/cli.js; touch /usr/owned; touch /owned; touch {sandbox_root}/owned; "
                  f"grep -E ' {inner} | {kit.ro_system} ' /proc/self/mounts")
        r = await sb.exec(attack, 60)
        assert r.stdout.startswith("original\n"), r
        assert (tree / "cli.js").read_text() == "original\n"
        assert not Path("/usr/owned").exists() and not (sandbox_root / "owned").exists()
        mounts = [line.split() for line in r.stdout.splitlines()[1:]]
        assert len(mounts) == 2 and all(m[3].startswith("ro") for m in mounts), r.stdout
        assert "Read-only file system" in r.stderr, r.stderr
        # the next command starts from an unchanged system tree
        assert (await sb.exec("test ! -e /owned && test ! -e /usr/owned", 30)).returncode == 0
    finally:
        await sb.close()


async def test_other_sandboxes_files_processes_and_keys_unreachable(kit: Kit, sandbox_root: Path) -> None:
    backend = kit.backend(sandbox_root)
    victim = await backend.create("victim", {"secret.txt": "victim-file-secret"})
    attacker = await backend.create("attacker", {})
    key = "sk-victim-0123456789abcdef"
    try:
        agent = await victim.spawn(["sleep", "60"], env={"OPENAI_API_KEY": key})
        for _ in range(200):
            if victim.list_processes():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        out = await _py(attacker, f"""
            import ctypes, glob, json, os
            libc = ctypes.CDLL(None, use_errno=True)
            # try to uncover the host's view first: detach what hides the other sandboxes
            unmounted = libc.umount2(b"{sandbox_root}", 2)
            found, listed = [], []
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
            print(json.dumps({{"found": found, "listed": listed, "text": text, "pids": pids, "unmounted": unmounted}}))
        """)
        assert out["unmounted"] == -1
        assert out["found"] == []
        assert out["listed"] == [attacker.root.name]  # only its own directory under the sandbox root
        assert "victim-file-secret" not in out["text"]
        # bwrap: its init and python; podman: python (+ its /proc read)
        assert str(agent.pid) not in out["pids"] and len(out["pids"]) <= kit.max_pids, out["pids"]
        assert (victim.workdir / "secret.txt").read_text() == "victim-file-secret"
    finally:
        await attacker.close()
        await victim.close()


async def test_only_the_proxy_is_reachable(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    other = socket.create_server(("127.0.0.1", 0))  # a host loopback service that is not the proxy
    sb = await kit.backend(sandbox_root, proxy).create("net", {})
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
        assert out["internet"] == "OSError"  # ENETUNREACH: nothing but lo in the namespace
        assert out["dns"] == "gaierror"
        trace = proxy.close_session(session_id)
        assert [t.status for t in trace.turns] == ["ok"]  # the call went through the forwarder, recorded
        assert proxy.store.live_sessions == 0  # the admin token did not open a session from inside
    finally:
        other.close()
        await sb.close()


async def test_no_proxy_route_once_the_agent_phase_is_over(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    """After `kill_processes` (the runner's step before verification) the sandbox's commands,
    the submission's run by the verifier among them, reach no proxy: not even with a key whose
    session is still open (before: the verifier's commands kept the agent's route)."""
    sb = await kit.backend(sandbox_root, proxy).create("route", {})
    session_id, key = proxy.open_session("route")
    endpoint = sb.agent_endpoint(proxy.endpoint(key))
    probe = f"""
        import json, socket
        try:
            socket.create_connection(("127.0.0.1", {proxy.port}), timeout=3).close()
            reached = "connected"
        except OSError as e:
            reached = type(e).__name__
        print(json.dumps({{"proxy_port": reached}}))
    """
    try:
        assert (await _py(sb, probe))["proxy_port"] == "connected"  # the agent phase: the forwarder
        assert (await _py(sb, _chat_call(endpoint.base_url, key) + "print(json.dumps({'status': status}))"))[
            "status"] == 200
        await sb.kill_processes()
        assert (await _py(sb, probe))["proxy_port"] == "ConnectionRefusedError"  # nothing listens there now
        trace = proxy.close_session(session_id)
        assert [t.status for t in trace.turns] == ["ok"]  # the one call of the agent phase
    finally:
        await sb.close()


async def test_fork_bomb_is_bounded(kit: Kit, sandbox_root: Path) -> None:
    if not kit.cgroup_bounded:
        pytest.skip("no writable pids cgroup on this machine")
    sb = await kit.backend(sandbox_root, max_processes=64).create("bomb", {})
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
        # a shell fork bomb for a few seconds: bounded, and the host keeps forking
        r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 3", 15)
        assert r.returncode is not None
        assert (await asyncio.create_subprocess_exec("true")).pid > 0
    finally:
        await sb.close()
    assert sb.list_processes() == []


async def test_disk_fill_is_stopped_and_tmp_is_bounded(kit: Kit, sandbox_root: Path) -> None:
    limit = 64 << 20
    sb = await kit.backend(sandbox_root, disk_bytes=limit, disk_poll_s=0.05, file_size_bytes=8 << 20,
                           tmp_bytes=4 << 20).create("disk", {})
    try:
        tmp = await sb.exec("head -c 8388608 /dev/zero > /tmp/fill; head -c 8388608 /dev/zero > /dev/shm/fill; "
                            "ls -l /tmp/fill /dev/shm/fill", 60)
        sizes = [int(line.split()[4]) for line in tmp.stdout.splitlines()]
        assert len(sizes) == 2 and all(s <= 4 << 20 for s in sizes), tmp
        assert "No space left on device" in tmp.stderr
        # many files, each under the per-file limit: 2 GiB if nothing stopped it
        r = await sb.exec("for i in $(seq 256); do head -c 8388608 /dev/zero > f$i; sleep 0.01; done; echo finished",
                          120)
        assert "finished" not in r.stdout and sb.disk_exceeded, r
        assert disk_usage(sb.root) < kit.disk_overshoot * limit
        with pytest.raises(Exception, match="disk_bytes"):
            await sb.exec("true", 5)
    finally:
        await sb.close()


@pytest.mark.parametrize("kit", ["bwrap", "plain", "podman"], indirect=True)
async def test_setsid_daemon_does_not_outlive_its_command_or_close(kit: Kit, sandbox_root: Path) -> None:
    if not kit.namespaced and not kit.cgroup_bounded:
        pytest.skip("without bubblewrap only the pids cgroup catches a daemon that left every marker")
    sb = await kit.backend(sandbox_root).create("daemon", {})
    token = f"{secrets.randbelow(10**6) + 10**6}.{4242 + list(KITS).index(kit.name)}"  # unique to this run
    try:
        if kit.namespaced:
            # an exec'd command that leaves a daemon (no marker, cwd /, new session) behind
            r = await sb.exec(f"env -i setsid sh -c 'cd /; exec sleep {token}' & sleep 0.5; echo left", 30)
            assert r.stdout.strip() == "left"
            assert _daemons(token) == []  # its namespace ended with the command
        # clears its environment (no marker), leaves the sandbox directory and its session
        await sb.spawn(["bash", "-c", f"env -i setsid sh -c 'cd /; exec sleep {token}' & sleep 60"])
        for _ in range(200):
            if _daemons(token):
                break
            await asyncio.sleep(0.05)
        daemons = _daemons(token)
        assert daemons, "the daemon did not start"
        assert all(p.cwd() == "/" and "HARNESSRL_SANDBOX_ID" not in p.environ() for p in daemons)
    finally:
        await sb.close()
    assert _daemons(token) == []


def _daemons(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["cmdline"] == ["sleep", token] and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


# --- the unprivileged owner, the syscall filter and every resource bounded (issue 32) ---------

def _stat(path: str) -> tuple[int, int, float]:
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_mtime


@pytest.mark.parametrize("kit", ["bwrap"], indirect=True)
async def test_root_only_host_files_are_unreadable(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root).create("shadow", {})
    try:
        r = await sb.exec("cat /etc/shadow; cat /etc/gshadow; echo done", 30)
        assert r.stdout.strip() == "done", r  # nothing of either file
        assert r.stderr.count("Permission denied") == 2, r
    finally:
        await sb.close()


async def test_host_device_nodes_cannot_be_changed(kit: Kit, sandbox_root: Path) -> None:
    before = {d: _stat(d) for d in ("/dev/null", "/dev/zero", "/dev/urandom")}
    sb = await kit.backend(sandbox_root).create("devices", {})
    try:
        r = await sb.exec("for d in /dev/null /dev/zero /dev/urandom; do chmod 600 $d; touch -d @1 $d; touch $d; "
                          "done; echo x > /dev/null && echo written", 30)
        assert r.stdout.strip() == "written", r  # still usable
        assert {d: _stat(d) for d in before} == before, r
    finally:
        await sb.close()
        for d, (mode, _, _) in before.items():  # put the host back should the attack have worked
            os.chmod(d, stat.S_IMODE(mode))


FIND_SOCKET = ('s=/run/harnessrl/proxy.sock; [ -S "$s" ] || for f in /proc/[0-9]*/fd/*; do '
               '[ -S "$f" ] && [ "$(readlink "$f")" = / ] && s=$f; done; ')
"""Shell: set `$s` to the proxy socket as the agent reaches it: bound at /run/harnessrl/proxy.sock,
or (bubblewrap as root) the forwarder's descriptor of it, whose link reads `/`."""


async def test_proxy_socket_cannot_be_changed_by_an_agent(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    socket_path = str(proxy.agent_socket_path)
    backend = kit.backend(sandbox_root, proxy)
    before = _stat(socket_path)
    attacker = await backend.create("chmod-sock", {})
    try:
        r = await attacker.exec(FIND_SOCKET + 'chmod 000 "$s"; touch -d @12345 "$s"; sleep 1.1; touch "$s"; '
                                'stat -L -c "%F %a" "$s"', 30)
        assert r.stdout.strip().splitlines()[-1].startswith("socket "), r  # it reached the socket
        assert _stat(socket_path) == before, r
        # the next rollout still reaches the proxy
        sibling = await backend.create("sibling", {})
        session_id, key = proxy.open_session("sibling")
        endpoint = sibling.agent_endpoint(proxy.endpoint(key))
        try:
            out = await _py(sibling, _chat_call(endpoint.base_url, key) + 'print(json.dumps({"status": status}))')
            assert out["status"] == 200
            proxy.close_session(session_id)
        finally:
            await sibling.close()
    finally:
        await attacker.close()
        os.chmod(socket_path, stat.S_IMODE(before[0]))


async def test_setuid_files_are_stripped_before_the_host_touches_them(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root).create("suid", {})
    try:
        r = await sb.exec("cp /usr/bin/id suid && chmod 6755 suid && mkdir -p d && cp /usr/bin/id d/sgid && "
                          "chmod 2755 d/sgid && stat -c %a suid d/sgid", 30)
        assert r.stdout.split() == ["6755", "2755"], r
        await sb.kill_processes()  # what a verifier does before it reads or runs anything
        for rel in ("suid", "d/sgid"):
            st = os.stat(sb.workdir / rel)
            assert st.st_mode & (stat.S_ISUID | stat.S_ISGID) == 0, (rel, oct(st.st_mode))
            assert st.st_uid != 0, rel  # never a root-owned file
    finally:
        await sb.close()


async def test_disk_watchdog_counts_past_path_max(kit: Kit, sandbox_root: Path) -> None:
    limit = 32 << 20
    sb = await kit.backend(sandbox_root, disk_bytes=limit, disk_poll_s=0.05).create("deepfill", {})
    try:
        r = await sb.exec(["python3", "-c", textwrap.dedent("""
            import os, time
            for _ in range(40):  # 40 x 201 bytes: far past PATH_MAX (4096)
                os.mkdir("d" * 200)
                os.chdir("d" * 200)
            for i in range(32):  # 128 MiB if nothing stops it
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                time.sleep(0.05)
            print("finished")
        """)], 120)
        assert "finished" not in r.stdout and sb.disk_exceeded, r
    finally:
        await sb.close()


async def test_inodes_are_bounded(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root, disk_inodes=2000, disk_poll_s=0.05).create("inodes", {})
    try:
        r = await sb.exec(["python3", "-c", textwrap.dedent("""
            import os, time
            for i in range(40):
                for j in range(500):  # 20,000 empty files: no block, every one an inode
                    open(f"f{i}-{j}", "w").close()
                time.sleep(0.02)
            print("finished")
        """)], 120)
        assert "finished" not in r.stdout and sb.disk_exceeded, r
    finally:
        await sb.close()


async def test_teardown_removes_any_depth(kit: Kit, sandbox_root: Path) -> None:
    # no watchdog: it would kill a chain deeper than MAX_WALK_DEPTH before it is built
    sb = await kit.backend(sandbox_root, disk_bytes=None, disk_inodes=None).create("deep", {})
    r = await sb.exec(["python3", "-c", "import os\nfor _ in range(1500):\n    os.mkdir('d'); os.chdir('d')\n"
                       "open('leaf', 'w').close()\nprint('built')"], 120)
    assert r.stdout.strip() == "built", r
    state = getattr(sb, "_state", None)
    await sb.close()
    assert not sb.root.exists()
    if state is not None:
        assert not state.exists()  # podman's state directory (its .env files) goes too
    assert list(Path("/sys/fs/cgroup").glob(f"*/harnessrl*/{sb.sandbox_id}")) == []


async def test_no_nested_user_namespace(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root).create("userns", {})
    try:
        out = await _py(sb, """
            import ctypes, json, os
            libc = ctypes.CDLL(None, use_errno=True)
            pid = os.fork()
            if pid == 0:
                os._exit(0 if libc.unshare(0x10000000) == 0 else 1)  # CLONE_NEWUSER
            unshared = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            print(json.dumps({"unshared": unshared}))
        """)
        assert out["unshared"] is False
        r = await sb.exec("unshare -U -r true && echo nested", 30)
        assert "nested" not in r.stdout, r
    finally:
        await sb.close()


@pytest.mark.parametrize("kit", ["bwrap"], indirect=True)
async def test_seccomp_refuses_kernel_surface(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root, proxy).create("seccomp", {})
    try:
        out = await _py(sb, """
            import ctypes, json, os, platform
            libc = ctypes.CDLL(None, use_errno=True)
            x86 = platform.machine() == "x86_64"
            nr = dict(keyctl=250, add_key=248, request_key=249, perf_event_open=298, userfaultfd=323, bpf=321,
                      io_uring_setup=425, ptrace=101) if x86 else dict(keyctl=219, add_key=217, request_key=218,
                      perf_event_open=241, userfaultfd=282, bpf=280, io_uring_setup=425, ptrace=117)
            libc.syscall.restype = ctypes.c_long
            def call(name, *args):
                ctypes.set_errno(0)
                r = libc.syscall(nr[name], *[ctypes.c_long(a) for a in args])
                return [r, ctypes.get_errno()]
            attr = (ctypes.c_ubyte * 128)()
            ctypes.c_uint32.from_buffer(attr, 4).value = 128  # perf_event_attr.size; type 1 = software
            ctypes.c_uint32.from_buffer(attr, 0).value = 1
            params = (ctypes.c_ubyte * 120)()
            forwarder = os.getppid()  # the proxy forwarder runs this command as its child
            print(json.dumps({
                "keyctl": call("keyctl", 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
                "add_key": call("add_key", ctypes.addressof(ctypes.create_string_buffer(b"user")),
                                ctypes.addressof(ctypes.create_string_buffer(b"x")), 0, 0, -3),
                "perf_event_open": call("perf_event_open", ctypes.addressof(attr), 0, -1, -1, 0),
                "userfaultfd": call("userfaultfd", 0),
                "io_uring_setup": call("io_uring_setup", 4, ctypes.addressof(params)),
                "bpf": call("bpf", 0, 0, 0),
                "ptrace": call("ptrace", 16, forwarder, 0, 0),  # PTRACE_ATTACH
            }))
        """)
        assert all(r == [-1, 1] for r in out.values()), out  # every one EPERM
    finally:
        await sb.close()


@pytest.mark.parametrize("kit", ["bwrap"], indirect=True)
async def test_inotify_instances_are_not_host_roots(kit: Kit, sandbox_root: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sb = await kit.backend(sandbox_root).create("inotify", {})
    try:
        agent = await sb.spawn(["python3", "-c", textwrap.dedent("""
            import ctypes, time
            libc = ctypes.CDLL(None, use_errno=True)
            fds = []
            while len(fds) < 100_000 and (fd := libc.inotify_init1(0)) >= 0:
                fds.append(fd)
            open("taken", "w").write(str(len(fds)))
            time.sleep(60)
        """)])
        for _ in range(300):
            if (sb.workdir / "taken").exists() and (sb.workdir / "taken").read_text():
                break
            await asyncio.sleep(0.05)
        assert int((sb.workdir / "taken").read_text()) > 0
        fd = libc.inotify_init1(0)
        assert fd >= 0, f"host root's inotify_init1 failed: errno {ctypes.get_errno()}"
        os.close(fd)
        await agent.kill_tree()
    finally:
        await sb.close()


async def test_no_lock_channel_between_sandboxes(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    backend = kit.backend(sandbox_root, proxy)
    sender = await backend.create("sender", {})
    receiver = await backend.create("receiver", {})
    shared = ["/run/harnessrl/forward.py", "/usr/bin/python3"]
    try:
        await sender.spawn(["python3", "-c", textwrap.dedent(f"""
            import fcntl, time
            held = []
            for path in {shared!r}:
                f = open(path, "rb")
                fcntl.flock(f, fcntl.LOCK_EX)
                fcntl.lockf(f, fcntl.LOCK_SH)
                held.append(f)
            open("locked", "w").close()
            time.sleep(60)
        """)])
        for _ in range(300):
            if (sender.workdir / "locked").exists():
                break
            await asyncio.sleep(0.05)
        assert (sender.workdir / "locked").exists()
        out = await _py(receiver, f"""
            import fcntl, json
            seen = {{}}
            for path in {shared!r}:
                f = open(path, "rb")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    seen[path] = "free"
                except OSError:
                    seen[path] = "locked"
            print(json.dumps(seen))
        """)
        assert set(out.values()) == {"free"}, out  # the sender's locks carry nothing across
    finally:
        await receiver.close()
        await sender.close()


@pytest.mark.parametrize("kit", ["bwrap"], indirect=True)
async def test_agent_memory_is_bounded(kit: Kit, sandbox_root: Path) -> None:
    sb = await kit.backend(sandbox_root, memory_bytes=64 << 20).create("memory", {})
    try:
        agent = await sb.spawn(["python3", "-c", "b = bytearray(512 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
                                "open('survived', 'w').close()"])
        code = await agent.wait(60)
        assert code is not None and code != 0, code  # OOM-killed
        assert not (sb.workdir / "survived").exists()
    finally:
        await sb.close()


# --- cross-sandbox channels, host paths in the mount table, descriptor floods (issue 32) ----


CHANNEL_RECEIVER = textwrap.dedent("""
    import ctypes, fcntl, json, os, struct, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    paths = sys.argv[1:]
    fd = libc.inotify_init1(os.O_NONBLOCK)
    assert fd >= 0, ctypes.get_errno()
    for path in paths:
        assert libc.inotify_add_watch(fd, path.encode(), 0xFFF) > 0, (path, ctypes.get_errno())

    def drain():
        n = 0
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return n
            while data:
                length = struct.unpack_from("iIII", data)[3]
                data = data[16 + length:]
                n += 1

    for path in paths:  # the watches are live: our own opens are seen
        if os.path.isfile(path):
            open(path, "rb").read()
    probe = open(paths[0], "rb")  # opened once: the probes below make no event of their own
    time.sleep(0.2)
    own = drain()
    open("ready", "w").close()
    seen, locked = 0, 0
    deadline = time.monotonic() + float(os.environ["WINDOW_S"])
    while time.monotonic() < deadline:
        seen += drain()
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_UN)
        except OSError:
            locked += 1
        time.sleep(0.02)
    seen += drain()
    with open("seen.tmp", "w") as out:
        json.dump({"own": own, "seen": seen, "locked": locked}, out)
    os.rename("seen.tmp", "seen.json")
""")

CHANNEL_SENDER = textwrap.dedent("""
    import fcntl, json, os, sys, time
    paths = sys.argv[1:]
    held = open(paths[0], "rb")
    fcntl.flock(held, fcntl.LOCK_EX)  # one bit: the lock is held for the whole window
    sent, deadline = 0, time.monotonic() + float(os.environ["WINDOW_S"])
    while time.monotonic() < deadline:  # the other bits: opens and reads of every shared file
        for path in paths:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(64)
            sent += 1
        time.sleep(0.005)
    print(json.dumps({"sent": sent}))
""")


async def test_no_inotify_or_lock_channel_through_shared_files(kit: Kit, sandbox_root: Path, tmp_path: Path) -> None:
    """Two concurrent sandboxes share an agent tree and the system files: the receiver
    watches them with inotify and probes a flock, the sender holds that flock and opens and
    reads every one of them; no event and no lock crosses."""
    tree = tmp_path / "agent-tree"
    (tree / "lib").mkdir(parents=True)
    (tree / "cli.js").write_text("agent\n")
    (tree / "lib" / "mod.js").write_text("module\n")
    backend = kit.backend(sandbox_root, ro_binds=(tree,))
    receiver = await backend.create("receiver", {})
    sender = await backend.create("sender", {})
    shared = [receiver.tree_path(tree / "cli.js"), receiver.tree_path(tree / "lib"),
              receiver.tree_path(tree / "lib" / "mod.js"), "/etc/passwd", "/usr/bin/env", "/dev/null"]
    window = {"WINDOW_S": "4"}
    try:
        watcher = await receiver.spawn(["python3", "-c", CHANNEL_RECEIVER, *shared], env=window)
        for _ in range(600):
            if (receiver.workdir / "ready").exists():
                break
            await asyncio.sleep(0.05)
        assert (receiver.workdir / "ready").exists(), "the receiver did not start"
        r = await sender.exec(["python3", "-c", CHANNEL_SENDER, *shared], 60, env=window)
        assert r.returncode == 0 and json.loads(r.stdout)["sent"] > 100, r
        assert await watcher.wait(60) == 0
        seen = json.loads((receiver.workdir / "seen.json").read_text())
        assert seen["own"] > 0, seen  # its watches work: it saw its own opens
        assert seen["seen"] == 0 and seen["locked"] == 0, seen  # nothing of the sender crossed
    finally:
        await sender.close()
        await receiver.close()


def _mountinfo(text: str) -> list[dict[str, str]]:
    rows = []
    for line in text.splitlines():
        fields = line.split()
        sep = fields.index("-")
        rows.append({"root": fields[3], "point": fields[4], "fstype": fields[sep + 1],
                     "source": fields[sep + 2], "options": fields[sep + 3] if len(fields) > sep + 3 else ""})
    return rows


async def test_mount_table_names_no_host_source(kit: Kit, proxy: ProxyServer, sandbox_root: Path,
                                                tmp_path: Path) -> None:
    """What is bound into a sandbox from the host (system directories, agent trees, device
    nodes, the forwarder) shows in /proc/self/mountinfo by no host path: not the checkout, not
    the sandbox root, not harnessrl's cache or an agent tree's path. Left out here (the last
    test of the four shows they still do): the sandbox directory (bound at its own path), and
    under podman its own mounts (the image's overlay in harnessrl's podman store, the files it
    writes per container)."""
    import harnessrl

    checkout = str(Path(harnessrl.__file__).resolve().parents[1])
    tree = tmp_path / "cache" / "agents" / "tool"
    tree.mkdir(parents=True)
    (tree / "bin").write_text("#!/bin/sh\n")
    sb = await kit.backend(sandbox_root, proxy, ro_binds=(tree,)).create("mountinfo", {})
    try:
        r = await sb.exec("cat /proc/self/mountinfo", 30)
        assert r.returncode == 0 and "/run/harnessrl" in r.stdout, r
        assert checkout not in r.stdout, r.stdout
        rows = _mountinfo(r.stdout)
        assert [row["point"] for row in rows].count("/run/harnessrl/agents/tool") == 1, r.stdout
        secret = [checkout, str(sandbox_root), str(tmp_path / "cache"), str(Path.home() / ".cache")]
        known_open = {str(sb.root), str(sandbox_root), "/run/harnessrl/proxy.sock"}
        if kit.name == "podman":  # podman's own: the image's overlay in its store, the files it writes per container
            known_open |= {"/", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf", "/etc/passwd", "/etc/group",
                           "/run/.containerenv"}
        named = [row for row in rows if row["point"] not in known_open
                 and any(s in row["root"] or s in row["options"] for s in secret)]
        assert named == [], named
    finally:
        await sb.close()


async def test_agent_trees_are_mounted_at_neutral_paths(kit: Kit, proxy: ProxyServer, sandbox_root: Path,
                                                        tmp_path: Path) -> None:
    """An agent tree is mounted at /run/harnessrl/agents/<its name>, not at its host path under
    harnessrl's cache: no mount point, root or option of the mount table names the cache, and
    `tree_path` gives where a file of the tree is inside (a second tree of the same name gets
    `-2`)."""
    tree = tmp_path / "cache" / "agents" / "tool"
    other = tmp_path / "cache" / "other" / "tool"
    for t in (tree, other):
        t.mkdir(parents=True)
        (t / "which").write_text(f"{t.parent.name}\n")
    sb = await kit.backend(sandbox_root, proxy, ro_binds=(tree, other)).create("mountinfo", {})
    try:
        inner = sb.tree_path(tree / "which")
        assert (inner, sb.tree_path(other / "which")) == (
            "/run/harnessrl/agents/tool/which", "/run/harnessrl/agents/tool-2/which")
        assert sb.tree_path(Path("/usr/bin/env")) == "/usr/bin/env"  # not under a tree: unchanged
        r = await sb.exec(f"cat {inner} /run/harnessrl/agents/tool-2/which /proc/self/mountinfo", 30)
        assert r.returncode == 0 and r.stdout.startswith("agents\nother\n"), r
        assert str(tmp_path / "cache") not in r.stdout, r.stdout
    finally:
        await sb.close()


async def test_mount_table_names_no_proxy_socket_path(kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    """The forwarder reaches the proxy socket through a descriptor of a detached read-only
    bind (`layers.detached_handle`: made per command under bubblewrap as root, per sandbox and
    passed as descriptor 3 under podman), so no mount shows the socket's host path (a bind's
    root field would) and the descriptor's link reads `/`; agents still reach the proxy."""
    backend = kit.backend(sandbox_root, proxy)
    if kit.name == "bwrap" and backend.layers_problem is not None:
        pytest.skip(f"the socket's descriptor needs bubblewrap as root with overlays: {backend.layers_problem}")
    sb = await backend.create("socket-path", {})
    session_id, key = proxy.open_session("socket-path")
    endpoint = sb.agent_endpoint(proxy.endpoint(key))
    try:
        out = await _py(sb, _chat_call(endpoint.base_url, key) + textwrap.dedent("""
            import os
            links = []
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                try:
                    links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                except OSError:
                    pass
            print(json.dumps({"status": status, "mountinfo": open("/proc/self/mountinfo").read(), "links": links}))
        """))
        assert out["status"] == 200
        socket_dir = str(proxy.agent_socket_path.parent)
        assert socket_dir not in out["mountinfo"], out["mountinfo"]
        assert not any(socket_dir in link for link in out["links"]), out["links"]
        proxy.close_session(session_id)
    finally:
        await sb.close()


@pytest.mark.xfail(strict=True, reason="open where bubblewrap and podman allow nothing else: the sandbox directory "
                   "is a bind of a directory of the host's filesystem, and a bind's mountinfo root field is that "
                   "directory's path on its filesystem whatever the mount point (only a filesystem of its own per "
                   "sandbox would hide it; docs/sandboxes.md says why none is used); under podman also its store "
                   "paths (the image overlay's layer options, the files it binds per container)")
async def test_mount_table_names_no_host_path_at_all(kit: Kit, proxy: ProxyServer, sandbox_root: Path,
                                                     tmp_path: Path) -> None:
    tree = tmp_path / "cache" / "agents" / "tool"
    tree.mkdir(parents=True)
    sb = await kit.backend(sandbox_root, proxy, ro_binds=(tree,)).create("mountinfo", {})
    try:
        r = await sb.exec("cat /proc/self/mountinfo", 30)
        assert r.returncode == 0, r
        for host in (str(sandbox_root), str(tmp_path / "cache"), str(proxy.agent_socket_path.parent)):
            assert host not in r.stdout, host
    finally:
        await sb.close()


FLOOD = textwrap.dedent("""
    import json, os, resource, socket, sys, time
    path, procs, each, limit_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    deadline = time.monotonic() + limit_s
    children = []
    for k in range(procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            held, failed = [], 0
            for _ in range(each):
                if time.monotonic() > deadline:
                    break
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(2)
                try:
                    s.connect(path)
                    held.append(s)
                except OSError:
                    failed += 1
                    s.close()
            if k == 0:
                open("flooding", "w").close()
            closed, eof, last, stable = 0, set(), -1, time.monotonic()
            while time.monotonic() - stable < 1.0 and time.monotonic() < deadline:
                for i, s in enumerate(held):  # the proxy closes what is past its caps: EOF
                    if i not in eof:
                        s.setblocking(False)
                        try:
                            if s.recv(1) == b"":
                                eof.add(i)
                        except (BlockingIOError, OSError):
                            pass
                if len(eof) != last:
                    last, stable = len(eof), time.monotonic()
                time.sleep(0.2)
            os.write(w, json.dumps([len(held), failed, len(eof)]).encode())
            while not os.path.exists("release") and time.monotonic() < deadline:
                time.sleep(0.1)  # hold every connection until the test is done
            os._exit(0)
        os.close(w)
        children.append((pid, r))
    totals = [0, 0, 0]
    for pid, r in children:
        got = json.loads(os.read(r, 4096) or b"[0, 0, 0]")
        totals = [a + b for a, b in zip(totals, got)]
    open("counted", "w").close()
    for pid, _ in children:
        os.waitpid(pid, 0)
    print(json.dumps({"opened": totals[0], "failed": totals[1], "closed": totals[2], "soft": soft, "hard": hard}))
""")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_descriptor_flood_from_a_sandbox_spares_the_trainer_and_its_siblings(
        kit: Kit, proxy: ProxyServer, sandbox_root: Path) -> None:
    """An agent tries 20,000 connections straight to the proxy socket (10 processes of 2,000,
    each connect given 2 s, within 45 s): the proxy admits its per-peer cap of them, the
    trainer's descriptors stay below half its limit, and a sibling sandbox's call made during
    the flood is answered and recorded."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    backend = kit.backend(sandbox_root, proxy, max_open_files=2100)  # 2,000 connections a process
    attacker = await backend.create("flood", {})
    sibling = await backend.create("sibling", {})
    session_id, key = proxy.open_session("sibling")
    endpoint = sibling.agent_endpoint(proxy.endpoint(key))
    before, peak_fds, peak_open = _fds(), 0, 0
    try:
        flood = asyncio.ensure_future(attacker.exec(
            ["sh", "-c", FIND_SOCKET + 'exec python3 -c "$0" "$s" 10 2000 45', FLOOD], 120))
        while not flood.done() and not (attacker.workdir / "flooding").exists():
            peak_fds, peak_open = max(peak_fds, _fds()), max(peak_open, proxy.open_connections["total"])
            await asyncio.sleep(0.05)
        call = asyncio.ensure_future(_py(sibling, f"""
            import json, urllib.request
            body = json.dumps({{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
            req = urllib.request.Request("{endpoint.base_url}/chat/completions", data=body,
                                         headers={{"Authorization": "Bearer {key}", "Content-Type": "application/json"}})
            print(json.dumps({{"status": urllib.request.urlopen(req, timeout=60).status}}))
        """))
        while not call.done() or not (flood.done() or (attacker.workdir / "counted").exists()):
            peak_fds, peak_open = max(peak_fds, _fds()), max(peak_open, proxy.open_connections["total"])
            await asyncio.sleep(0.05)
        answered = await call
        attacker.write_file("release", "")
        result = await flood
        assert result.returncode == 0, result
        out = json.loads(result.stdout.strip().splitlines()[-1])
        trace = proxy.close_session(session_id)
    finally:
        await sibling.close()
        await attacker.close()
    assert out["opened"] + out["failed"] >= 15_000, out  # the flood ran
    # the proxy admitted the attacker's per-peer share only (and the sibling's call)
    assert peak_open <= proxy.config.max_connections_per_peer + 4, (peak_open, out)
    # connections past the caps are accepted and closed: in flight a few thousand at most,
    # far below the trainer's limit
    assert peak_fds < soft // 2, (before, peak_fds, soft)
    assert answered["status"] == 200
    assert [t.status for t in trace.turns] == ["ok"]


async def test_descriptor_hog_is_bounded_by_the_sandbox_rlimit(kit: Kit, sandbox_root: Path) -> None:
    """An agent holding eventfds in 8 processes (each in its own session) until refused: each
    stops at `max_open_files` (default 512; the trainer's own RLIMIT_NOFILE was inherited,
    20,000 here, before), cannot raise it, and the sandbox as a whole holds at most
    `max_processes * max_open_files`."""
    sb = await kit.backend(sandbox_root).create("fdhog", {})
    try:
        out = await _py(sb, """
            import json, os, resource
            def hog():
                n = 0
                try:
                    while n < 100_000:
                        os.eventfd(0)
                        n += 1
                except OSError as e:
                    return n, e.errno
                return n, None
            r, w = os.pipe()
            for _ in range(8):
                if os.fork() == 0:
                    os.setsid()
                    n, err = hog()
                    os.write(w, (json.dumps([n, err]) + "\\n").encode())
                    os._exit(0)
            os.close(w)
            lines = os.fdopen(r).read().splitlines()
            got = [json.loads(line) for line in lines]
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (100_000, 100_000))
                raised = True
            except (ValueError, OSError):
                raised = False
            print(json.dumps({"held": got, "limit": resource.getrlimit(resource.RLIMIT_NOFILE), "raised": raised}))
        """)
        nofile = sb.config.max_open_files
        assert nofile == 512  # the default
        assert out["limit"] == [nofile, nofile], out["limit"]
        assert not out["raised"]
        assert all(err == 24 and n <= nofile for n, err in out["held"]), out["held"]  # EMFILE
        total = sum(n for n, _ in out["held"])
        assert total <= 8 * nofile
    finally:
        await sb.close()


def test_run_refuses_sandboxes_that_could_take_the_file_table(sandbox_root: Path) -> None:
    """pids.max * RLIMIT_NOFILE * concurrent sandboxes within half of fs.file-max, checked at start."""
    from harnessrl.errors import SandboxError
    from harnessrl.sandbox.filetable import file_max, file_table_use

    kit_available("bwrap")
    limit = file_max()
    assert limit is not None
    backend = KITS["bwrap"].backend(sandbox_root)
    line, fits = file_table_use(256, 256, 4)
    assert fits and f"{256 * 256 * 4:,}" in line
    if backend.cgroup_root is None:
        pytest.skip("no writable pids cgroup: processes unbounded, only a warning")
    backend.check_isolation("best_effort", concurrency=4)
    too_many = limit // (256 * 256) + 1
    with pytest.raises(SandboxError, match="max_open_files"):
        backend.check_isolation("best_effort", concurrency=too_many)


async def test_busy_loops_in_many_sessions_share_the_sandbox_cpu_quota(kit: Kit, sandbox_root: Path) -> None:
    """8 busy loops, each in its own session, for 2 s of wall time: together they get at most
    the sandbox's `cpus` (0.25 here) of CPU time, so a sibling keeps its share. Under
    bubblewrap they shared the root cpu cgroup before (no quota at all)."""
    if kit.name == "bwrap":
        from harnessrl.sandbox import cgroup

        if cgroup.cpu_available() is None:
            pytest.skip("no writable cpu cgroup on this machine")
    sb = await kit.backend(sandbox_root, cpus=0.25).create("cpuhog", {})
    try:
        out = await _py(sb, """
            import json, os, time
            start = time.monotonic()
            kids = []
            for _ in range(8):
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    end = time.monotonic() + 2.0
                    while time.monotonic() < end:
                        pass
                    os._exit(0)
                kids.append(pid)
            for pid in kids:
                os.waitpid(pid, 0)
            t = os.times()
            print(json.dumps({"cpu_s": t.children_user + t.children_system, "wall_s": time.monotonic() - start}))
        """)
        # at most 0.25 CPU over the wall time (one period of slack); unbounded, 8 loops take
        # every core they are given for 2 s
        assert out["cpu_s"] <= 0.25 * out["wall_s"] + 0.15, out
    finally:
        await sb.close()


async def test_host_wide_proc_figures_do_not_move_with_the_host(kit: Kit, sandbox_root: Path) -> None:
    """A sibling's verifier moves `/proc/sys/fs/file-nr` (its hidden test opens files), the
    load average, `/proc/stat` and `/proc/meminfo`: inside a sandbox they read the same before
    and after the host opens 3,000 files, touches 256 MiB and burns CPU, so no agent reads
    another rollout through them."""
    import time

    masked = ("/proc/loadavg", "/proc/stat", "/proc/meminfo", "/proc/sys/fs/file-nr", "/proc/sys/fs/inode-nr")
    sb = await kit.backend(sandbox_root).create("procfig", {})
    read = f"import json\nprint(json.dumps({{p: open(p).read() for p in {list(masked)!r}}}))"
    held: list[int] = []
    try:
        before = await _py(sb, read)
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(3000)]
        ballast = bytearray(256 << 20)  # 256 MiB touched: the host's free memory moves
        ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        after = await _py(sb, read)
        del ballast
        result = await sb.exec(["sh", "-c", "cat /proc/loadavg; nproc"], 30)
    finally:
        for fd in held:
            os.close(fd)
        await sb.close()
    assert before == after, (before, after)
    assert all(before[p].strip() in ("", "0\t0") or before[p].startswith(("0\t0\t", "0.00 0.00 0.00", "cpu  0 0"))
               for p in masked if p != "/proc/meminfo"), before
    memory = {line.split(":")[0]: line.split()[1] for line in before["/proc/meminfo"].splitlines()}
    assert memory["MemFree"] == memory["MemAvailable"] == memory["MemTotal"] != "0", before["/proc/meminfo"]
    assert memory["Cached"] == memory["Shmem"] == "0", before["/proc/meminfo"]
    assert result.returncode == 0 and result.stdout.startswith("0.00 0.00 0.00"), result


async def test_only_the_allowed_socket_families_open(kit: Kit, sandbox_root: Path) -> None:
    """`socket(AF_VSOCK)` (a way to the host or a hypervisor) and other families an agent never
    needs are refused by the syscall filter; AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (the
    resolver's, `getifaddrs`) still open."""
    sb = await kit.backend(sandbox_root).create("families", {})
    try:
        out = await _py(sb, """
            import json, socket
            got = {}
            for name, fam, kind in (("unix", 1, socket.SOCK_STREAM), ("inet", 2, socket.SOCK_DGRAM),
                                    ("inet6", 10, socket.SOCK_DGRAM), ("netlink", 16, socket.SOCK_RAW),
                                    ("vsock", 40, socket.SOCK_STREAM), ("packet", 17, socket.SOCK_DGRAM),
                                    ("bluetooth", 31, socket.SOCK_STREAM), ("alg", 38, socket.SOCK_SEQPACKET)):
                try:
                    socket.socket(fam, kind).close()
                    got[name] = "ok"
                except OSError as e:
                    got[name] = e.errno
            try:
                socket.socketpair(2, socket.SOCK_STREAM)
                got["pair_inet"] = "ok"
            except OSError as e:
                got["pair_inet"] = e.errno
            socket.socketpair()
            print(json.dumps(got))
        """)
        assert [out[k] for k in ("unix", "inet", "inet6", "netlink")] == ["ok"] * 4, out
        # EAFNOSUPPORT under bubblewrap, the profile's default (ENOSYS) under podman
        assert all(out[k] in (1, 38, 97) for k in ("vsock", "packet", "bluetooth", "alg")), out
        assert out["pair_inet"] != "ok", out
    finally:
        await sb.close()
