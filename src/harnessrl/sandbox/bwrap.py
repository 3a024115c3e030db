"""The bubblewrap (`bwrap`) command line that wraps every command of a local sandbox.

Responsibility: turn "run argv with this sandbox directory writable" into a `bwrap` argv.

Who the command is. Started by root (`owner` given): the sandbox's own unprivileged host
uid/gid (`sandbox/owner.py`); bubblewrap makes no user namespace (root sets up the mounts,
reaching any host path), keeps only CAP_SETUID / CAP_SETGID / CAP_SETPCAP, and `setpriv`
drops to the owner with no supplementary group, every capability set and the bounding set
empty and no_new_privs before the command (`owner_prefix`). Started by anyone else: uid/gid
`SANDBOX_UID` inside a new user namespace, mapped to the calling uid outside,
`--cap-drop ALL`, `--disable-userns`. Either way CapEff, CapPrm, CapBnd and CapAmb are 0, a
seccomp filter (`sandbox/seccomp.py`) refuses kernel surface, ptrace and new user namespaces,
and the command is in a new session (`--new-session`: no TIOCSTI into our terminal).
Without CAP_SYS_ADMIN, CAP_DAC_READ_SEARCH and the rest it cannot mount or remount (and
bind mounts made by a more privileged namespace are locked read-only anyway), cannot use
`open_by_handle_at`, and cannot ptrace or signal anything outside its PID namespace.

The namespaces a command gets: user (when not started by root), PID (`/proc` shows only its own processes), mount, IPC,
UTS and network. The network namespace holds only `lo`: nothing is routed, no DNS. When a
`ProxyRoute` is given, the proxy's agent Unix socket is bound read-only at `INNER_SOCKET`
(connect works; chmod and utime do not) or, started by root with overlays, handed to the
forwarder as a descriptor of a detached read-only bind (`socket_fd`, `layers.TreeLayers.socket_handle`:
no mount of it, so the mount table does not name its host path), a copy of `forward.py` is placed
under `INNER_DIR`, and the command runs under `sandbox/forward.py`, which listens on `127.0.0.1:<port>` inside the
namespace and relays to that socket: the agent's one reachable address is its proxy endpoint
(the admin listener and every other host port stay out of reach).

The mount namespace a command sees:
  * read-only: the system directories in `system_paths` that exist (symlinks such as
    `/bin -> usr/bin` are recreated as symlinks), every path of `ro_binds` (an agent's install
    tree, mounted at `INNER_TREES/<its name>` when `points` says so), the running interpreter's `sys.prefix` / `sys.base_prefix` when asked, `/dev`
    (a minimal device set: started by root, the sandbox's own nodes, see `make_devices`),
    the root directory and the sandbox root. Started by root, each of those trees is bound
    from `sources`: the command's own overlay of it (`sandbox/layers.py`), so no inode of it is
    shared with another sandbox (no inotify or lock channel) and the mount table names no
    host path for it;
  * writable: the sandbox directory only, at the same absolute path as outside (so paths
    printed by the agent mean the same thing to the verifier), a private `/tmp` and a
    private `/dev/shm`, each a tmpfs of at most `tmp_bytes`;
  * invisible: everything else of the host filesystem, including other sandboxes (the
    sandbox root is covered by a tmpfs before this sandbox's directory is bound back).

Host-wide figures: `/proc/loadavg`, `/proc/stat`, `/proc/meminfo`, `/proc/sys/fs/file-nr` and
`/proc/sys/fs/inode-nr` are constant files (`MASKED_PROC`), so no sandbox reads what the
others do through them.

Not isolated here: CPU, memory, process count and disk use (bounded by the local sandbox:
pids and memory cgroups and a disk watchdog, see `sandbox/local.py`), and the host kernel
itself (a kernel exploit crosses any namespace). `/proc/self/mountinfo` still names the
sandbox directory's host path: it is bound at its own path, and a bind's root field is its
source's path on that filesystem whatever the mount point (only a filesystem of its own per
sandbox would hide it); without overlays (not root) also the proxy socket's path, by the same
field.

`--die-with-parent` kills the command when the process that started bwrap dies;
`--unshare-pid` makes bwrap's child the namespace's init, so every process left in the
namespace is killed when it exits, whatever session it moved to. Consequence: a daemon started
by an `exec` command (`setsid ... &`, `nohup ... &`) ends with that command; processes an agent
starts live as long as the agent does.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SYSTEM_PATHS: tuple[str, ...] = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
)
"""Host paths bound read-only into every sandbox (those that exist)."""


@functools.cache
def bwrap_path() -> str | None:
    """Absolute path of a working `bwrap`, or None when absent or unable to create namespaces.

    Checked once per process by running `true` with every namespace and option
    `bwrap_argv` uses (a kernel or container that forbids user or network namespaces fails it).
    """
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = [path, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-user",
             "--uid", str(SANDBOX_UID), "--disable-userns", "--unshare-pid", "--unshare-net",
             "--cap-drop", "ALL", "--remount-ro", "/"]
    try:
        done = subprocess.run([*probe, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def _system_args(system_paths: Sequence[str], sources: Mapping[str, Path]) -> list[str]:
    args: list[str] = []
    for p in system_paths:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", str(sources.get(p, p)), p]
    return args


SANDBOX_UID = 1000
"""uid and gid of every sandboxed command inside its user namespace."""
INNER_DIR = "/run/harnessrl"
"""Directory, inside a sandbox, holding the proxy socket and the forwarder script."""
INNER_SOCKET = f"{INNER_DIR}/proxy.sock"
INNER_FORWARDER = f"{INNER_DIR}/forward.py"
INNER_TREES = f"{INNER_DIR}/agents"
"""Directory, inside a sandbox, under which each read-only tree of `ro_binds` (an agent's
install tree) is mounted, by its own name (`inner_tree_points`), not at its host path."""
FORWARDER_SCRIPT = Path(__file__).with_name("forward.py")


def inner_tree_points(trees: Sequence[Path]) -> dict[Path, str]:
    """Where each of `trees` is mounted inside a sandbox: `INNER_TREES/<its name>` (a later
    tree of a name already taken gets `<name>-2`, `-3`, ...), so the mount table names no host
    path (`$HARNESSRL_CACHE/agents/...`) for it."""
    points: dict[Path, str] = {}
    taken: set[str] = set()
    for tree in trees:
        if tree in points:
            continue
        name = tree.name or "tree"
        candidate, n = name, 1
        while candidate in taken:
            n += 1
            candidate = f"{name}-{n}"
        taken.add(candidate)
        points[tree] = f"{INNER_TREES}/{candidate}"
    return points


def map_tree_path(points: Mapping[Path, str], host_path: Path) -> str:
    """`host_path` as a sandbox with trees mounted at `points` sees it: under a tree's mount
    point when it is under that tree (compared as given and resolved, the link itself kept),
    else unchanged."""
    candidates = [Path(host_path)]
    resolved_parent = Path(os.path.realpath(Path(host_path).parent)) / Path(host_path).name
    if resolved_parent != candidates[0]:
        candidates.append(resolved_parent)
    for candidate in candidates:
        for tree, inner in points.items():
            if candidate == tree:
                return inner
            if candidate.is_relative_to(tree):
                return f"{inner}/{candidate.relative_to(tree).as_posix()}"
    return str(host_path)


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """The one way out of a sandbox: `127.0.0.1:port` inside relays to `socket_path` outside.

    `python` is the interpreter (visible inside the sandbox) that runs the forwarder.
    """

    port: int
    socket_path: Path
    python: str


def forwarder_python(system_paths: Sequence[str]) -> tuple[str, list[Path]]:
    """An interpreter to run `forward.py` inside a sandbox, and what must be bound for it.

    A `python3` under the bound system paths needs nothing more; otherwise this process's
    own base interpreter is used and its `sys.base_prefix` must be bound read-only (the
    virtual environment, which may hold task data, is not).
    """
    for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidate = Path(directory) / "python3"
        covered = any(directory == p or directory.startswith(p.rstrip("/") + "/") for p in system_paths)
        if covered and candidate.exists() and Path(os.path.realpath(candidate)).is_relative_to("/usr"):
            return str(candidate), []
    base = Path(sys.base_prefix)
    return str(base / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"), [base]


MASKED_PROC = ("/proc/loadavg", "/proc/stat", "/proc/meminfo", "/proc/sys/fs/file-nr", "/proc/sys/fs/inode-nr")
"""Host-wide figures of `/proc` a sandbox sees as constants (`masked_proc_texts`): each moves
with what any process of the host does (a sibling's verifier opening files, allocating memory,
running tests), so a live agent could read another rollout's hidden test inputs through them."""


