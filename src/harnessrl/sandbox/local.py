"""The local sandbox: one directory and one set of process groups per rollout on this machine.

Responsibility: implement the `Sandbox` seam with subprocesses, rlimits and, when installed,
bubblewrap (`sandbox/bwrap.py` says exactly what bubblewrap isolates).

Layout of a sandbox `<root_dir>/<sandbox_id>/`: `work/` (the workdir: a fresh copy of the
task's workspace, written file by file from the task's texts, never linked), `home/` (HOME;
XDG_CONFIG/CACHE/DATA/STATE_HOME point inside it and are created on demand by programs, as
the XDG spec asks), `tmp/` (TMPDIR and XDG_RUNTIME_DIR, mode 0700). Few directories on
purpose: on ext4 mounted with `discard`, removing each costs milliseconds at `close()`.

Every command (exec or spawn):
  * starts a new session (`start_new_session=True`), so its pid is its process group id;
    the sandbox records every such group;
  * joins the sandbox's pids cgroup before it execs (`sandbox/cgroup.py`, where one can be
    created): `max_processes` bounds the tasks of the whole sandbox, and every descendant is
    found at `close()` whatever it did to its session, environment or directory;
  * gets an environment built from scratch: PATH, LANG, HOME, TMPDIR, XDG_*, the markers
    `HARNESSRL_SANDBOX_ID` / `HARNESSRL_SANDBOX_DIR`, then what the caller passes. Nothing of
    the parent's environment (API keys, proxy URLs) is inherited;
  * gets rlimits from `SandboxConfig` (CPU seconds, address space, file size; processes only
    where there is no cgroup);
  * started by root under bubblewrap, mounts its own read-only overlays of the trees every
    sandbox shares (system directories, agent trees) and its own device nodes in a mount
    namespace of its own before bubblewrap starts (`sandbox/layers.py`), and gets the proxy
    socket as a descriptor of a detached read-only bind rather than a bind under
    `/run/harnessrl` (`TreeLayers.socket_handle`: no mount names the socket's host path);
  * runs under bubblewrap when `use_bwrap` is True, or None and a working `bwrap` is found:
    an unprivileged user without capabilities in its own namespaces, whose only way out is
    the proxy's agent socket behind a forwarder on `127.0.0.1:<proxy port>` (`sandbox/bwrap.py`;
    `agent_endpoint` gives the URL to hand the agent).

`spawn` returns a `LocalProcess` (the `SandboxProcess` seam): its tree is its process group,
its descendants and every process carrying its spawn marker `HARNESSRL_SPAWN_ID`;
`kill_tree` kills that tree the way `close()` kills the sandbox (`sandbox/procs.py`: SIGTERM,
`kill_grace_s`, SIGKILL until a scan is empty). File paths are relative to `work/` or `home/`
(`read_file` / `write_file` with `base`); `agent_path` is the host path, as the sandbox
directory is bound at its own path under bubblewrap. Under bubblewrap the agent trees
(`ro_binds`) are mounted at `/run/harnessrl/agents/<name>`, not at their host paths;
`tree_path` maps a file of one to where commands find it.

While commands run, a watchdog sums the sandbox directory's allocated bytes every
`disk_poll_s`; past `disk_bytes` it kills every process of the sandbox and no further
command starts (`disk_exceeded`). A fast writer can overshoot by what it writes in one poll.

`close()` kills every process of the sandbox (its groups, its cgroup members, and stragglers
found by marker or working directory, see `sandbox/procs.py`: SIGTERM, grace, SIGKILL),
removes the directory and the cgroup, is idempotent, and runs to completion even when the
task awaiting it is cancelled.

What is NOT isolated without bubblewrap (`LocalSandboxBackend.unisolated()` names it, and a
run logs it or refuses to start, see `SandboxConfig.isolation`): the filesystem (commands run
as our user, root, and can read and write anything the host lets root touch; only the file
API `read_file` / `write_file` refuses paths outside the workdir), the network (every host
port, including the proxy's admin listener, which then only its token protects), other
processes (they can see them, read their environments and signal them), and /tmp. Without a
pids cgroup, RLIMIT_NPROC is the only process bound and the kernel ignores it for root; a
process that clears its environment, leaves the sandbox directory and its process group
then escapes `close()` without bubblewrap (with it, the PID namespace ends it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import resource
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from subprocess import SubprocessError
from typing import Literal

from harnessrl.errors import SandboxError
from harnessrl.sandbox import cgroup, layers, seccomp, spawn, sweep
from harnessrl.sandbox.filetable import check_file_table
from harnessrl.sandbox import owner as owners
from harnessrl.sandbox.base import Base
from harnessrl.sandbox.bwrap import (
    FORWARDER_SCRIPT,
    SANDBOX_UID,
    ProxyRoute,
    bwrap_argv,
    bwrap_path,
    forwarder_python,
    inner_tree_points,
    make_devices,
    masked_proc_texts,
    setpriv_path,
)
from harnessrl.sandbox.config import SandboxConfig
from harnessrl.sandbox.fsread import UnsafePathError, write_beneath
from harnessrl.sandbox.hostdir import (
    TRUNCATION_MARKER,
    HostDirSandbox,
    HostProcess,
    complete_shielded,
    disk_usage,
    loopback_endpoint,
    remove_tree,
)
from harnessrl.sandbox.spawn import Child
from harnessrl.types import Endpoint


def devices_dir(root: Path) -> Path:
    """Where a root-started sandbox at `root` keeps its own device nodes (`bwrap.make_devices`)
    or, with overlays (`sandbox/layers.py`), the staging directory `trees/` each command mounts
    its overlays and nodes over: beside it, `<root_dir>/.dev-<sandbox id>`, out of the agent's
    reach (bubblewrap, as root, binds from it: nothing under the agent's control may name a
    path it binds)."""
    return root.parent / f".dev-{root.name}"
import sys

from harnessrl.sandbox.cgroup import PidsGroup
from harnessrl.sandbox.procs import (
    SPAWN_VAR,
    find_processes,
    kill_sandbox_processes,
    kill_tree,
    leftover_processes,
)

__all__ = [
    "TRUNCATION_MARKER",
    "LocalSandbox",
    "LocalSandboxBackend",
    "SandboxConfig",
    "disk_usage",
    "leftover_processes",
    "leftover_sandboxes",
]

log = logging.getLogger(__name__)


def shared_trees(config: SandboxConfig, ro_binds: Sequence[Path], proxied: bool) -> list[Path]:
    """The read-only host trees bound into every command under bubblewrap: system
    directories, agent trees, the interpreter prefixes asked for (`bind_python`), the
    forwarder's when `proxied` (each once)."""
    trees = [Path(p) for p in config.system_paths if not os.path.islink(p) and os.path.isdir(p)]
    trees += ro_binds
    if config.bind_python:
        trees += [Path(p) for p in sorted({sys.prefix, sys.base_prefix})]
    if proxied:
        trees += forwarder_python(config.system_paths)[1]
    return list(dict.fromkeys(trees))


