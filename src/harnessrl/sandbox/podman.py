"""Container sandboxes: every command of a rollout runs in its own podman container.

Responsibility: implement the `Sandbox` seam with rootful podman (`sandbox.kind = "podman"`,
`PodmanSandboxConfig`), for task families that need their own OS image. What was measured
to run on which machine, and what did not run, is in `docs/containers.md`.

Layout: the sandbox directory `<root_dir>/<sandbox_id>/{work,home,tmp}` lives on the host,
owned by a host uid of its own (`sandbox/owner.py`), exactly as a root-started local
sandbox's, under a sandbox root that is root's and 0700; every container binds it read-write at
the same absolute path (so `agent_path` is the host path and paths an agent prints mean the
same to the verifier). Nothing else of the host is visible: the image's root filesystem,
read-only; the paths of `ro_binds` (agent install trees), read-only at
`/run/harnessrl/agents/<name>` (not their host paths; `tree_path` maps one), each through an overlay
of the sandbox's own (`sandbox/layers.py`: mounted under its state directory at `create`,
unmounted at `close()`, those of a killed run at the next run's start by
`remove_orphan_mounts`), so flock and inotify on their files stay within the sandbox (the
image's own files are already an overlay per container); a private `/tmp` and
`/dev/shm` (tmpfs of `tmp_bytes`); and, with a proxy, `sandbox/forward.py` under
`/run/harnessrl` and the proxy's agent socket as descriptor 3 (`--preserve-fds 1`: a handle of
a detached read-only bind, `layers.detached_handle`, opened at `create`, closed at `close()`),
so no mount names the socket's host path.

Every command (`exec` or `spawn`) is one container (`podman run --rm`), like every command of
a local sandbox is one bubblewrap namespace; files persist in the sandbox directory, the
image's filesystem does not change. Each container runs:
  * as the sandbox's own uid/gid (not root, no other sandbox's) with no capability (`--cap-drop all`, bounding set
    empty), `no-new-privileges`, podman's default seccomp profile, its own PID, mount, IPC,
    UTS and network namespaces;
  * with `--network none` (only `lo`) and, with a proxy, under the forwarder that listens on
    `127.0.0.1:<proxy port>` and relays to the proxy's agent socket: its one way out;
  * with `memory_bytes` (memory and swap), `cpus`, `max_processes` (pids.max), RLIMIT_CPU and
    RLIMIT_FSIZE, under the cgroup parent `/harnessrl-podman/<sandbox_id>`;
  * labelled `harnessrl.sandbox=<sandbox_id>` and `harnessrl.owner=<backend id>`, so that
    `remove_orphans` removes only harnessrl's own containers whose run is gone;
  * with its environment from a file in a host-private directory (`--env-file`), never in the
    `podman run` argv that every host user can read.

The command is its container's PID 1: when it exits, the kernel kills everything left in the
container, whatever session it moved to. `SandboxProcess.kill_tree` and `close()` stop the
container (`podman rm -f -t kill_grace_s`: SIGTERM, the grace, SIGKILL). The processes of a
sandbox are the members of its containers' cgroups (`list_processes`, host pids). The disk
watchdog (`disk_bytes`) SIGKILLs those members from the host at once, without waiting for a
`podman` process to start, then removes the containers.

The proxy's agent socket (mode 0600, owned by root, in a 0700 directory) is made mode 0666
when a backend is given a proxy, so that each sandbox's unprivileged uid can connect through
its handle; its 0700 directory still keeps every host user but root out.

Host requirements (checked by `podman_problem`): root, podman with the runc runtime, the
overlay storage driver and the cgroupfs cgroup manager, and the image in `storage_dir`.

The host side (harnessrl's podman store, the host check, the cgroups, orphan removal) is in
`sandbox/podman_host.py`; its public names are importable from here too.

What this does not do: pull images (no registry is assumed), share a pids or memory budget
across the containers of one sandbox (limits are per container), or run without root. Tested
on cgroup v1 (hybrid layout) only; the v2 paths (`pids_hierarchy`) are unexercised.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Literal

from harnessrl.errors import SandboxError
from harnessrl.sandbox.base import Base
from harnessrl.sandbox.filetable import check_file_table
from harnessrl.sandbox.bwrap import (
    FORWARDER_SCRIPT,
    INNER_FORWARDER,
    SANDBOX_UID,
    inner_tree_points,
    masked_proc_texts,
)
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.fsread import UnsafePathError
from harnessrl.sandbox import layers, spawn, sweep
from harnessrl.sandbox import owner as owners
from harnessrl.sandbox.seccomp import SOCKET_FAMILIES, SOCKETPAIR_FAMILIES
from harnessrl.sandbox.hostdir import HostDirSandbox, HostProcess, complete_shielded, loopback_endpoint, remove_tree
from harnessrl.sandbox.spawn import Child
from harnessrl.sandbox.local import _UNSAFE
from harnessrl.sandbox.podman_host import (
    CGROUP_PARENT,
    OWNER_LABEL,
    SANDBOX_LABEL,
    cgroup_pids,
    kill_members,
    pids_hierarchy,
    podman_argv,
    podman_problem,
    remove_cgroups,
    remove_containers,
    remove_orphans,
    ulimit_args,
)
from harnessrl.sandbox.procs import SPAWN_VAR
from harnessrl.types import Endpoint

__all__ = ["CGROUP_PARENT", "OWNER_LABEL", "SANDBOX_LABEL", "PodmanProcess", "PodmanSandbox", "PodmanSandboxBackend",
           "podman_argv", "podman_problem", "remove_containers", "remove_orphans"]

log = logging.getLogger(__name__)

_PIPE_GRACE_S = 0.2


async def _podman(config: PodmanSandboxConfig, *args: str, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run one podman command; (exit status, stderr)."""
    proc = await spawn.start([*podman_argv(config), *args], stderr=spawn.PIPE)
    assert proc.stderr is not None, "stderr was piped"
    stderr = proc.stderr

    async def collect() -> tuple[bytes, int]:
        # not wait_for(gather(...)): a gather cut by the timeout holds a CancelledError that
        # nothing retrieves, and its finalizer then logs from whatever code the GC interrupts
        err = await stderr.read()
        return err, await proc.wait()

    try:
        err, code = await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return -9, f"podman {args[0]} timed out after {timeout_s}s"
    finally:
        proc.close_pipes()
    return code, err.decode(errors="replace")