@functools.cache
def masked_proc_texts() -> dict[str, bytes]:
    """The constant text bound over each of `MASKED_PROC`: no load, no open files or inodes,
    all memory free (`_meminfo`), zero CPU times for each of this host's CPUs and its boot time (fixed while it runs), so
    tools that parse them (`os.cpus()`, `ps`, `uptime`) still work."""
    cpus = os.cpu_count() or 1
    btime = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            btime = next((int(line.split()[1]) for line in f if line.startswith("btime ")), 0)
    except (OSError, ValueError):
        pass
    zeros = " ".join(["0"] * 10)
    stat = f"cpu  {zeros}\n" + "".join(f"cpu{i} {zeros}\n" for i in range(cpus))
    stat += f"intr 0\nctxt 0\nbtime {btime}\nprocesses 0\nprocs_running 1\nprocs_blocked 0\nsoftirq 0\n"
    try:
        file_max = Path("/proc/sys/fs/file-max").read_text().split()[0]
    except (OSError, IndexError):
        file_max = "0"
    return {"/proc/loadavg": b"0.00 0.00 0.00 1/1 1\n", "/proc/stat": stat.encode(), "/proc/meminfo": _meminfo(),
            "/proc/sys/fs/file-nr": f"0\t0\t{file_max}\n".encode(), "/proc/sys/fs/inode-nr": b"0\t0\n"}


