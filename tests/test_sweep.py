"""`sandbox/sweep.py`: what a SIGKILLed process left under the sandbox root is removed at the
next start, and nothing of a live process or of an unrecorded directory is touched.

Real processes: each owner is a Python process that makes real local sandboxes (directories,
pids and memory cgroups where writable) and spawns `sleep` in one, then is SIGKILLed (no
handler, no teardown) or kept alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harnessrl.sandbox import cgroup
from harnessrl.sandbox.procs import find_processes
from harnessrl.sandbox.sweep import OWNERS, Swept, claim, release, sweep

OWNER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from harnessrl.sandbox.config import SandboxConfig
    from harnessrl.sandbox.local import LocalSandboxBackend

    async def main() -> None:
        backend = LocalSandboxBackend(SandboxConfig(root_dir=Path(sys.argv[1]), use_bwrap=False,
                                                    isolation="best_effort"))
        boxes = [await backend.create(f"rollout-{i}", {"a.txt": "x"}) for i in range(2)]
        await boxes[0].spawn(["sleep", "300"])
        print(" ".join(b.sandbox_id for b in boxes), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def _start_owner(root: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(root)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    ids = proc.stdout.readline().split()
    assert len(ids) == 2, proc.communicate(timeout=30)
    return proc, ids


def _cgroups(sandbox_id: str) -> list[Path]:
    return [p / sandbox_id for p in {cgroup.available(), cgroup.memory_available()}
            if p is not None and (p / sandbox_id).exists()]


def test_a_killed_owners_sandboxes_go_and_a_live_owners_stay(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    dead, dead_ids = _start_owner(root)
    live, live_ids = _start_owner(root)
    try:
        sleeper = find_processes(dead_ids[0], root / dead_ids[0], ())
        assert sleeper, "the dead owner's agent process runs in its sandbox"
        groups = sum(len(_cgroups(sandbox_id)) for sandbox_id in dead_ids)
        if cgroup.available() is not None:
            assert groups >= 2, "a pids cgroup per sandbox"
        os.kill(dead.pid, signal.SIGKILL)  # the owner only: its sleep lives on without bubblewrap
        dead.wait()
        assert find_processes(dead_ids[0], root / dead_ids[0], ()) == sleeper, "nothing reaped it"
        (root / "unrecorded").mkdir()  # a directory without a record: never touched

        swept = sweep(root, proxy_tmp=tmp_path)

        assert sorted(swept.sandboxes) == sorted(dead_ids)
        assert swept.owners[0].startswith(f"{dead.pid}-") and swept.processes == 1 and not swept.errors
        for sandbox_id in dead_ids:
            assert not (root / sandbox_id).exists() and not _cgroups(sandbox_id)
            assert not (root / OWNERS / f"{sandbox_id}.sandbox").exists()
            assert find_processes(sandbox_id, root / sandbox_id, ()) == []
        assert not list((root / OWNERS).glob(f"{dead.pid}-*.lock")), "the dead owner's lock file goes"
        assert swept.cgroups == groups
        for sandbox_id in live_ids:  # the live run: directory, record, cgroup and agent untouched
            assert (root / sandbox_id / "work" / "a.txt").read_text() == "x"
            assert (root / OWNERS / f"{sandbox_id}.sandbox").exists()
        assert find_processes(live_ids[0], root / live_ids[0], ())
        assert (root / "unrecorded").is_dir()
        assert f"2 sandboxes of killed run (pid {dead.pid})" in swept.line()
        assert not sweep(root, proxy_tmp=tmp_path), "a second sweep finds nothing"
    finally:
        for proc in (dead, live):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for sandbox_id in live_ids:  # the live owner was killed last: sweep its sandboxes too
            for pid in find_processes(sandbox_id, root / sandbox_id, ()):
                os.kill(pid, signal.SIGKILL)
        sweep(root, proxy_tmp=tmp_path)
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == ["unrecorded"]


def test_claim_holds_this_process_live_and_release_drops_the_record(tmp_path: Path) -> None:
    claim(tmp_path, "mine-1")
    (tmp_path / "mine-1").mkdir()
    assert not sweep(tmp_path, proxy_tmp=tmp_path), "this process is alive: its sandbox stays"
    assert (tmp_path / "mine-1").is_dir()
    release(tmp_path, "mine-1")
    assert not (tmp_path / OWNERS / "mine-1.sandbox").exists()


def test_a_dead_proxys_socket_directory_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    import socket

    dead_dir, live_dir, young_dir = (tmp_path / f"harnessrl-proxy-{n}" for n in ("dead", "live", "young"))
    socks = []
    for directory in (dead_dir, live_dir, young_dir):
        directory.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(directory / "agent.sock"))
        socks.append(s)
    socks[1].listen()
    socks[0].close()  # bound, never listening: refuses like a dead proxy's
    old = time.time() - 60
    for directory in (dead_dir, live_dir):
        os.utime(directory / "agent.sock", (old, old), follow_symlinks=False)
    try:
        swept = sweep(tmp_path / "no-sandboxes", proxy_tmp=tmp_path)
    finally:
        for s in socks:
            s.close()
    assert swept.proxy_dirs == 1 and not dead_dir.exists()
    assert live_dir.exists() and young_dir.exists(), "a live or just-bound socket stays"


def test_the_line_names_what_was_removed() -> None:
    swept = Swept(sandboxes=["a", "b", "c"], owners=["41-ab"], cgroups=6, processes=1, proxy_dirs=1)
    assert swept.line() == ("swept what a killed run left: 3 sandboxes of killed run (pid 41): directories, "
                            "6 cgroups, 0 mounts, 1 processes; 1 proxy socket directory")
    assert not Swept()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_mount_left_below_a_dead_sandbox_is_detached(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    dead, ids = _start_owner(root)
    os.killpg(dead.pid, signal.SIGKILL)
    dead.wait()
    target = root / f".dev-{ids[1]}" / "trees"
    target.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "leftover", str(target)], check=True)
    try:
        swept = sweep(root, proxy_tmp=tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)
    assert swept.mounts == 1 and not swept.errors
    assert str(target) not in Path("/proc/self/mountinfo").read_text()
    assert not (root / f".dev-{ids[1]}").exists()
