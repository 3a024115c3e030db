"""Private read-only views of the trees every sandbox shares: one overlay mount per tree.

Responsibility: give a command its own inodes for the host trees bound read-only into every
sandbox (the system directories, agent install trees, an interpreter's prefix), so that
nothing one sandbox does to such a file is visible to another through it. Bound as they are,
those files are one inode in every sandbox: an `inotify` watch in one sees another's
opens and reads of them (IN_OPEN, IN_ACCESS, IN_CLOSE_NOWRITE), and a `flock` on one is held
against every other (bubblewrap's seccomp filter turns locks into no-ops; podman has no such
filter). Through an overlay mount the file a command opens is an inode of that overlay's own
superblock: events and locks stay on it, and the lower (host) file gets neither.

How: `TreeLayers.mount()` runs in a freshly forked child before it execs (as root): a new
mount namespace (propagation private, so nothing reaches the host's), a small tmpfs over the
staging directory, then per tree `i` a read-only overlay at `<staging>/m<i>` whose layers are
the tree and an empty directory (a read-only overlay needs two). The layers are named
relative to the staging directory (`lowerdir=tree0:empty`, a symlink `tree0` to the tree),
which is all `/proc/self/mountinfo` shows of them: not the host path. The caller then binds
`source(i)` where it bound the tree. With `devices`, the command's device nodes are made in
the same tmpfs (`devices_dir`), so the device binds name no host directory either. With a proxy,
`socket_handle` leaves the command a descriptor of the proxy's agent socket on a detached
read-only bind, which the forwarder connects through instead of a bind (whose root field would
name the socket's host path). Everything goes with the mount namespace when the
command's last process exits; nothing is left on the host to clean up.

`host_mounts()` is used by `podman.py`, which cannot give the `podman` client a mount
namespace of its own: the same overlays in the same kind of tmpfs, mounted once per sandbox in
the host's namespace over `<state directory>/trees`, detached at `close()` in one lazy unmount
(`unmount_below`; a run killed by SIGKILL leaves them to `podman.remove_orphan_mounts`).

Trees with a mount point below them are not overlaid (an overlay shows only the tree's own
filesystem, so the submount would vanish), nor is a path that is not a directory;
`shareable()` names them and the caller binds them as before, listing them as a gap. Not covered: the page cache of the lower files (a timing
channel shared by every reader of the host's files) and the host's own accesses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harnessrl.sandbox.bwrap import make_devices

__all__ = ["TreeLayers", "detached_handle", "host_mounts", "layers_supported", "mount_points", "shareable", "unmount_below"]

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MNT_DETACH = 0x2
EMPTY = "empty"
"""Name of the empty directory every overlay uses as its second layer."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)
_OCTAL = re.compile(r"\\([0-7]{3})")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()),
           f"mount {fstype} on {target}")


def _overlays(staging: str, trees: Sequence[Path]) -> None:
    """In `staging` (a fresh tmpfs, the current directory): the empty layer, a link and a
    read-only overlay per tree."""
    os.mkdir(EMPTY, 0o755)
    for i, tree in enumerate(trees):
        os.symlink(str(tree), f"tree{i}")
        os.mkdir(f"m{i}", 0o755)
        _mount("overlay", f"{staging}/m{i}", "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV,
               f"lowerdir=tree{i}:{EMPTY}")


@dataclass(frozen=True, slots=True)
class TreeLayers:
    """Overlays of `trees` at `source(i)`, in a mount namespace of the command's own.

    `staging` is a root-owned directory no sandbox can see (the sandbox's `.dev-<id>`
    directory holds it); it stays empty on the host.
    """

    staging: Path
    trees: tuple[Path, ...]
    devices: bool = False
    """Also create the command's device nodes (`bwrap.make_devices`) in `devices_dir`."""

    @property
    def devices_dir(self) -> Path:
        """Where the command's own device nodes are (with `devices`)."""
        return self.staging / "dev"

    def source(self, i: int) -> Path:
        """Where the overlay of `trees[i]` is, for the command's mounts (bind it read-only)."""
        return self.staging / f"m{i}"

    def socket_handle(self, socket: Path, fd: int) -> None:
        """Put at descriptor `fd` (inheritable) a `detached_handle` of `socket` (the proxy's
        agent socket), made in the staging tmpfs. Call in the child after `mount`."""
        handle = detached_handle(socket, self.staging / "sock")
        try:
            os.dup2(handle, fd, inheritable=True)
        finally:
            os.close(handle)

    def mount(self) -> None:
        """Enter a new mount namespace (private propagation) and mount the overlays. Call in
        the child after fork, before exec (a `preexec_fn`); needs root. Raises OSError."""
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _mount("none", "/", "", MS_REC | MS_PRIVATE, "")
        staging = str(self.staging)
        _mount("tmpfs", staging, "tmpfs", MS_NOSUID | (0 if self.devices else MS_NODEV), "mode=0700,size=65536")
        back = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.chdir(staging)
            _overlays(staging, self.trees)
            if self.devices:
                make_devices(self.devices_dir)
        finally:
            os.fchdir(back)
            os.close(back)