class PodmanProcess(HostProcess):
    """A process started by `PodmanSandbox.spawn`: one container (the `SandboxProcess` seam).

    `pid` is the host pid of the `podman run` client that waits on the container; its tree is
    the container (every process in it). Its exit status shows a signal N as 128+N (podman's
    convention); one the sandbox SIGKILLed from the host is 137 (`PodmanSandbox._exit_status`).
    """

    def __init__(self, proc: Child, name: str, sandbox: PodmanSandbox) -> None:
        super().__init__(proc)
        self.name = name
        self._sandbox = sandbox

    @property
    def returncode(self) -> int | None:
        code = self._proc.returncode
        return None if code is None else self._sandbox._exit_status(self.name, code)

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Exit status, or None when still running after `timeout_s` seconds."""
        code = await super().wait(timeout_s)
        return None if code is None else self._sandbox._exit_status(self.name, code)

    async def kill_tree(self) -> int:
        """Stop the container (SIGTERM, `kill_grace_s`, SIGKILL) and reap its client; returns
        how many of its processes were alive. Completes when the awaiting task is cancelled."""
        found, survivors = await complete_shielded(
            lambda: self._sandbox._stop([self.name], self._sandbox.config.kill_grace_s))
        if survivors:
            raise SandboxError(f"pids {survivors} of container {self.name} survived SIGKILL")
        return found


class PodmanSandbox(HostDirSandbox):
    """One rollout's directory on the host and its containers. Create via `PodmanSandboxBackend`.

    `exec` runs each command in a new container; a command killed by signal N exits 128+N
    (podman's convention)."""

    _disk_action = "killing its containers' processes"

    def __init__(self, sandbox_id: str, root: Path, state: Path, backend: PodmanSandboxBackend,
                 owner: int = SANDBOX_UID) -> None:
        super().__init__(sandbox_id, root, backend.config)
        self.owner = owner
        """Host uid (= gid) of this sandbox's containers and files (`sandbox/owner.py`): one of its
        own, so per-user kernel budgets (inotify instances, RLIMIT_NPROC) and setuid files stay
        apart between sandboxes."""
        self.config: PodmanSandboxConfig = backend.config
        self._state = state
        """Host-private directory (container id files), outside everything a container binds."""
        self._backend = backend
        self._clients: dict[str, Child] = {}
        """Container name -> its `podman run` client, for every command started."""
        self._routed = True
        """Containers get the proxy route; false from `kill_processes` on (the agent phase is
        over: the verifier's containers, the submission's run among them, reach no proxy)."""
        self._socket: int | None = None
        """This process's descriptor of the proxy socket (`layers.detached_handle`), handed to
        every container as its descriptor 3 (`PRESERVED_FD`)."""
        self._tree_points = inner_tree_points(backend.ro_binds)
        self._tree_sources: dict[Path, Path] = {}
        """Agent tree -> this sandbox's private overlay of it (`sandbox/layers.py`), bound in its
        place, so no inode of a tree is shared with another sandbox's containers."""
        self._host_killed: set[str] = set()
        """Containers whose processes `_disk_stop` SIGKILLed from the host while their client
        ran (`_exit_status`)."""

    def _mount_trees(self) -> None:
        """Mount this sandbox's overlays of the agent trees (`layers.host_mounts`) under its
        state directory; `_remove_rest` unmounts them."""
        overlaid, _ = layers.shareable(self._backend.ro_binds)
        if overlaid:
            mounted = layers.host_mounts(self._state / "trees", overlaid)
            self._tree_sources = dict(zip(overlaid, mounted, strict=True))

    def _open_socket(self) -> None:
        """Open this sandbox's handle of the proxy socket (a detached read-only bind made in its
        state directory): containers get it as a descriptor, so no mount of theirs names the
        socket's host path (a bind's root field would); `_remove_rest` closes it."""
        assert self._backend.proxy is not None, "only with a proxy"
        self._socket = layers.detached_handle(self._backend.proxy[1], self._state / "sock")

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        """`endpoint` on `127.0.0.1` (port and path kept): the forwarder inside the container."""
        return loopback_endpoint(endpoint)


    def _run_argv(self, name: str, argv: Sequence[str], cwd: Path, env: dict[str, str]) -> list[str]:
        cfg = self.config
        uid = str(self.owner)
        args = [*podman_argv(cfg), "run", "--rm", "--name", name, "--pull", "never",
                "--cidfile", str(self._state / f"{name}.cid"),
                "--label", f"{SANDBOX_LABEL}={self.sandbox_id}", "--label", f"{OWNER_LABEL}={self._backend.owner}",
                "--cgroup-parent", f"/{CGROUP_PARENT}/{self.sandbox_id}", "--log-driver", "passthrough",
                "--network", "none", "--user", f"{uid}:{uid}", "--cap-drop", "all",
                "--security-opt", "no-new-privileges", "--read-only", "--read-only-tmpfs=false",
                "--tmpfs", f"/tmp:rw,size={cfg.tmp_bytes},mode=1777", "--shm-size", str(cfg.tmp_bytes),
                "--pids-limit", str(cfg.max_processes), *ulimit_args(cfg.max_open_files), "--workdir", str(cwd),
                "-v", f"{self._root}:{self._root}"]
        if cfg.memory_bytes is not None:
            args += ["--memory", str(cfg.memory_bytes), "--memory-swap", str(cfg.memory_bytes)]
        if cfg.cpus is not None:
            args += ["--cpus", str(cfg.cpus)]
        if cfg.cpu_s is not None:
            args += ["--ulimit", f"cpu={cfg.cpu_s}:{cfg.cpu_s}"]
        if cfg.file_size_bytes is not None:
            args += ["--ulimit", f"fsize={cfg.file_size_bytes}:{cfg.file_size_bytes}"]
        for path in self._backend.ro_binds:
            args += ["-v", f"{self._tree_sources.get(path, path)}:{self._tree_points[path]}:ro"]
        prefix: list[str] = []
        args += self._masked_proc_args()
        proxy = self._backend.proxy if self._routed else None  # none once the agent phase is over
        if self._backend.seccomp_profile is not None:
            args += ["--security-opt", f"seccomp={self._backend.seccomp_profile}"]
        if proxy is not None:
            # the forwarder is this sandbox's own copy (no inode shared with another sandbox);
            # the socket comes as descriptor 3, a handle on a detached read-only bind (connect
            # works, chmod and utime do not, no mount names its host path)
            forwarder = self._state / "forward.py"
            if not forwarder.exists():
                forwarder.write_bytes(FORWARDER_SCRIPT.read_bytes())
                forwarder.chmod(0o644)
            args += ["-v", f"{forwarder}:{INNER_FORWARDER}:ro", "--preserve-fds", "1"]
            prefix = [cfg.python, "-I", "-S", INNER_FORWARDER, str(proxy[0]), f"/proc/self/fd/{PRESERVED_FD}", "--"]
        # the environment goes through a file in the host-private state directory, not argv
        # (a process's argv is readable by every host user); a value with a newline, which
        # the file format cannot hold, falls back to `-e`
        lines = [f"{k}={v}\n" for k, v in env.items() if "\n" not in v]
        env_file = self._state / f"{name}.env"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.writelines(lines)
        args += ["--env-file", str(env_file)]
        for key, value in env.items():
            if "\n" in value:
                args += ["-e", f"{key}={value}"]
        return [*args, cfg.image, *prefix, *argv]


    def _masked_proc_args(self) -> list[str]:
        """Host-wide figures of `/proc` as constants (`bwrap.MASKED_PROC`): `/proc/loadavg`,
        `/proc/stat` and `/proc/meminfo` bound from this sandbox's own copies of
        `bwrap.masked_proc_texts`; the files under `/proc/sys`, where runc refuses a bind,
        masked (read empty)."""
        args: list[str] = []
        masked: list[str] = []
        for path, text in masked_proc_texts().items():
            if path.startswith("/proc/sys/"):
                masked.append(path)
                continue
            copy = self._state / f"proc-{Path(path).name}"
            if not copy.exists():
                copy.write_bytes(text)
                copy.chmod(0o444)
            args += ["-v", f"{copy}:{path}:ro"]
        return [*args, "--security-opt", "mask=" + ":".join(masked)] if masked else args

    async def _start(self, argv: Sequence[str], env: dict[str, str] | None, cwd: Path | None,
                     stdout: int, stderr: int) -> tuple[str, Child]:
        self._check_startable(argv[0])
        run_dir = self._run_dir(cwd)
        name = f"hrl-{self.sandbox_id}-{len(self._clients)}"
        command = self._run_argv(name, argv, run_dir, self._env(env))
        socket_fd = self._socket if self._routed else None
        if socket_fd is not None:  # `--preserve-fds 1` hands podman's descriptor 3 to the container
            command = [sys.executable, "-I", "-S", "-c", _AS_FD3, str(socket_fd), *command]
        try:
            proc = await spawn.start(
                command, stdout=stdout, stderr=stderr, start_new_session=True,
                pass_fds=() if socket_fd is None else (socket_fd,),
                cwd=self._state)  # conmon inherits it and writes an `oom` file there on an OOM kill
        except OSError as e:
            raise SandboxError(f"sandbox {self.sandbox_id} cannot start podman for {argv[0]!r}: {e}") from e
        self._clients[name] = proc
        self._started()
        return name, proc


    def _container_pids(self, name: str) -> list[int]:
        try:
            cid = (self._state / f"{name}.cid").read_text().strip()
        except OSError:
            return []
        directory = pids_hierarchy() / CGROUP_PARENT / self.sandbox_id / f"libpod-{cid}"
        try:
            return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def list_processes(self) -> list[int]:
        """Host pids alive in this sandbox's containers (members of their cgroups)."""
        return cgroup_pids(pids_hierarchy() / CGROUP_PARENT / self.sandbox_id)

    async def _stop(self, names: Sequence[str], grace_s: float) -> tuple[int, list[int]]:
        """Stop and remove containers `names` (SIGTERM, `grace_s`, SIGKILL) and reap their
        clients; (processes found alive before, pids still alive after). A client still
        running after a removal (its container was being created) gets another one."""
        found = sum(len(self._container_pids(n)) for n in names)
        live = [n for n in names if self._clients[n].returncode is None or self._container_pids(n)]
        deadline = time.monotonic() + grace_s + 30.0
        while live and time.monotonic() < deadline:
            code, err = await _podman(self.config, "rm", "-f", "-t", str(math.ceil(grace_s)), "--ignore", *live,
                                      timeout_s=grace_s + 60)
            if code != 0:
                log.warning("sandbox %s: podman rm failed (%d): %s", self.sandbox_id, code, err.strip()[-300:])
            waits = [asyncio.ensure_future(self._clients[n].wait()) for n in live]
            _, pending = await asyncio.wait(waits, timeout=2.0)
            for waiting in pending:
                waiting.cancel()
            live = [n for n in live if self._clients[n].returncode is None or self._container_pids(n)]
        return found, [p for n in names for p in self._container_pids(n)]

    async def _start_exec(self, argv: list[str], env: dict[str, str] | None,
                          cwd: Path | None) -> tuple[str, Child]:
        """The command in a new container (its name is the handle)."""
        return await self._start(argv, env, cwd, spawn.PIPE, spawn.PIPE)

    @property
    def _pipe_grace_s(self) -> float:
        return _PIPE_GRACE_S

    def _exit_status(self, handle: object, code: int) -> int:
        """137 (128 + SIGKILL) for a container whose processes `_disk_stop` SIGKILLed while its
        `podman run` client ran and whose client then exited 125, 126 or 127; `code` otherwise.
        SIGKILL from the host reaches a container still being created too (its members are then
        `runc init`), and podman reports that as an OCI runtime error ("runc create failed"),
        exit 126, or 127 when the message says "no such file": a status that would read as a
        command that could not start, where the sandbox killed it."""
        if code in (125, 126, 127) and handle in self._host_killed:
            return 128 + 9
        return code

    async def _exec_timed_out(self, handle: str, proc: Child) -> None:
        """Kill the container (no grace) and reap its client."""
        await self._stop([handle], 0.0)
        await proc.wait()

    def _exec_cancelled(self, handle: str) -> Awaitable[tuple[int, list[int]]]:
        # cancelled: kill the container now (shielded); close() scans for the rest
        return asyncio.ensure_future(self._stop([handle], 0.0))

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None,
                    log_file: str | None = None) -> PodmanProcess:
        """Start a background process (an agent) in a new container, in the workdir, stdin
        closed, stdout and stderr appended to `log_file` (relative to home, opened by the host
        without following links; discarded when None). Raises `SandboxError` when the sandbox
        is closed or the log path is unsafe."""
        out = self._open_log(log_file)
        try:
            name, proc = await self._start(argv, {**(env or {}), SPAWN_VAR: secrets.token_hex(8)}, None,
                                           out, spawn.STDOUT)
        finally:
            if log_file is not None:
                os.close(out)
        return PodmanProcess(proc, name, self)

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        """Write `rel_path` under `base`, creating parents, no symlink followed; the file and
        the directories created for it belong to the sandbox's owner (the containers' user)."""
        rel = self._rel(base, rel_path)
        raw = data.encode() if isinstance(data, str) else data
        try:
            self._write_owned(rel, raw, mode, (self.owner, self.owner))
        except UnsafePathError as e:
            raise SandboxError(f"sandbox {self.sandbox_id}: {rel_path!r} not written (escapes the {base} dir "
                               f"or crosses a link): {e.strerror}") from None

    async def kill_processes(self) -> int:
        """Stop every container of the sandbox, keep the directory; returns how many processes
        were alive. Raises SandboxError when some survive SIGKILL. Every container after it
        runs without the proxy route (`--network none`, no forwarder)."""
        self._routed = False
        if not self._clients:
            return 0
        found, survivors = await self._stop(list(self._clients), self.config.kill_grace_s)
        if survivors:
            raise SandboxError(f"sandbox {self.sandbox_id}: pids {survivors} survived SIGKILL")
        await asyncio.to_thread(self._strip_setid)  # before the host reads or runs anything
        return found

    async def _disk_stop(self) -> None:
        """SIGKILL the containers' processes from the host at once (`kill_members`: a fast
        writer stops within milliseconds, where `podman rm` alone took about a second), then
        remove the containers and reap their clients (`kill_processes`)."""
        self._host_killed.update(name for name, client in self._clients.items() if client.returncode is None)
        await asyncio.to_thread(kill_members, self.sandbox_id)
        await self.kill_processes()

    async def _remove_rest(self) -> None:
        if self._socket is not None:
            os.close(self._socket)
            self._socket = None
        try:
            failed = await asyncio.to_thread(layers.unmount_below, self._state)
            if failed:
                log.warning("sandbox %s: overlays not unmounted: %s", self.sandbox_id, "; ".join(failed[:3]))
            errors = await asyncio.to_thread(remove_tree, self._state)
            if errors:
                log.warning("sandbox %s: state not removed: %s", self.sandbox_id, "; ".join(errors[:3]))
        finally:
            left = await asyncio.to_thread(remove_cgroups, self.sandbox_id)
            if not self.root.exists():
                owners.release(self.owner)
                sweep.release(self.root.parent, self.sandbox_id)
        if left:
            log.warning("sandbox %s: cgroups %s not removed", self.sandbox_id, [str(p) for p in left])