_MEMINFO_KEPT = ("MemTotal", "SwapTotal", "VmallocTotal", "Hugepagesize")
"""Lines of `/proc/meminfo` whose host value a sandbox sees: sizes fixed while the host runs."""


def _meminfo() -> bytes:
    """The host's `/proc/meminfo` with every line that moves made constant: the sizes of
    `_MEMINFO_KEPT` as they are, `MemFree` and `MemAvailable` equal to `MemTotal`, `SwapFree`
    to `SwapTotal`, every other figure 0 (same keys, order and layout, so `free`, `psutil` and
    Node's `os.freemem()` still parse it)."""
    try:
        lines = Path("/proc/meminfo").read_text(encoding="ascii").splitlines()
    except OSError:
        return b""
    values = {line.split(":", 1)[0]: line.split(":", 1)[1].split()[0] for line in lines if ":" in line}
    same = {"MemFree": "MemTotal", "MemAvailable": "MemTotal", "SwapFree": "SwapTotal"}
    out = []
    for line in lines:
        key, _, rest = line.partition(":")
        unit = " kB" if rest.strip().endswith("kB") else ""
        value = values.get(same.get(key, key), "0") if key in _MEMINFO_KEPT or key in same else "0"
        out.append(f"{key + ':':<16}{value:>8}{unit}")
    return ("\n".join(out) + "\n").encode()


DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
"""The device nodes of `bwrap --dev` (name -> major, minor). A root-started sandbox gets its
own nodes of them (`make_devices`), so `utime` on one changes nothing of the host's or another
sandbox's (a read-only remount would also make them `nodev`, unusable)."""


def make_devices(directory: Path) -> None:
    """Create `directory` (root's, 0755) holding a node of each of `DEVICES`, mode 0666, owned
    by root. Needs root (CAP_MKNOD)."""
    directory.mkdir(mode=0o755)
    for name, (major, minor) in DEVICES.items():
        node = directory / name
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(node, 0o666)


@functools.cache
def setpriv_path() -> str | None:
    """util-linux `setpriv` under /usr (it drops a root-started command to its owner's uid)."""
    for candidate in ("/usr/bin/setpriv", "/bin/setpriv"):
        if os.path.exists(candidate) and os.path.realpath(candidate).startswith("/usr/"):
            return os.path.realpath(candidate)
    return None


def _mount_parents(targets: Sequence[Path], system_paths: Sequence[str]) -> list[str]:
    """The directories above `targets` that bubblewrap creates in its new root (not `/`,
    `/tmp` or anything under a bound system path), outermost first, each once."""
    covered = [p.rstrip("/") for p in system_paths]
    out: list[str] = []
    for target in targets:
        for parent in reversed(Path(target).parents):
            text = str(parent)
            if text in ("/", "/tmp") or any(text == c or text.startswith(c + "/") for c in covered) or text in out:
                continue
            out.append(text)
    return out


def owner_prefix(owner: int, cwd: Path) -> list[str]:
    """What a root-started bubblewrap runs first: become host uid/gid `owner` with no
    supplementary group, every capability set and the bounding set empty, no_new_privs, then
    change to `cwd` (as `owner`, who may enter directories root without capabilities may
    not) and exec the rest."""
    setpriv = setpriv_path()
    assert setpriv is not None, "checked by owner_supported()"
    return [setpriv, "--reuid", str(owner), "--regid", str(owner), "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/env", "-C", str(cwd), "--"]


