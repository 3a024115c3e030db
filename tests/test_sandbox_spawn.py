"""Sandbox process spawning is leak-free and behaves the same on the default loop and uvloop
(`sandbox/spawn.py`; conftest runs every async test here on both loops)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.sandbox import spawn
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from sandbox_kits import KITS, assert_no_podman_leftovers, kit_available

# bash's own descriptors (`; true` keeps bash from exec'ing ls, so $$ is bash)
LIST_FDS = "ls /proc/$$/fd; true"


@pytest.fixture(params=[False, True], ids=["plain", "bwrap"])
def backend(request, sandbox_root: Path) -> LocalSandboxBackend:
    if request.param and bwrap_path() is None:
        pytest.skip("bubblewrap is not installed")
    return LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root, isolation="best_effort",
                                             use_bwrap=request.param))


def _fds(listing: str) -> set[int]:
    return {int(name) for name in listing.split()}


async def test_a_spawned_child_has_only_stdin_stdout_stderr() -> None:
    leaked = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leaked, True)  # an inheritable descriptor of ours must not reach it either
    try:
        child = await spawn.start(["bash", "-c", LIST_FDS], stdout=spawn.PIPE, stderr=spawn.PIPE)
        assert child.stdout is not None
        out = await child.stdout.read()
        assert await child.wait() == 0
        child.close_pipes()
    finally:
        os.close(leaked)
    assert _fds(out.decode()) == {0, 1, 2}


async def test_exit_status_of_a_signal_and_wait_returns_at_exit_not_at_pipe_close() -> None:
    child = await spawn.start(["bash", "-c", "kill -TERM $$"])
    assert await child.wait() == -signal.SIGTERM
    assert child.returncode == -signal.SIGTERM
    started = time.monotonic()
    child = await spawn.start(["bash", "-c", "sleep 5 & echo bg"], stdout=spawn.PIPE, start_new_session=True)
    assert child.stdout is not None
    try:
        assert await asyncio.wait_for(child.wait(), 2.0) == 0
        assert time.monotonic() - started < 2.0, "wait() returned only when the background child closed stdout"
        assert await child.stdout.readline() == b"bg\n"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.close_pipes()


async def test_a_missing_executable_raises_file_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        await spawn.start(["/nonexistent/harnessrl-no-such-program"])


async def test_sandbox_commands_see_no_inherited_descriptor(backend: LocalSandboxBackend) -> None:
    sandbox = await backend.create("fds", {})
    try:
        result = await sandbox.exec(LIST_FDS, 30)
        assert result.returncode == 0, result.stderr
        assert _fds(result.stdout) == {0, 1, 2}
        proc = await sandbox.spawn(["bash", "-c", "ls /proc/$$/fd > fds.txt; true"], log_file="agent.log")
        assert await proc.wait(30) == 0
        assert _fds(sandbox.read_file("fds.txt").decode()) == {0, 1, 2}
    finally:
        await sandbox.close()


async def test_a_background_child_holding_stdout_does_not_lose_the_output(backend: LocalSandboxBackend) -> None:
    """The command's output comes back within `pipe_grace_s` of its exit, with what it printed,
    though a daemon it left still holds the pipe."""
    sandbox = await backend.create("bg", {})
    try:
        for cmd in ["sleep 3 & echo bg", "setsid sleep 1000 & nohup sleep 1001 & echo started"]:
            result = await sandbox.exec(cmd, 10)
            assert result.returncode == 0 and not result.timed_out, result
            assert result.stdout == cmd.rsplit("echo ", 1)[1] + "\n"
            assert result.duration_s < 2.5, result.duration_s
    finally:
        await sandbox.close()


@pytest.mark.parametrize("kit_name", ["bwrap", "podman"])
async def test_commands_behind_the_proxy_forwarder_see_no_inherited_descriptor(
        kit_name: str, sandbox_root: Path, tokenizer) -> None:  # noqa: ANN001
    """With the forwarder between the backend and the command (every command of a run)."""
    kit_available(kit_name)
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0)) as proxy:
        sandbox = await KITS[kit_name].backend(sandbox_root, proxy).create("fwd", {})
        try:
            result = await sandbox.exec(LIST_FDS, 60)
            assert result.returncode == 0, result.stderr
            assert _fds(result.stdout) == {0, 1, 2}
            started = time.monotonic()
            result = await sandbox.exec("sleep 3 & echo bg", 60)
            assert (result.returncode, result.stdout) == (0, "bg\n") and time.monotonic() - started < 2.5
        finally:
            await sandbox.close()
    if kit_name == "podman":
        assert_no_podman_leftovers()