def _child_setup(limits: dict[int, int], group: PidsGroup | None,
                 trees: layers.TreeLayers | None = None,
                 socket: tuple[Path, int] | None = None) -> Callable[[], None]:
    """The `preexec_fn` of every command: mount its private overlays of the shared trees (in a
    mount namespace of its own) and put the proxy socket's handle at its descriptor
    (`socket`: path, descriptor; `TreeLayers.socket_handle`), join the sandbox's pids cgroup,
    set rlimits."""
    def apply() -> None:
        if trees is not None:
            trees.mount()
            if socket is not None:
                trees.socket_handle(*socket)
        if group is not None:
            group.join()
        for which, value in limits.items():
            resource.setrlimit(which, (value, value))

    return apply


class LocalProcess(HostProcess):
    """A process started by `LocalSandbox.spawn` (the `SandboxProcess` seam).

    Its tree is what `procs.find_tree` finds: its process group, its descendants, and every
    process carrying its spawn marker (`HARNESSRL_SPAWN_ID`) whatever session it moved to.
    """

    def __init__(self, proc: Child, spawn_id: str, grace_s: float) -> None:
        super().__init__(proc)
        self._spawn_id = spawn_id
        self._grace_s = grace_s

    async def kill_tree(self) -> int:
        """SIGTERM the tree, `kill_grace_s`, SIGKILL, reap (see `SandboxProcess.kill_tree`)."""
        async def kill() -> tuple[int, list[int]]:
            found, survivors = await asyncio.to_thread(kill_tree, self._spawn_id, self._proc.pid, self._grace_s)
            if self._proc.pid not in survivors:
                await self._proc.wait()
            return found, survivors

        found, survivors = await complete_shielded(kill)
        if survivors:
            raise SandboxError(f"pids {survivors} of spawned {self._proc.pid} survived SIGKILL")
        return found


