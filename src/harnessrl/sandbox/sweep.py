"""Removing what a killed run left behind: its sandboxes, their cgroups, mounts and processes.

Responsibility: a run stopped by SIGKILL (the OOM killer, a lost node, `kill -9`) runs no
teardown, so its sandbox directories under `sandbox.root_dir`, their pids and memory cgroups
(`sandbox/cgroup.py`) and any mount below them stay; `sweep` removes them at the next start of
any command (`harnessrl train`, `rollout`, `serve`), without touching a live run's.

How a dead owner is told from a live one: each process that makes local sandboxes holds an
exclusive `flock` on a lock file of its own, `<root_dir>/.owners/<pid>-<hex>.lock`, for as long
as it lives (the kernel drops the lock when the process dies, however it dies; the descriptor
is close-on-exec, so no sandboxed command holds it), and before it makes a sandbox's directory
it records the sandbox as its own (`<root_dir>/.owners/<sandbox id>.sandbox`, holding the lock
file's name; `claim`), removed once the sandbox is gone (`release`). `sweep` takes each lock
it finds without waiting: one it gets belongs to a dead process, whose recorded sandboxes are
then removed; one held is a live run's and everything of it stays. A directory with no record
(made by a version without records, or a run between its record and its `mkdir`) is never
touched. The `.owners` directory sits inside the root that bubblewrap hides from every sandbox.

Podman sandboxes (`sandbox/podman.py`) are recorded the same way, their record adding the
`podman` command line of their store (a second line, JSON): a dead owner's podman sandbox has
its containers' processes SIGKILLed through their cgroups (`podman_host.kill_members`), its
containers removed (`podman rm`, by the `harnessrl.sandbox` label), its container cgroups
removed, then its directory.

Also swept: the proxy's private agent-socket directories (`harnessrl-proxy-*` in the system
temp directory) whose socket no longer accepts a connection. Podman containers of a dead run
that has no record here (another sandbox root) are removed by `podman_host.remove_orphans`
when a podman backend starts.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.sandbox import cgroup
from harnessrl.sandbox.hostdir import remove_tree
from harnessrl.sandbox.podman_host import CGROUP_PARENT, SANDBOX_LABEL, kill_members, remove_cgroups
from harnessrl.sandbox.procs import kill_sandbox_processes

OWNERS = ".owners"
"""Directory under the sandbox root holding the owners' lock files and the sandboxes' records."""
PROXY_DIR_PREFIX = "harnessrl-proxy-"
"""Prefix of the proxy's private socket directories (`proxy/server.py`, `tempfile.mkdtemp`)."""
SOCKET_SETTLE_S = 5.0
"""A proxy socket younger than this is left alone (it may be bound and not yet listening)."""

_OCTAL = re.compile(r"\\([0-7]{3})")
_lock = threading.Lock()
_held: dict[Path, str] = {}
"""Sandbox root -> the name of this process's lock file there (its descriptor stays open)."""


@dataclass
class Swept:
    """What one `sweep` removed, and what it left to live runs."""

    sandboxes: list[str] = field(default_factory=list)
    """Ids of the dead runs' sandboxes removed (directory, cgroups, mounts, processes)."""
    owners: list[str] = field(default_factory=list)
    """Lock-file names (`<pid>-<hex>`) of the dead runs swept."""
    cgroups: int = 0
    mounts: int = 0
    processes: int = 0
    proxy_dirs: int = 0
    """Proxy socket directories of dead processes removed."""
    errors: list[str] = field(default_factory=list)
    """What could not be removed (a path and why), one entry each."""

    def __bool__(self) -> bool:
        return bool(self.sandboxes or self.proxy_dirs or self.errors)

    def line(self) -> str:
        """One line for the console: what was removed, of which dead runs."""
        pids = sorted({name.split("-", 1)[0] for name in self.owners})
        parts = [f"{len(self.sandboxes)} sandbox{'es' if len(self.sandboxes) != 1 else ''} of killed "
                 f"run{'s' if len(pids) != 1 else ''} (pid {', '.join(pids)}): directories, {self.cgroups} "
                 f"cgroups, {self.mounts} mounts, {self.processes} processes"] if self.sandboxes else []
        if self.proxy_dirs:
            parts.append(f"{self.proxy_dirs} proxy socket director{'ies' if self.proxy_dirs != 1 else 'y'}")
        text = "swept what a killed run left: " + ("; ".join(parts) if parts else "nothing removed")
        if self.errors:
            text += f"; not removed: {'; '.join(self.errors[:3])}" + (" ..." if len(self.errors) > 3 else "")
        return text