PRESERVED_FD = 3
"""The descriptor a container gets the proxy socket's handle at (`podman run --preserve-fds 1`)."""
_AS_FD3 = ("import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd); "
           "os.execvp(sys.argv[2], sys.argv[2:])")
"""Moves the handle (argv[1]) to descriptor 3 and execs podman (argv[2:]): `subprocess` keeps a
descriptor at its own number, and podman passes on exactly 3..3+N-1."""


STATE_PREFIX = "harnessrl-podman-"
"""Prefix of a sandbox's state directory in the system temp dir: `<prefix><pid>-<sandbox id>-<random>`
(the pid of the process whose backend made it)."""


def remove_orphan_mounts(tmp: Path | None = None) -> int:
    """Unmount the agent-tree overlays (`PodmanSandbox._mount_trees`) of state directories
    whose process is gone (a run killed by SIGKILL) and remove those directories; returns
    how many sandboxes' there were. A live process's are never touched."""
    base = str(tmp or Path(tempfile.gettempdir())).rstrip("/") + "/" + STATE_PREFIX
    dead: set[Path] = set()
    for point in layers.mount_points():
        if not point.startswith(base):
            continue
        pid = point[len(base):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            dead.add(Path(base + point[len(base):].split("/", 1)[0]))
    for state in dead:
        layers.unmount_below(state)
        remove_tree(state)
    return len(dead)


DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")
"""podman's default seccomp profile (containers-common)."""
_CLONE_NEWUSER = 0x10000000
_NETLINK_AUDIT = 9


def seccomp_profile(config: PodmanSandboxConfig, default: Path = DEFAULT_SECCOMP) -> Path | None:
    """podman's default profile with `unshare`, `setns` and `clone3` no longer allowed (the
    profile's default action refuses them: EPERM; `clone3` gets ENOSYS, so glibc falls back to
    `clone`) and `clone` allowed only without `CLONE_NEWUSER`: no nested user namespace, hence
    no capability in one; `socket` / `socketpair` allowed for the bubblewrap filter's families
    only (`seccomp.SOCKET_FAMILIES`), any other (AF_VSOCK) refused by the profile's default
    action. Written once to `<storage_dir>/seccomp-harnessrl-<hash of its text>.json`; None
    when `default` is missing."""
    try:
        profile = json.loads(default.read_text())
    except (OSError, ValueError):
        return None
    dropped = {"clone", "clone3", "unshare", "setns", "socket", "socketpair"}
    rules = []
    for rule in profile.get("syscalls", []):
        names = [n for n in rule.get("names", []) if n not in dropped]
        if names:
            rules.append({**rule, "names": names})
    rules.append({"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                  "args": [{"index": 0, "value": _CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]})
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})
    # socket families: the bubblewrap filter's allow-list (seccomp.SOCKET_FAMILIES); any other
    # family (AF_VSOCK, AF_PACKET, ...) gets the profile's default action (ENOSYS), and so does
    # an audit netlink socket (protocol 9), as in the default profile
    no_audit = [{"index": 2, "value": _NETLINK_AUDIT, "valueTwo": 0, "op": "SCMP_CMP_NE"}]
    for name, families in (("socket", SOCKET_FAMILIES), ("socketpair", SOCKETPAIR_FAMILIES)):
        rules += [{"names": [name], "action": "SCMP_ACT_ALLOW",
                   "args": [{"index": 0, "value": family, "valueTwo": 0, "op": "SCMP_CMP_EQ"},
                            *(no_audit if family == SOCKET_FAMILIES["AF_NETLINK"] else [])]}
                  for family in families.values()]
    profile["syscalls"] = rules
    text = json.dumps(profile, indent=1, sort_keys=True)
    # named by its text: runs of other harnessrl versions sharing the store keep their own
    path = config.storage_dir / f"seccomp-harnessrl-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    try:
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    except OSError:
        return None
    return path


class PodmanSandboxBackend:
    """Creates `PodmanSandbox`es under `config.root_dir`.

    Args:
        config: image, store and limits.
        ro_binds: host paths bound read-only into every container at
            `/run/harnessrl/agents/<its name>` (agent install trees; they must run with the
            image's libraries; `tree_path` maps a host path of one).
        proxy_port, proxy_socket: the proxy's agent port and agent Unix socket; every command
            then runs under the forwarder on `127.0.0.1:proxy_port`. Without them a container
            reaches nothing at all.

    Raises `SandboxError` when only one of `proxy_port` / `proxy_socket` is given.
    """

    def __init__(self, config: PodmanSandboxConfig, ro_binds: Sequence[Path] = (),
                 proxy_port: int | None = None, proxy_socket: Path | None = None) -> None:
        self.config = config
        self.ro_binds = tuple(Path(p).resolve() for p in ro_binds)
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        """This backend's id, the `harnessrl.owner` label of its containers."""
        if (proxy_port is None) != (proxy_socket is None):
            raise SandboxError(f"proxy_port={proxy_port} and proxy_socket={proxy_socket}: give both or neither")
        self.proxy: tuple[int, Path] | None = None
        if proxy_port is not None and proxy_socket is not None:
            self.proxy = (proxy_port, Path(proxy_socket))
        self.layers_problem = layers.layers_supported(layers.shareable(self.ro_binds)[0])
        """None when each sandbox gets private overlays of the agent trees, else why not."""
        self.seccomp_profile = seccomp_profile(config)
        """podman's default seccomp profile with new user namespaces refused (or None when
        the default profile is not found: then `unisolated` names the gap)."""
        if self.proxy is not None and proxy_socket is not None:
            # every sandbox's uid connects through its handle of the socket file itself; the
            # socket's own 0700 directory keeps every other host user out
            os.chmod(proxy_socket, 0o666)

    def unisolated(self) -> list[str]:
        """Gaps of isolation: none when podman runs (see `check_isolation`) with its default
        seccomp profile found (else nested user namespaces are not refused) and every agent
        tree gets a private overlay per sandbox (else locks and inotify on its files cross
        between sandboxes)."""
        gaps = []
        if self.seccomp_profile is None:
            gaps.append(f"nested user namespaces ({DEFAULT_SECCOMP} not found: podman's built-in profile is used)")
        if self.ro_binds and self.layers_problem is not None:
            gaps.append(f"agent trees shared between sandboxes (no private overlays: {self.layers_problem}; "
                        "flock and inotify on their files cross between sandboxes)")
        elif self.ro_binds:
            _, kept = layers.shareable(self.ro_binds)
            if kept:
                gaps.append("agent trees bound as they are, not directories or with a mount point below (flock and "
                            f"inotify on their files cross between sandboxes): {', '.join(map(str, kept))}")
        return gaps

    def check_isolation(self, mode: Literal["required", "best_effort"], concurrency: int = 1) -> list[str]:
        """Raises SandboxError naming the problem when podman sandboxes cannot run here, in
        either mode (there is no unisolated fallback), or when `concurrency` containers could
        take more than the host's file table allows (`sandbox/filetable.py`); otherwise removes
        the containers of dead runs (`remove_orphans`) and returns []. A run calls it once, at
        start."""
        problem = podman_problem(self.config)
        if problem is not None:
            raise SandboxError(f"sandbox.kind = 'podman' cannot run here: {problem}")
        check_file_table(self.config.max_processes, self.config.max_open_files, concurrency)
        for gap in self.unisolated():
            log.warning("podman sandboxes do not isolate: %s", gap)
        removed = remove_orphans(self.config)
        if removed:
            log.warning("removed %d podman sandbox containers left by runs that are gone", removed)
        mounts = remove_orphan_mounts()
        if mounts:
            log.warning("unmounted the agent-tree overlays of %d podman sandboxes left by runs that are gone", mounts)
        return []

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> PodmanSandbox:
        """A new sandbox whose workdir holds a fresh copy of `workspace` (path -> text).
        Raises SandboxError when a workspace path is absolute or escapes the workdir."""
        sandbox_id = f"{_UNSAFE.sub('_', rollout_id)[:64]}-{secrets.token_hex(4)}"
        root = self.config.root_dir.resolve() / sandbox_id
        state = Path(tempfile.mkdtemp(prefix=f"{STATE_PREFIX}{os.getpid()}-{sandbox_id}-"))
        sandbox: PodmanSandbox | None = None
        uid = owners.allocate()
        try:
            # a killed run's sandbox (its containers too) is swept at the next start
            sweep.claim(root.parent, sandbox_id, podman_argv(self.config))
            root.mkdir(parents=True, mode=0o700)
            if os.stat(root.parent).st_uid == 0:
                # root's and 0700: no host user reaches a sandbox (nor a setuid file planted in
                # one), whatever an agent does to its own directory's mode
                os.chmod(root.parent, 0o700)
            os.chown(root, uid, uid)
            for sub in ("work", "home", "tmp"):
                (root / sub).mkdir(mode=0o700)
                os.chown(root / sub, uid, uid)
            sandbox = PodmanSandbox(sandbox_id, root, state, self, uid)
            if self.layers_problem is None:
                await asyncio.to_thread(sandbox._mount_trees)
            if self.proxy is not None:
                sandbox._open_socket()
            for rel_path, text in workspace.items():
                if Path(rel_path).is_absolute():
                    raise SandboxError(f"workspace path {rel_path!r} is absolute")
                sandbox.write_file(rel_path, text)
        except BaseException:
            if sandbox is not None and sandbox._socket is not None:
                os.close(sandbox._socket)
            remove_tree(root)
            layers.unmount_below(state)
            remove_tree(state)
            owners.release(uid)
            sweep.release(root.parent, sandbox_id)
            raise
        return sandbox