class LocalSandbox(HostDirSandbox):
    """One rollout's directory and processes on this machine. Create via `LocalSandboxBackend`."""

    def __init__(
        self, sandbox_id: str, root: Path, config: SandboxConfig, bwrap: str | None,
        ro_binds: Sequence[Path], proxy: ProxyRoute | None = None, group: PidsGroup | None = None,
        owner: int | None = None, memory_rlimit: bool = False, layered: bool = False,
    ) -> None:
        super().__init__(sandbox_id, root, config)
        self.owner = owner
        """Host uid (= gid) of this sandbox's commands and files (`sandbox/owner.py`), or None
        when they run as this process's user."""
        self._memory_rlimit = memory_rlimit
        self.config: SandboxConfig = config
        self._bwrap = bwrap
        self._ro_binds = tuple(ro_binds)
        self._proxy = proxy
        self._routed = proxy is not None
        """Commands get the proxy route; false from `kill_processes` on (the agent phase is
        over: the verifier's commands, the submission's run among them, reach no proxy)."""
        self._group = group
        self._pgids: set[int] = set()
        self._spawned: list[Child] = []
        self._layers = self._tree_layers() if layered and bwrap is not None and owner is not None else None
        """Private overlays of every shared read-only tree, mounted per command."""
        if bwrap is not None:
            self._tree_points = inner_tree_points(self._ro_binds)

    @property
    def _route(self) -> ProxyRoute | None:
        """The proxy route the next command gets (None once the agent phase is over)."""
        return self._proxy if self._routed else None

    def _shared_trees(self) -> list[Path]:
        return shared_trees(self.config, self._ro_binds, self._proxy is not None)

    def _tree_layers(self) -> layers.TreeLayers:
        overlaid, _ = layers.shareable(self._shared_trees())
        return layers.TreeLayers(devices_dir(self._root) / "trees", overlaid, devices=True)

    @property
    def uses_bwrap(self) -> bool:
        return self._bwrap is not None

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        """The endpoint as the agent must address it from inside this sandbox.

        Under bubblewrap the agent's only route is the forwarder on `127.0.0.1:<proxy port>`
        in its own network namespace, so any host in `endpoint` (e.g. `0.0.0.0`) becomes
        127.0.0.1 and the port stays; without bubblewrap the endpoint is returned unchanged.
        """
        if self._bwrap is None:
            return endpoint
        return loopback_endpoint(endpoint)

    def _argv(self, argv: Sequence[str], cwd: Path, fds: dict[str, int]) -> list[str]:
        if self._bwrap is None:
            return list(argv)
        ro = list(self._ro_binds)
        if self.config.bind_python:
            ro += [Path(p) for p in {sys.prefix, sys.base_prefix}]
        if self._route is not None:
            ro += self._proxy_binds
        ro = list(dict.fromkeys(ro))
        sources = {} if self._layers is None else {
            str(tree): self._layers.source(i) for i, tree in enumerate(self._layers.trees)}
        return bwrap_argv(
            self._bwrap, argv, sandbox_dir=self._root, sandbox_root=self._root.parent,
            cwd=cwd, ro_binds=ro, system_paths=self.config.system_paths,
            tmp_bytes=self.config.tmp_bytes, proxy=self._route, owner=self.owner,
            seccomp_fd=fds.get("seccomp"), forwarder_fd=fds.get("forwarder"), socket_fd=fds.get("socket"),
            proc_fds={k: v for k, v in fds.items() if k.startswith("/proc/")},
            devices=(self._layers.devices_dir if self._layers is not None
                     else devices_dir(self._root) if self.owner is not None else None), sources=sources,
            points=self._tree_points,
        )

    def _bwrap_fds(self) -> dict[str, int]:
        """Descriptors one bubblewrap start reads: its seccomp filter and the forwarder's text
        (memfds; the caller closes them once it started)."""
        if self._bwrap is None:
            return {}
        fds: dict[str, int] = {}
        try:
            fds["seccomp"] = seccomp.program_fd()
        except seccomp.UnsupportedArch:
            pass
        for path, text in masked_proc_texts().items():  # constants over host-wide figures
            fd = os.memfd_create("harnessrl-proc", os.MFD_CLOEXEC)
            os.write(fd, text)
            os.lseek(fd, 0, os.SEEK_SET)
            fds[path] = fd
        if self._route is not None:
            fd = os.memfd_create("harnessrl-forward", os.MFD_CLOEXEC)
            os.write(fd, FORWARDER_SCRIPT.read_bytes())
            os.lseek(fd, 0, os.SEEK_SET)
            fds["forwarder"] = fd
            if self._layers is not None:
                # a descriptor number for the socket's handle, which the child puts there
                fds["socket"] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return fds

    @property
    def _proxy_binds(self) -> list[Path]:
        """Paths the forwarder's interpreter needs bound (none for a system python3)."""
        assert self._route is not None, "only called with a proxy route"
        return forwarder_python(self.config.system_paths)[1]

    def _limits(self, address_space_bytes: int | None) -> dict[int, int]:
        cfg = self.config
        if address_space_bytes is None and self._memory_rlimit:
            address_space_bytes = cfg.memory_bytes  # no memory cgroup here: the fallback bound
        limits = {
            resource.RLIMIT_CPU: cfg.cpu_s,
            resource.RLIMIT_AS: address_space_bytes,
            resource.RLIMIT_FSIZE: cfg.file_size_bytes,
            resource.RLIMIT_NOFILE: cfg.max_open_files,  # not the trainer's (sandbox/filetable.py)
            # the pids cgroup bounds the sandbox as a whole; RLIMIT_NPROC is only a fallback
            resource.RLIMIT_NPROC: cfg.max_processes if self._group is None or self._group.path is None else None,
        }
        return {k: v for k, v in limits.items() if v is not None}


    async def _start(
        self, argv: Sequence[str], env: dict[str, str] | None, cwd: Path | None,
        address_space_bytes: int | None, stdout: int, stderr: int,
    ) -> Child:
        self._check_startable(argv[0])
        run_dir = self._run_dir(cwd)
        fds = self._bwrap_fds()
        try:
            proc = await spawn.start(
                self._argv(argv, run_dir, fds), cwd=run_dir if self.owner is None else self._root,
                env=self._env(env), stdout=stdout, stderr=stderr, start_new_session=True,
                preexec_fn=_child_setup(self._limits(address_space_bytes), self._group, self._layers,
                                        None if self._route is None or "socket" not in fds
                                        else (self._route.socket_path, fds["socket"])),
                pass_fds=tuple(fds.values()),
            )
        except FileNotFoundError:
            raise
        except (OSError, SubprocessError) as e:  # SubprocessError: the preexec_fn failed
            raise SandboxError(f"sandbox {self.sandbox_id} cannot start {argv[0]!r}: {e}") from e
        finally:
            for fd in fds.values():
                os.close(fd)
        self._pgids.add(proc.pid)
        self._started()
        return proc

    async def _start_exec(self, argv: list[str], env: dict[str, str] | None,
                          cwd: Path | None) -> tuple[int, Child]:
        """The command in its own process group (its pgid is the handle)."""
        proc = await self._start(argv, env, cwd, self.config.address_space_bytes,
                                 spawn.PIPE, spawn.PIPE)
        return proc.pid, proc

    @property
    def _pipe_grace_s(self) -> float:
        return self.config.pipe_grace_s

    async def _exec_exited(self, handle: int) -> None:
        if self.uses_bwrap:
            # the pid namespace's init takes every process down with the command; wait
            # for that teardown so nothing of this command is alive when exec returns
            await self._wait_quiet(max(self.config.kill_grace_s, 1.0))

    async def _exec_timed_out(self, handle: int, proc: Child) -> None:
        """SIGKILL the command's process group."""
        _kill_group(handle)
        await proc.wait()
        # members of the group (e.g. inside a bubblewrap pid namespace) can outlive the
        # leader by a moment: return only once the group is gone, or the grace ran out
        await _wait_group_gone(handle, max(self.config.kill_grace_s, 1.0))
        if self.uses_bwrap:
            await self._wait_quiet(max(self.config.kill_grace_s, 1.0))

    def _exec_cancelled(self, handle: int) -> Awaitable[None] | None:
        # Cancelled: kill the group now; close() reaps and scans for stragglers.
        _kill_group(handle)
        return None

    async def spawn(
        self, argv: list[str], env: dict[str, str] | None = None, log_file: str | None = None,
    ) -> LocalProcess:
        """Start a background process (an agent) in the workdir, in its own process group,
        stdin closed, stdout and stderr appended to `log_file` (relative to home, opened
        without following links; discarded when None).

        Raises `SandboxError` when the sandbox is closed, the log path is unsafe, or the
        process cannot start (FileNotFoundError when `argv[0]` does not exist without
        bubblewrap).
        """
        spawn_id = secrets.token_hex(8)
        out = self._open_log(log_file)
        try:
            proc = await self._start(
                argv, {**(env or {}), SPAWN_VAR: spawn_id}, None, self.config.spawn_address_space_bytes,
                out, spawn.STDOUT,
            )
        finally:
            if log_file is not None:
                os.close(out)
        self._spawned.append(proc)
        return LocalProcess(proc, spawn_id, self.config.kill_grace_s)

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        """Write `rel_path` under `base` (file mode `mode`), creating parents, no symlink
        followed at any component. Raises SandboxError for a symlink, a non-directory parent
        or a `..` component."""
        raw = data.encode() if isinstance(data, str) else data
        try:
            if self.owner is None:
                write_beneath(self._root, self._rel(base, rel_path), raw, mode)
            else:
                self._write_owned(self._rel(base, rel_path), raw, mode, (self.owner, self.owner))
        except UnsafePathError as e:
            raise SandboxError(f"sandbox {self.sandbox_id}: {rel_path!r} not written (escapes the {base} dir "
                               f"or crosses a link): {e.strerror}") from None

    async def _wait_quiet(self, timeout_s: float) -> None:
        """Poll until no process of this sandbox is alive (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        while self.list_processes() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def list_processes(self) -> list[int]:
        """Pids alive in this sandbox (its groups, its cgroup, its marker, or a cwd inside its
        directory)."""
        return find_processes(self.sandbox_id, self._root, self._pgids, self._members)

    @property
    def _members(self) -> Callable[[], list[int]] | None:
        return self._group.pids if self._group is not None else None

    async def kill_processes(self) -> int:
        """Kill every process of the sandbox (its groups and stragglers), keep the directory.

        Returns how many live processes were found. Raises SandboxError when some survive
        SIGKILL. Called before verification, so hidden tests never meet a live agent process;
        once none is left, setuid / setgid bits of every file of the sandbox are cleared
        (`strip_setid`), before anything of the host reads or runs them. Every command after
        it runs without the proxy route.
        """
        self._routed = False
        if not self._pgids:
            return 0
        found, survivors = await asyncio.to_thread(
            kill_sandbox_processes, self.sandbox_id, self._root, self._pgids,
            self.config.kill_grace_s, self._members,
        )
        if self._group is not None and survivors:
            survivors = await asyncio.to_thread(self._group.kill, self.config.kill_grace_s)
        for proc in self._spawned:
            if proc.pid not in survivors:
                await proc.wait()
        if survivors:
            raise SandboxError(f"sandbox {self.sandbox_id}: pids {survivors} survived SIGKILL")
        await asyncio.to_thread(self._strip_setid)
        return found

    async def _remove_rest(self) -> None:
        try:
            if self.owner is not None:
                await asyncio.to_thread(remove_tree, devices_dir(self._root))
            if self._group is not None:
                await asyncio.to_thread(self._remove_group)
        finally:
            if self.owner is not None and not self.root.exists():
                owners.release(self.owner)
            if not self.root.exists():
                sweep.release(self.root.parent, self.sandbox_id)

    def _remove_group(self) -> None:
        assert self._group is not None, "only called with a group"
        deadline = time.monotonic() + max(self.config.kill_grace_s, 1.0)
        while self._group.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._group.remove()


async def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Poll until no process is left in group `pgid` (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        await asyncio.sleep(0.01)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class LocalSandboxBackend:
    """Creates `LocalSandbox`es under `config.root_dir`.

    Args:
        config: limits and placement; defaults to `SandboxConfig()`.
        ro_binds: paths bound read-only into every sandbox under bubblewrap (agent install
            trees), each at `/run/harnessrl/agents/<its name>` (`bwrap.inner_tree_points`;
            `LocalSandbox.tree_path` maps a host path of one); ignored without bubblewrap,
            where the whole filesystem is visible.
        proxy_port, proxy_socket: the proxy's agent port and agent Unix socket. Under
            bubblewrap each command gets a forwarder on `127.0.0.1:proxy_port` inside its own
            network namespace relaying to `proxy_socket` (`sandbox/forward.py`); without them
            a bubblewrapped command reaches nothing at all. Ignored without bubblewrap.

    Raises `SandboxError` when `use_bwrap=True` and no working bwrap is installed, or when only
    one of `proxy_port` / `proxy_socket` is given.
    """

    def __init__(self, config: SandboxConfig | None = None, ro_binds: Sequence[Path] = (),
                 proxy_port: int | None = None, proxy_socket: Path | None = None) -> None:
        self.config = config or SandboxConfig()
        self.ro_binds = tuple(Path(p).resolve() for p in ro_binds)
        found = bwrap_path() if self.config.use_bwrap is not False else None
        if self.config.use_bwrap is True and found is None:
            raise SandboxError("use_bwrap=True but no working `bwrap` (apt-get install bubblewrap)")
        self.bwrap = found
        if (proxy_port is None) != (proxy_socket is None):
            raise SandboxError(f"proxy_port={proxy_port} and proxy_socket={proxy_socket}: give both or neither")
        self.proxy: ProxyRoute | None = None
        if proxy_port is not None and proxy_socket is not None:
            python = forwarder_python(self.config.system_paths)[0]
            self.proxy = ProxyRoute(proxy_port, Path(proxy_socket), python)
        self.cgroup_root = cgroup.available() if self.config.max_processes is not None else None
        self.memory_root = cgroup.memory_available() if self.config.memory_bytes is not None else None
        self.cpu_root = cgroup.cpu_available() if self.config.cpus is not None else None
        self.owned = self.bwrap is not None and owners.owned_sandboxes() and setpriv_path() is not None
        """Each sandbox runs as an unprivileged host uid of its own (`sandbox/owner.py`): this
        process is root and bubblewrap is used."""
        self.layers_problem = (layers.layers_supported(tuple(layers.shareable(
            shared_trees(self.config, self.ro_binds, self.proxy is not None))[0])) if self.owned else "not root")
        """None when every command gets private overlays of the shared read-only trees
        (`sandbox/layers.py`), else why not."""
        if self.owned and self.proxy is not None:
            # every sandbox uid connects through its read-only bind of the socket file; the
            # socket's own 0700 directory keeps every other host user out
            os.chmod(self.proxy.socket_path, 0o666)
    def unisolated(self) -> list[str]:
        """What this backend's sandboxes do NOT isolate or bound, one phrase each (empty when
        every boundary of `sandbox/bwrap.py` holds and the process count is bounded)."""
        gaps: list[str] = []
        if self.bwrap is None:
            gaps += ["filesystem (commands run as this user and can read and write the host and "
                     "other sandboxes)",
                     "processes (other agents' /proc, environments and keys are visible)",
                     "network (every host port is reachable, including the proxy's admin listener)",
                     "privileges (commands keep this user's capabilities)"]
        elif not self.owned:
            gaps.append("owner (not run as root: sandboxes run as this process's user, mapped to uid "
                        f"{SANDBOX_UID} inside, and can read and change what that user can)")
        if self.bwrap is not None:
            try:
                seccomp.program()
            except seccomp.UnsupportedArch as e:
                gaps.append(f"syscall filter ({e})")
            if self.layers_problem is not None:
                gaps.append(f"shared read-only trees (no private overlays: {self.layers_problem}; an inotify "
                            "watch on a system or agent file sees other sandboxes' opens of it)")
            else:
                _, kept = layers.shareable(shared_trees(self.config, self.ro_binds, self.proxy is not None))
                if kept:
                    gaps.append("shared read-only trees bound as they are, not directories or with a mount point "
                                f"below (an inotify watch there sees other sandboxes' opens): "
                                f"{', '.join(map(str, kept))}")
        if self.config.memory_bytes is not None and self.memory_root is None:
            gaps.append("memory (no writable memory cgroup: RLIMIT_AS of spawned agents only)")
        if self.config.cpus is not None and self.cpu_root is None:
            gaps.append("CPU (no writable cpu cgroup: busy processes of one sandbox slow its siblings)")
        if self.config.max_processes is not None and self.cgroup_root is None:
            gaps.append("process count (no writable pids cgroup"
                        + (": RLIMIT_NPROC is ignored for root)" if os.geteuid() == 0 else ")"))
        return gaps

    def check_isolation(self, mode: Literal["required", "best_effort"], concurrency: int = 1) -> list[str]:
        """Apply the isolation policy: returns the gaps (see `unisolated`) after logging them as
        a warning. Raises SandboxError naming them when `mode` is "required" and bubblewrap
        is not used (a missing pids cgroup alone only warns: many containers have none), and
        in either mode when `concurrency` sandboxes could hold more than the host's file table
        allows (`sandbox/filetable.py`); logs that figure."""
        gaps = self.unisolated()
        check_file_table(self.config.max_processes if self.cgroup_root is not None else None,
                         self.config.max_open_files, concurrency)
        if self.bwrap is None and mode == "required":
            raise SandboxError("sandbox.isolation = 'required' but bubblewrap is not used, so sandboxes "
                               "would not isolate: " + "; ".join(gaps) + ". Install bubblewrap "
                               "(apt-get install bubblewrap) and leave sandbox.use_bwrap unset, or set "
                               "sandbox.isolation = 'best_effort' to run anyway.")
        if gaps:
            log.warning("SANDBOXES ARE NOT ISOLATED: %s", "; ".join(gaps))
        return gaps

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> LocalSandbox:
        """A new sandbox whose workdir holds a fresh copy of `workspace` (path -> text).

        Raises SandboxError when a workspace path is absolute or escapes the workdir, or
        when its pids cgroup cannot be created.
        """
        sandbox_id = f"{_UNSAFE.sub('_', rollout_id)[:64]}-{secrets.token_hex(4)}"
        root = self.config.root_dir.resolve() / sandbox_id
        group: PidsGroup | None = None
        owner = owners.allocate() if self.owned else None
        try:
            sweep.claim(root.parent, sandbox_id)  # a killed run's sandbox is swept at the next start
            root.mkdir(parents=True)
            if owner is not None:
                # the sandbox root is root's and 0700: no other host user reaches any sandbox
                # (the agent may open up its own directory, not the way to it)
                root_dir = root.parent
                if os.stat(root_dir).st_uid == 0:
                    os.chmod(root_dir, 0o700)
                os.chown(root, owner, owner)
                os.chmod(root, 0o700)
            for sub in ("work", "home", "tmp"):
                (root / sub).mkdir(mode=0o700)
                if owner is not None:
                    os.chown(root / sub, owner, owner)
            if owner is not None:
                if self.layers_problem is None:  # each command makes its nodes with its overlays
                    devices_dir(root).mkdir(mode=0o700)
                else:
                    make_devices(devices_dir(root))
                (devices_dir(root) / "trees").mkdir(mode=0o700)  # staging of its overlays
            if self.cgroup_root is not None or self.memory_root is not None or self.cpu_root is not None:
                try:
                    group = PidsGroup.create(self.cgroup_root, sandbox_id, self.config.max_processes,
                                             self.memory_root, self.config.memory_bytes,
                                             self.cpu_root, self.config.cpus)
                except OSError as exc:
                    raise SandboxError(f"sandbox {sandbox_id}: cannot create its cgroups: {exc}") from exc
            sandbox = LocalSandbox(sandbox_id, root, self.config, self.bwrap, self.ro_binds,
                                   self.proxy, group, owner,
                                   memory_rlimit=self.memory_root is None and self.config.memory_bytes is not None,
                                   layered=self.layers_problem is None)
            for rel_path, text in workspace.items():
                if Path(rel_path).is_absolute():
                    raise SandboxError(f"workspace path {rel_path!r} is absolute")
                sandbox.write_file(rel_path, text)  # refuses absolute and `..` paths
        except BaseException:
            remove_tree(root)
            remove_tree(devices_dir(root))
            if group is not None:
                group.remove()
            if owner is not None:
                owners.release(owner)
            sweep.release(root.parent, sandbox_id)
            raise
        return sandbox


def leftover_sandboxes(root: Path) -> list[Path]:
    """Sandbox directories still present under `root` (empty after every sandbox closed); the
    owners' directory of `sandbox/sweep.py` is not one."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != sweep.OWNERS) if root.exists() else []