def _owners_dir(root_dir: Path) -> Path:
    path = root_dir / OWNERS
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _own_lock(root_dir: Path) -> str:
    """The name of this process's lock file under `root_dir`, made and locked on first use."""
    with _lock:
        name = _held.get(root_dir)
        if name is not None and (root_dir / OWNERS / f"{name}.lock").exists():
            return name
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(_owners_dir(root_dir) / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
        _held[root_dir] = name  # the descriptor stays open for the life of the process
        atexit.register(_drop_lock, root_dir / OWNERS / f"{name}.lock", os.getpid())
        return name


def _drop_lock(path: Path, pid: int) -> None:
    """At a normal exit, remove this process's lock file (a forked child inherits the hook:
    only the process that made it removes it). A sandbox still recorded then has an owner
    that is gone, and the next `sweep` removes it."""
    if os.getpid() == pid:
        path.unlink(missing_ok=True)


def claim(root_dir: Path, sandbox_id: str, podman: Sequence[str] | None = None) -> None:
    """Record sandbox `sandbox_id` under `root_dir` as this live process's, before its directory
    or cgroups are made; `podman`: the `podman` command line of a podman sandbox's store
    (`podman_host.podman_argv`), with which a sweep removes its containers. Raises OSError when
    the record cannot be written."""
    root_dir = root_dir.resolve()
    owner = _own_lock(root_dir)
    record = root_dir / OWNERS / f"{sandbox_id}.sandbox"
    record.write_text(owner if podman is None else f"{owner}\n{json.dumps(list(podman))}\n", encoding="utf-8")


def release(root_dir: Path, sandbox_id: str) -> None:
    """Drop the record of `sandbox_id` once its directory and cgroups are gone."""
    try:
        (root_dir.resolve() / OWNERS / f"{sandbox_id}.sandbox").unlink()
    except FileNotFoundError:
        pass


def _try_lock(path: Path) -> int | None:
    """A descriptor holding `path`'s lock when its owner is dead (None while it lives). A lock
    file already gone counts as dead: -1."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def sweep(root_dir: Path, proxy_tmp: Path | None = None) -> Swept:
    """Remove every sandbox under `root_dir` recorded by a process that is gone (module
    docstring), with its cgroups, mounts and processes, and the proxy socket directories in
    `proxy_tmp` (default: the system temp directory) that no live proxy serves. A live run's
    sandboxes, and directories without a record, are left as they are. Never raises for a
    single entry: what fails is listed in `Swept.errors`."""
    out = Swept()
    root_dir = root_dir.resolve()
    owners = root_dir / OWNERS
    if owners.is_dir():
        records: dict[str, list[tuple[str, list[str] | None]]] = {}
        for record in owners.glob("*.sandbox"):
            try:
                owner, _, podman = record.read_text(encoding="utf-8").strip().partition("\n")
                argv = [str(arg) for arg in json.loads(podman)] if podman else None
            except (OSError, ValueError, TypeError) as exc:
                out.errors.append(f"{record.name}: unreadable record ({exc})")
                continue
            records.setdefault(owner, []).append((record.name[:-8], argv))
        names = set(records) | {p.name[:-5] for p in owners.glob("*.lock")}
        for name in sorted(names):
            _sweep_owner(root_dir, name, records.get(name, []), out)
    _sweep_proxy_dirs(Path(proxy_tmp or tempfile.gettempdir()), out)
    return out


def _sweep_owner(root_dir: Path, name: str, sandboxes: list[tuple[str, list[str] | None]], out: Swept) -> None:
    lock = root_dir / OWNERS / f"{name}.lock"
    fd = _try_lock(lock)
    if fd is None:
        return  # a live run
    try:
        for sandbox_id, podman in sandboxes:
            if podman is not None and not _sweep_containers(sandbox_id, podman, out):
                continue  # its containers stay: so do its directory and record
            if _sweep_sandbox(root_dir, sandbox_id, out):
                release(root_dir, sandbox_id)
            out.sandboxes.append(sandbox_id)
        out.owners.append(name)
        if not any(root_dir.joinpath(OWNERS, f"{s}.sandbox").exists() for s, _ in sandboxes):
            lock.unlink(missing_ok=True)
    finally:
        if fd >= 0:
            os.close(fd)


def _sweep_containers(sandbox_id: str, podman: list[str], out: Swept) -> bool:
    """SIGKILL a dead podman sandbox's processes through its container cgroups, remove its
    containers (`podman rm` by its `harnessrl.sandbox` label, with the store's command line
    `podman`) and its cgroups; True when none of them is left."""
    out.processes += kill_members(sandbox_id)
    label = f"label={SANDBOX_LABEL}={sandbox_id}"
    try:
        listed = subprocess.run([*podman, "ps", "-a", "-q", "--filter", label], capture_output=True, text=True,
                                timeout=60, check=True)
        ids = listed.stdout.split()
        if ids:
            subprocess.run([*podman, "rm", "-f", "-t", "0", "--ignore", *ids], capture_output=True, timeout=120,
                           check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        out.errors.append(f"{sandbox_id}: containers not removed ({exc})")
        return False
    present = list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/{sandbox_id}"))
    left = remove_cgroups(sandbox_id)
    out.cgroups += len(present) - len(left)
    out.errors += [f"cgroup {g} still there" for g in left]
    return not left


def _sweep_sandbox(root_dir: Path, sandbox_id: str, out: Swept) -> bool:
    """Kill, unmount and remove one dead sandbox; True when nothing of it is left."""
    directory = root_dir / sandbox_id
    devices = root_dir / f".dev-{sandbox_id}"
    groups = [parent / sandbox_id for parent in {cgroup.available(), cgroup.memory_available()}
              if parent is not None and (parent / sandbox_id).is_dir()]
    group = cgroup.PidsGroup(groups[0], groups[1] if len(groups) > 1 else None) if groups else None
    found, survivors = kill_sandbox_processes(sandbox_id, directory, (), 0.0,
                                              group.pids if group is not None else None)
    out.processes += found
    if survivors:
        out.errors.append(f"{sandbox_id}: pids {survivors} survived SIGKILL")
        return False
    out.mounts += _unmount_below((directory, devices), out)
    errors = remove_tree(directory) + remove_tree(devices)
    out.errors += [f"{sandbox_id}: {e}" for e in errors[:2]]
    if group is not None:
        group.remove()
        left = [g for g in groups if g.exists()]
        out.cgroups += len(groups) - len(left)
        out.errors += [f"cgroup {g} still there" for g in left]
        errors += [str(g) for g in left]
    return not errors


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:  # the mount point, with space, tab, newline, backslash as \ooo
                points.append(_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def _unmount_below(paths: tuple[Path, ...], out: Swept) -> int:
    """Detach every mount at or below `paths`, deepest first; returns how many."""
    prefixes = [str(p) for p in paths]
    below = [m for m in _mount_points() if any(m == p or m.startswith(p + "/") for p in prefixes)]
    if not below:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for point in sorted(set(below), key=len, reverse=True):
        if libc.umount2(os.fsencode(point), 2) == 0:  # MNT_DETACH
            done += 1
        else:
            out.errors.append(f"umount {point}: {os.strerror(ctypes.get_errno())}")
    return done


def _sweep_proxy_dirs(tmp: Path, out: Swept) -> None:
    """Remove `harnessrl-proxy-*` directories of `tmp` whose agent socket refuses connections
    (its proxy is gone) and is older than `SOCKET_SETTLE_S`."""
    try:
        candidates = [p for p in tmp.iterdir() if p.name.startswith(PROXY_DIR_PREFIX)]
    except OSError:
        return
    for directory in candidates:
        sock_path = directory / "agent.sock"
        try:
            if time.time() - sock_path.lstat().st_mtime < SOCKET_SETTLE_S:
                continue
        except OSError:
            continue  # not yet bound, or not a proxy's
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(sock_path))
            continue  # a live proxy
        except ConnectionRefusedError:
            pass
        except OSError:
            continue
        finally:
            probe.close()
        shutil.rmtree(directory, ignore_errors=True)
        out.proxy_dirs += 1
