"""The local sandbox's side of the seam a harness uses: sandbox-relative files under work or
home, `agent_path`, and the `SandboxProcess` handle from `spawn` (wait with a timeout, kill the
tree with the sandbox's one grace setting), with and without bubblewrap.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from harnessrl.errors import SandboxError
from harnessrl.sandbox.base import SandboxProcess
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig

GRACE_S = 0.3


@pytest.fixture(params=[False, True], ids=["plain", "bwrap"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> LocalSandboxBackend:
    if request.param and bwrap_path() is None:
        pytest.skip("no bwrap")
    return LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sbx", use_bwrap=request.param,
                                             kill_grace_s=GRACE_S))


async def test_files_under_home_and_work_and_agent_paths(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("f", {"a.txt": "work file"})
    try:
        sb.write_file(".harnessrl/x/config.json", '{"k": 1}', base="home", mode=0o600)
        assert (sb.home / ".harnessrl/x/config.json").stat().st_mode & 0o777 == 0o600
        assert sb.read_file(".harnessrl/x/config.json", base="home") == b'{"k": 1}'
        assert sb.read_file("a.txt", max_bytes=4) == b"work" and sb.read_file("a.txt", max_bytes=4, tail=True) == b"file"
        assert sb.agent_path("home") == str(sb.home)
        assert sb.agent_path("work", "a.txt") == str(sb.workdir / "a.txt")
        # the agent sees the file where agent_path says
        res = await sb.exec(["cat", sb.agent_path("home", ".harnessrl/x/config.json")], 10)
        assert res.stdout == '{"k": 1}', res.stderr
        for bad in ("../work/a.txt", "/etc/passwd"):
            with pytest.raises(SandboxError, match="escapes the home dir"):
                sb.read_file(bad, base="home")
            with pytest.raises(SandboxError, match="escapes"):
                sb.agent_path("home", bad)
        with pytest.raises(SandboxError, match="base='tmp'"):
            sb.write_file("x", "y", base="tmp")  # type: ignore[arg-type]
    finally:
        await sb.close()


async def test_wait_times_out_and_kill_tree_takes_children_that_left_the_group(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("p", {})
    try:
        script = "setsid sleep 1000 & (trap '' TERM; sleep 1000) & echo up; exec sleep 1000"
        proc = await sb.spawn(["bash", "-c", script], log_file=".harnessrl/agent.log")
        assert isinstance(proc, SandboxProcess)
        assert await proc.wait(0.3) is None and proc.returncode is None
        assert (sb.home / ".harnessrl/agent.log").read_text() == "up\n"
        assert len(sb.list_processes()) >= 3
        t0 = time.monotonic()
        killed = await proc.kill_tree()
        elapsed = time.monotonic() - t0
        assert killed >= 3, killed
        assert proc.returncode is not None and proc.returncode < 0
        assert await proc.wait(0) == proc.returncode
        assert sb.list_processes() == []
        # the TERM-ignoring child waits out the grace, then SIGKILL (under bubblewrap the PID
        # namespace ends with its init at SIGTERM already); never much longer than the grace
        assert elapsed < GRACE_S + 2.0, elapsed
        if not sb.uses_bwrap:
            assert elapsed >= GRACE_S, elapsed
        assert await proc.kill_tree() == 0  # idempotent
    finally:
        await sb.close()


async def test_exited_process_returns_its_code_and_kill_tree_finds_nothing(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("e", {})
    try:
        proc = await sb.spawn(["bash", "-c", "exit 7"])
        assert await proc.wait(30) == 7
        assert await proc.kill_tree() == 0
    finally:
        await sb.close()


async def test_kill_tree_completes_when_cancelled(backend: LocalSandboxBackend) -> None:
    sb = await backend.create("c", {})
    try:
        proc = await sb.spawn(["bash", "-c", "trap '' TERM; sleep 1000 & wait"])
        await asyncio.sleep(0.2)
        killing = asyncio.ensure_future(proc.kill_tree())
        await asyncio.sleep(0.05)
        killing.cancel()
        # Under bubblewrap SIGTERM to the namespace's init can end the tree before the cancel
        # lands; either way the kill must have completed by the time the task is done.
        try:
            await killing
        except asyncio.CancelledError:
            pass
        assert killing.done()
        assert proc.returncode is not None and sb.list_processes() == []
    finally:
        await sb.close()


async def test_a_linked_log_path_is_refused(backend: LocalSandboxBackend, tmp_path: Path) -> None:
    outside = tmp_path / "outside.log"
    outside.write_text("")
    sb = await backend.create("l", {})
    try:
        (sb.home / ".harnessrl").mkdir()
        (sb.home / ".harnessrl" / "a.log").symlink_to(outside)
        with pytest.raises(SandboxError, match="not opened"):
            await sb.spawn(["echo", "x"], log_file=".harnessrl/a.log")
        assert outside.read_text() == ""
    finally:
        await sb.close()