def bwrap_argv(
    bwrap: str,
    argv: Sequence[str],
    *,
    sandbox_dir: Path,
    sandbox_root: Path,
    cwd: Path,
    ro_binds: Sequence[Path],
    system_paths: Sequence[str] = DEFAULT_SYSTEM_PATHS,
    tmp_bytes: int = 256 << 20,
    proxy: ProxyRoute | None = None,
    owner: int | None = None,
    seccomp_fd: int | None = None,
    forwarder_fd: int | None = None,
    devices: Path | None = None,
    sources: Mapping[str, Path] | None = None,
    points: Mapping[Path, str] | None = None,
    socket_fd: int | None = None,
    proc_fds: Mapping[str, int] | None = None,
) -> list[str]:
    """The full argv running `argv` inside bubblewrap for the sandbox at `sandbox_dir`.

    `tmp_bytes` bounds each of the private `/tmp` and `/dev/shm` (bytes). With `proxy`, the
    command runs under the forwarder (see the module docstring), so `127.0.0.1:proxy.port`
    inside reaches the proxy's agent socket; `forwarder_fd` then holds `forward.py`'s text
    (a memfd), copied into the sandbox, so no host file is shared or named.

    `owner`: when bubblewrap is started by root, the unprivileged host uid (and gid) the
    command runs as; bubblewrap then makes no user namespace (root sets the mounts up) and
    `owner_prefix` drops to `owner` before the command. None: bubblewrap runs as the calling
    user and maps it to `SANDBOX_UID` in a new user namespace. `seccomp_fd`: a descriptor
    holding `sandbox/seccomp.py`'s filter (bubblewrap loads it before the command).
    `devices`: a `make_devices` directory whose nodes replace the host's in `/dev`.
    `sources`: for a system path or `ro_binds` entry (as a string), what to bind there instead
    of the host tree itself: its private overlay (`sandbox/layers.py`). `points`: where an
    entry of `ro_binds` is mounted inside (`inner_tree_points`); one not in it is mounted at
    its own path. `socket_fd`: a descriptor the command inherits holding an `O_PATH` handle
    of the proxy socket (`TreeLayers.socket_handle`); the forwarder then connects through it
    and the socket is not bound at `INNER_SOCKET`. `proc_fds`: for each of `MASKED_PROC`, a
    descriptor holding the constant text bound over it (`masked_proc_texts`).

    The environment is not touched (bwrap passes its own environment to the command), so the
    caller builds it. Mount order matters: later mounts cover earlier ones, so the tmpfs over
    `sandbox_root` comes before the bind of `sandbox_dir`, `ro_binds` come after, and the
    read-only remounts of `/dev` (and each device node), the sandbox root and `/` come last.
    """
    args = [bwrap, "--die-with-parent", "--new-session"]
    if owner is None:
        uid = str(SANDBOX_UID)
        args += ["--unshare-user", "--uid", uid, "--gid", uid, "--disable-userns"]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--cap-drop", "ALL"]
    if owner is not None:
        # only what setpriv needs to drop to the owner; it then empties every set
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    sources = sources or {}
    args += _system_args(system_paths, sources)
    size = str(tmp_bytes)
    args += ["--proc", "/proc", "--dev", "/dev"]
    for path, fd in (proc_fds or {}).items():
        args += ["--perms", "0444", "--ro-bind-data", str(fd), path]
    if devices is not None:
        for name in DEVICES:
            args += ["--dev-bind", str(devices / name), f"/dev/{name}"]
    args += ["--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp"]
    if owner is not None:  # root made them 0755
        args += ["--chmod", "1777", "/dev/shm", "--chmod", "1777", "/tmp"]
    if owner is not None:
        # bubblewrap gives the directories it creates for a mount point the host's modes (a
        # 0700 /root above an agent tree): open them for the owner, read-only like the rest
        targets = [Path((points or {}).get(p, str(p))) for p in ro_binds]
        for parent in _mount_parents([sandbox_root, *targets], system_paths):
            args += ["--perms", "0755", "--dir", parent]
    args += ["--tmpfs", str(sandbox_root)]
    args += ["--bind", str(sandbox_dir), str(sandbox_dir)]
    for p in ro_binds:
        args += ["--ro-bind", str(sources.get(str(p), p)), (points or {}).get(p, str(p))]
    prefix: list[str] = []
    if proxy is not None:
        if forwarder_fd is not None:
            args += ["--perms", "0444", "--ro-bind-data", str(forwarder_fd), INNER_FORWARDER]
        else:
            args += ["--ro-bind", str(FORWARDER_SCRIPT), INNER_FORWARDER]
        if socket_fd is not None:
            # a descriptor of the socket (on a detached read-only mount): no mount of it
            # shows the socket's host path, as a bind's root field would
            inner = f"/proc/self/fd/{socket_fd}"
        else:
            # read-only: the agent can connect, never chmod it or carry a value in its times
            args += ["--ro-bind", str(proxy.socket_path), INNER_SOCKET]
            inner = INNER_SOCKET
        prefix = [proxy.python, "-I", "-S", INNER_FORWARDER, str(proxy.port), inner, "--"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--remount-ro", "/dev", "--remount-ro", str(sandbox_root), "--remount-ro", "/"]
    if owner is not None:
        args += ["--chdir", "/", "--", *owner_prefix(owner, cwd), *prefix, *argv]
    else:
        args += ["--chdir", str(cwd), "--", *prefix, *argv]
    return args
