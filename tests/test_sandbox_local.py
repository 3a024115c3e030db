"""Adversarial tests of the local sandbox, one property each, with and without bubblewrap."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from harnessrl.errors import SandboxError
from harnessrl.sandbox.base import Sandbox
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import (
    LocalSandbox,
    LocalSandboxBackend,
    SandboxConfig,
    leftover_processes,
    leftover_sandboxes,
)

NO_BWRAP = "bubblewrap is not installed or cannot create namespaces here (apt-get install bubblewrap)"


@pytest.fixture(params=[False, True], ids=["plain", "bwrap"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> LocalSandboxBackend:
    if request.param and bwrap_path() is None:
        pytest.skip(NO_BWRAP)
    return LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=request.param))


@pytest.fixture
def bwrap_backend(tmp_path: Path) -> LocalSandboxBackend:
    if bwrap_path() is None:
        pytest.skip(NO_BWRAP)
    return LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=True))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def test_satisfies_the_sandbox_protocol(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("r0", {})
    assert isinstance(sb, Sandbox)
    await sb.close()


async def test_workspace_is_copied_not_linked(backend: LocalSandboxBackend) -> None:
    template = {"solution.py": "x = 1\n", "pkg/data.txt": "seed"}
    a = await backend.create("a", template)
    b = await backend.create("b", template)
    result = await a.exec("echo changed > solution.py && echo changed > pkg/data.txt", 5)
    assert result.returncode == 0
    assert a.read_file("solution.py") == b"changed\n"
    assert b.read_file("solution.py") == b"x = 1\n"
    assert b.read_file("pkg/data.txt") == b"seed"
    assert template == {"solution.py": "x = 1\n", "pkg/data.txt": "seed"}
    assert os.stat(b.workdir / "solution.py").st_nlink == 1
    await a.close()
    await b.close()


async def test_exec_timeout_kills_whole_group(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("t", {})
    result = await sb.exec("sleep 1000 & sleep 1000", timeout_s=0.5)
    assert result.timed_out
    assert result.returncode == -9
    assert 0.5 <= result.duration_s < 5
    await asyncio.sleep(0.05)
    assert sb.list_processes() == []
    await sb.close()


async def test_background_daemons_gone_after_close(backend: LocalSandboxBackend) -> None:
    root = backend.config.root_dir
    sb = await backend.create("d", {})
    cmd = "setsid sleep 1000 >/dev/null 2>&1 & nohup sleep 1001 >/dev/null 2>&1 & echo started"
    result = await sb.exec(cmd, 5)
    assert result.stdout == "started\n" and not result.timed_out
    if sb.uses_bwrap:
        # The PID namespace ends with the command: its init took the daemons down already.
        assert sb.list_processes() == []
    else:
        assert len(sb.list_processes()) >= 2  # both daemons outlived the command
    await sb.close()
    assert leftover_processes(root) == []
    assert leftover_sandboxes(root) == []


async def test_close_is_idempotent_and_survives_cancellation(backend: LocalSandboxBackend) -> None:
    root = backend.config.root_dir
    sb = await backend.create("c", {})
    running = asyncio.ensure_future(sb.exec("sleep 1000", 100))
    await asyncio.sleep(0.2)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    agent = await sb.spawn(["sleep", "1000"])
    closing = asyncio.ensure_future(sb.close())
    await asyncio.sleep(0)
    closing.cancel()  # the caller gives up; the teardown must still complete
    with pytest.raises(asyncio.CancelledError):
        await closing
    await sb.close()
    await sb.close()
    assert sb.closed and not sb.root.exists()
    assert agent.returncode is not None
    assert leftover_processes(root) == []
    with pytest.raises(SandboxError, match="closed"):
        await sb.exec("true", 1)


async def test_parent_environment_not_inherited(
    backend: LocalSandboxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-parent-secret")
    sb = await backend.create("e", {})
    result = await sb.exec("env", 5, env={"MY_VAR": "given", "HARNESSRL_SANDBOX_ID": "forged"})
    assert "sk-parent-secret" not in result.stdout
    assert "OPENAI_API_KEY" not in result.stdout
    assert "MY_VAR=given\n" in result.stdout
    assert f"HARNESSRL_SANDBOX_ID={sb.sandbox_id}\n" in result.stdout
    assert f"HOME={sb.home}\n" in result.stdout
    await sb.close()


async def test_output_cap_truncates_with_marker(tmp_path: Path) -> None:
    cfg = SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=False, output_cap_bytes=1000)
    sb = await LocalSandboxBackend(cfg).create("o", {})
    result = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a; head -c 10 /dev/zero >&2", 5)
    assert result.stdout.startswith("a" * 1000)
    assert result.stdout[1000:] == "\n[harnessrl: output truncated, 4000 more bytes]\n"
    assert result.stderr == "\0" * 10
    await sb.close()


async def test_rlimit_file_size(backend: LocalSandboxBackend, tmp_path: Path) -> None:
    cfg = backend.config.model_copy(update={"file_size_bytes": 1 << 20})
    sb = await LocalSandboxBackend(cfg).create("f", {})
    result = await sb.exec("head -c 2M /dev/zero > big.bin", 5)
    assert result.returncode != 0
    assert os.path.getsize(sb.workdir / "big.bin") == 1 << 20
    await sb.close()


async def test_rlimit_address_space(tmp_path: Path) -> None:
    cfg = SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=False, address_space_bytes=256 << 20)
    sb = await LocalSandboxBackend(cfg).create("m", {})
    result = await sb.exec(["python3", "-c", "bytearray(1 << 30)"], 10)
    assert result.returncode == 1 and "MemoryError" in result.stderr
    await sb.close()


async def test_file_api_rejects_escaping_paths(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("p", {})
    with pytest.raises(SandboxError, match="escapes"):
        sb.write_file("../outside.txt", "x")
    os.symlink("/etc/hostname", sb.workdir / "link")
    with pytest.raises(SandboxError, match="escapes"):
        sb.read_file("link")
    with pytest.raises(SandboxError, match="escapes"):
        await backend.create("q", {"../../evil.txt": "x"})
    assert not (sb.root / "outside.txt").exists()
    await sb.close()


async def test_missing_program_is_127_not_an_exception(tmp_path: Path) -> None:
    sb = await LocalSandboxBackend(SandboxConfig(root_dir=tmp_path, use_bwrap=False)).create("x", {})
    result = await sb.exec(["/nonexistent/program"], 5)
    assert result.returncode == 127
    await sb.close()


async def test_spawn_logs_and_is_killed_at_close(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("s", {})
    log = sb.home / "agent.log"
    proc = await sb.spawn(["bash", "-c", "echo hello; echo err >&2; exec sleep 1000"], log_file="agent.log")
    for _ in range(100):
        if log.exists() and log.read_text() == "hello\nerr\n":
            break
        await asyncio.sleep(0.02)
    assert log.read_text() == "hello\nerr\n"
    assert proc.returncode is None
    await sb.close()
    assert proc.returncode is not None and not _alive(proc.pid)


async def test_bwrap_cannot_read_another_sandbox(bwrap_backend: LocalSandboxBackend) -> None:
    a: LocalSandbox = await bwrap_backend.create("a", {})
    b: LocalSandbox = await bwrap_backend.create("b", {"secret.txt": "hidden-tests"})
    result = await a.exec(f"cat {b.workdir}/secret.txt; ls {b.root.parent}", 5)
    assert "hidden-tests" not in result.stdout
    assert result.stdout.split() == [a.sandbox_id]  # only its own dir is in the root
    await a.close()
    await b.close()


async def test_bwrap_cannot_write_outside(bwrap_backend: LocalSandboxBackend, tmp_path: Path) -> None:
    sb = await bwrap_backend.create("w", {})
    target = tmp_path / "escape.txt"
    result = await sb.exec(f"touch /etc/harnessrl-escape; echo x > {target}; echo x > ../ok.txt", 5)
    assert result.returncode == 0  # the last write, inside the sandbox dir, succeeded
    assert not os.path.exists("/etc/harnessrl-escape")
    assert not target.exists()
    assert (sb.root / "ok.txt").read_text() == "x\n"
    await sb.close()


async def test_bwrap_tmp_is_private(bwrap_backend: LocalSandboxBackend) -> None:
    a = await bwrap_backend.create("a", {})
    b = await bwrap_backend.create("b", {})
    name = f"/tmp/harnessrl-private-{a.sandbox_id}"
    assert (await a.exec(f"echo a > {name} && cat {name}", 5)).stdout == "a\n"
    assert (await b.exec(f"cat {name}", 5)).returncode != 0
    assert not os.path.exists(name)
    await a.close()
    await b.close()


async def test_bwrap_pid_namespace_hides_host_processes(bwrap_backend: LocalSandboxBackend) -> None:
    sb = await bwrap_backend.create("n", {})
    result = await sb.exec(f"kill -0 {os.getpid()} && echo visible || echo hidden", 5)
    assert result.stdout.strip().endswith("hidden")
    await sb.close()


async def test_kill_processes_keeps_directory_and_sandbox_usable(
    backend: LocalSandboxBackend,
) -> None:
    sb = await backend.create("k", {"keep.txt": "kept"})
    agent = await sb.spawn(["bash", "-c", "setsid sleep 1000 & exec sleep 1000"])
    await asyncio.sleep(0.2)
    killed = await sb.kill_processes()
    assert killed >= 2  # the agent and the daemon it started in a new session
    assert sb.list_processes() == [] and agent.returncode is not None
    assert sb.read_file("keep.txt") == b"kept"
    assert (await sb.exec(["cat", "keep.txt"], 5)).stdout == "kept"
    await sb.close()


def test_isolation_policy_without_bubblewrap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path, use_bwrap=False))
    gaps = backend.unisolated()
    assert [g.split(" ")[0] for g in gaps[:4]] == ["filesystem", "processes", "network", "privileges"]
    with pytest.raises(SandboxError, match="isolation = 'required'.*filesystem.*network"):
        backend.check_isolation("required")
    with caplog.at_level("WARNING"):
        assert backend.check_isolation("best_effort") == gaps
    assert "NOT ISOLATED" in caplog.text and "admin listener" in caplog.text


async def test_train_refuses_to_start_unisolated() -> None:
    from harnessrl.config import RunConfig
    from harnessrl.runtime import start_runtime

    cfg = RunConfig(sandbox=SandboxConfig(use_bwrap=False))
    with pytest.raises(SandboxError, match="required"):
        async with start_runtime(cfg, isolation="required"):
            pass  # pragma: no cover - refused before anything loads
    overridden = RunConfig(sandbox=SandboxConfig(use_bwrap=False, isolation="required"))
    with pytest.raises(SandboxError, match="required"):
        async with start_runtime(overridden, isolation="best_effort"):
            pass  # pragma: no cover


async def test_agent_endpoint_is_the_sandbox_route(backend: LocalSandboxBackend) -> None:
    from harnessrl.types import Endpoint

    sb = await backend.create("ep", {})
    host_side = Endpoint(base_url="http://0.0.0.0:8123/v1", api_key="k", model="m",
                         keyed_base_url="http://0.0.0.0:8123/r/k/v1")
    try:
        inside = sb.agent_endpoint(host_side)
        if sb.uses_bwrap:
            assert (inside.base_url, inside.keyed_base_url) == ("http://127.0.0.1:8123/v1", "http://127.0.0.1:8123/r/k/v1")
        else:
            assert inside == host_side
        assert (inside.api_key, inside.model) == ("k", "m")
    finally:
        await sb.close()


async def test_pids_cgroup_created_and_removed(backend: LocalSandboxBackend) -> None:
    if backend.cgroup_root is None:
        pytest.skip("no writable pids cgroup on this machine")
    sb = await backend.create("cg", {})
    group = backend.cgroup_root / sb.sandbox_id
    try:
        assert (group / "pids.max").read_text().strip() == str(backend.config.max_processes)
        r = await sb.exec("cat /proc/self/cgroup", 10)
        assert any(line.endswith(f"/{sb.sandbox_id}") for line in r.stdout.splitlines()), r.stdout
    finally:
        await sb.close()
    assert not group.exists()


def test_disk_usage_counts_blocks_without_following_links(tmp_path: Path) -> None:
    from harnessrl.sandbox.local import disk_usage

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * (1 << 20))
    (tmp_path / "big-elsewhere").mkdir()
    os.symlink("/usr", tmp_path / "d" / "link")
    used = disk_usage(tmp_path / "d")
    assert (1 << 20) <= used < (1 << 20) + (64 << 10)


def test_remove_tree_goes_past_one_error_and_any_depth(tmp_path: Path) -> None:
    """An entry that cannot be removed (an immutable file) is reported; everything else, a
    2,000-deep chain included, is removed."""
    import shutil
    import subprocess

    from harnessrl.sandbox.hostdir import remove_tree, tree_usage

    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr for an entry nothing can remove")
    root = tmp_path / "victim"
    (root / "a").mkdir(parents=True)
    stuck = root / "a" / "stuck"
    stuck.write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable attribute")
    try:
        (root / "b.txt").write_text("y")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(2000):  # built by descriptors: the path is far past PATH_MAX
                os.mkdir("d", dir_fd=fd)
                sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = sub
            os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        finally:
            os.close(fd)
        assert tree_usage(root).too_deep
        errors = remove_tree(root)
        assert len(errors) >= 1 and any("stuck" in e for e in errors), errors
        assert sorted(p.name for p in root.iterdir()) == ["a"]  # the chain and b.txt are gone
        assert [p.name for p in (root / "a").iterdir()] == ["stuck"]
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], capture_output=True)
    assert remove_tree(root) == [] and not root.exists()
