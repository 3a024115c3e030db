"""The unprivileged host owner of each sandbox: a uid/gid of its own, never root.

Responsibility: when harnessrl runs as root, give every local sandbox a host uid (and the
same gid) that no account and no other live sandbox of this process uses: bubblewrap is
started by root to set the mounts up, then the command drops to that uid (`sandbox/bwrap.py`,
`owner_prefix`). The sandbox directory and its `work/`, `home/` and `tmp/` belong to it (0700);
the sandbox root holding every sandbox directory is root's and 0700, so no other host user
reaches a sandbox, whatever an agent does to its own directory's mode. Root-only host files (`/etc/shadow`), host device
nodes and the proxy socket are then someone else's inodes to the agent: it cannot read,
chmod or own them. A uid per sandbox (rather than one shared account) also keeps per-user
kernel budgets (inotify instances, RLIMIT_NPROC) and setuid files apart between sandboxes.

Which uids: `UID_BASE` + a random offset below `UID_SPAN`, skipping names in the passwd and
group databases and uids this process has handed out and not released. No account is created
(nothing to set up, nothing left after a crash); files of a removed sandbox go with it. Two
harnessrl processes on one host draw independently: a collision needs the same draw among
`UID_SPAN` (16.7 million) values while both sandboxes live.

Not used when harnessrl is not root: bubblewrap then runs as the calling user, mapped to uid
1000 in its own user namespace, and the isolation report says so.
"""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import threading

UID_BASE = 1_600_000_000
"""First host uid sandboxes are drawn from (above the ranges distributions and subuid files use)."""
UID_SPAN = 1 << 24

_lock = threading.Lock()
_in_use: set[int] = set()


def _named(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return True
    except KeyError:
        return False


def allocate() -> int:
    """A fresh host uid (= gid) for one sandbox; give it back with `release`."""
    with _lock:
        while True:
            uid = UID_BASE + secrets.randbelow(UID_SPAN)
            if uid not in _in_use and not _named(uid):
                _in_use.add(uid)
                return uid


def release(uid: int) -> None:
    """Return `uid` once its sandbox is removed (no process and no file of it is left)."""
    with _lock:
        _in_use.discard(uid)


def owned_sandboxes() -> bool:
    """True when sandboxes get their own unprivileged owner here: this process is root."""
    return os.geteuid() == 0