def detached_handle(path: Path, target: Path) -> int:
    """An `O_PATH` descriptor (close-on-exec) of `path` (the proxy's agent socket) that names
    no host path: a read-only bind of it at `target` (a new file in a root-only directory),
    opened, then detached. A `connect` to `/proc/self/fd/<n>` of it reaches the socket; its
    link reads `/` (its mount is detached) and no mount table lists it; `chmod` is not its
    owner's and `utime` meets a read-only mount. Needs root. Raises OSError."""
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    _mount(str(path), str(target), "", MS_BIND, "")
    try:
        _mount("none", str(target), "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "")
        return os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    finally:
        _check(_libc.umount2(str(target).encode(), MNT_DETACH), f"umount {target}")


def host_mounts(staging: Path, trees: Sequence[Path]) -> list[Path]:
    """The overlays of `trees` mounted in the host's mount namespace under `staging` (an
    empty root-owned directory, made 0700): `staging/m<i>`. A short-lived child does the
    mounts (it changes directory to name the layers relatively; this process's other threads
    keep theirs). Undo with `unmount_below`. Raises OSError (what was mounted is unmounted)."""
    staging.mkdir(mode=0o700, exist_ok=True)

    def mount() -> None:
        # one tmpfs holds them all: `unmount_below` detaches it, and every overlay with it, at once
        _mount("tmpfs", str(staging), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,size=65536")
        os.chdir(staging)
        _overlays(str(staging), trees)

    try:
        subprocess.run(["true"], preexec_fn=mount, check=True, timeout=60, close_fds=True)
    except (OSError, subprocess.SubprocessError) as exc:
        unmount_below(staging)
        raise OSError(f"overlays of {len(trees)} trees under {staging} not mounted: {exc}") from exc
    return [staging / f"m{i}" for i in range(len(trees))]


def mount_points() -> list[str]:
    """Mount points of this process's mount namespace (`/proc/self/mountinfo`, unescaped)."""
    points = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    points.append(_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4]))
    except OSError:
        pass
    return points


def unmount_below(directory: Path) -> list[str]:
    """Detach every mount at or below `directory` (a lazy unmount of the outermost ones, which
    takes the mounts below each with it); returns what failed."""
    prefix = str(directory).rstrip("/")
    failed: list[str] = []
    detached: list[str] = []
    for point in sorted((p for p in mount_points() if p == prefix or p.startswith(prefix + "/")), key=len):
        if any(point == d or point.startswith(d + "/") for d in detached):
            continue
        if _libc.umount2(point.encode(), MNT_DETACH) != 0:
            failed.append(f"{point}: {os.strerror(ctypes.get_errno())}")
        else:
            detached.append(point)
    return failed


def shareable(trees: Sequence[Path]) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(`trees` that can be overlaid, those bound as they are: not a directory, or a mount
    point below them)."""
    points = mount_points()
    ok: list[Path] = []
    kept: list[Path] = []
    for tree in trees:
        prefix = str(tree).rstrip("/") + "/"
        (kept if not tree.is_dir() or any(p.startswith(prefix) for p in points) else ok).append(tree)
    return tuple(ok), tuple(kept)


@functools.cache
def layers_supported(trees: tuple[Path, ...] = (Path("/usr"),)) -> str | None:
    """None when this process can mount the overlays of `trees` (root, overlayfs, mount
    namespaces, each tree's filesystem usable as a layer), else why not. Checked once per
    process and set of trees by running `true` under `TreeLayers.mount`."""
    if os.geteuid() != 0:
        return "not root (overlays need CAP_SYS_ADMIN)"
    try:
        probe = Path(tempfile.mkdtemp(prefix=".harnessrl-layers-probe-"))
    except OSError as exc:
        return f"no directory for the probe: {exc}"
    try:
        layers = TreeLayers(probe, trees, devices=True)
        done = subprocess.run(["true"], preexec_fn=layers.mount, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"overlay mounts failed: {exc}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None if done.returncode == 0 else f"overlay mounts failed: exit {done.returncode}"
