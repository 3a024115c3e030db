"""The seccomp filter of every bubblewrap sandbox: a classic-BPF deny list, built here.

Responsibility: `program()` returns the filter `bwrap --seccomp FD` loads before it execs a
sandbox's command (inherited by every descendant, never removable). It is written by hand
with `struct` (no libseccomp needed): check the architecture, then the syscall number.

What it refuses (EPERM unless noted), on x86_64 and aarch64:
  * kernel attack surface an agent never needs: `keyctl`, `add_key`, `request_key`,
    `perf_event_open`, `userfaultfd`, `io_uring_setup` / `_enter` / `_register`, `bpf`,
    `kcmp`, `lookup_dcookie`, `fanotify_init`, `name_to_handle_at`, `open_by_handle_at`;
  * reaching other processes of the sandbox (e.g. the proxy forwarder): `ptrace`,
    `process_vm_readv`, `process_vm_writev`;
  * new namespaces and mounts: `unshare`, `setns`, `clone` with `CLONE_NEWUSER`, `clone3`
    (ENOSYS: its flags are behind a pointer a filter cannot read; glibc then falls back to
    `clone`), `mount`, `umount2`, `pivot_root`, the new mount API (`fsopen`, `fsconfig`,
    `fsmount`, `fspick`, `open_tree`, `move_mount`, `mount_setattr`), module and kexec
    loading, `reboot`, `swapon` / `swapoff`, `acct`, `quotactl`, `syslog`;
  * file locks, which would be a channel between sandboxes through the read-only files they
    share (system directories, agent trees; started by root, each command sees them through
    overlays of its own, `sandbox/layers.py`, and this is the second layer): `flock` and `fcntl` F_SETLK / F_SETLKW /
    F_OFD_SETLK / F_OFD_SETLKW succeed without taking a lock (return 0). Processes of one
    sandbox therefore get no mutual exclusion from them either.
  * socket families other than `SOCKET_FAMILIES` (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: what
    agents, their tools and the resolver use) for `socket`, and other than AF_UNIX for
    `socketpair`: EAFNOSUPPORT, so no `AF_VSOCK` (a way to the host or a hypervisor), packet,
    Bluetooth, CAN, ... socket opens;
  * on x86_64, every x32 syscall (numbers with bit 30 set); any other architecture (i386
    through `int 0x80`) kills the process.

Sources: the numbers are the kernel's (`arch/x86/entry/syscalls/syscall_64.tbl`,
`include/uapi/asm-generic/unistd.h` for aarch64); the layout of `struct seccomp_data` and the
return values are `include/uapi/linux/seccomp.h`; the instruction encoding is
`include/uapi/linux/filter.h` / `bpf_common.h`.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

__all__ = ["UnsupportedArch", "program", "program_fd"]

# BPF instruction classes and fields (linux/bpf_common.h)
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K

_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

_OFF_NR, _OFF_ARCH = 0, 4
_OFF_ARG = (16, 24, 32, 40, 48, 56)  # low 32 bits of args[i] (little endian)

CLONE_NEWUSER = 0x10000000
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
"""The address families `socket()` may open in a sandbox (`include/linux/socket.h`)."""
SOCKETPAIR_FAMILIES = {"AF_UNIX": 1}
_LOCK_CMDS = (6, 7, 37, 38)  # F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW

_X86_64 = {
    "arch": 0xC000003E, "x32": True,
    "eperm": {"keyctl": 250, "add_key": 248, "request_key": 249, "perf_event_open": 298,
              "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
              "io_uring_register": 427, "bpf": 321, "kcmp": 312, "lookup_dcookie": 212,
              "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304,
              "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
              "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
              "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "open_tree": 428,
              "move_mount": 429, "mount_setattr": 442, "init_module": 175, "finit_module": 313,
              "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
              "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103},
    "enosys": {"clone3": 435}, "clone": 56, "flock": 73, "fcntl": 72,
}
_AARCH64 = {
    "arch": 0xC00000B7, "x32": False,
    "eperm": {"keyctl": 219, "add_key": 217, "request_key": 218, "perf_event_open": 241,
              "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
              "io_uring_register": 427, "bpf": 280, "kcmp": 272, "lookup_dcookie": 18,
              "fanotify_init": 262, "name_to_handle_at": 264, "open_by_handle_at": 265,
              "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
              "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
              "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "open_tree": 428,
              "move_mount": 429, "mount_setattr": 442, "init_module": 105, "finit_module": 273,
              "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142,
              "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116},
    "enosys": {"clone3": 435}, "clone": 220, "flock": 32, "fcntl": 25,
}
_TABLES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}
_SOCKET_CALLS: dict[str, tuple[int, int]] = {"x86_64": (41, 53), "amd64": (41, 53), "aarch64": (198, 199),
                                             "arm64": (198, 199)}
"""Numbers of `socket` and `socketpair` per architecture (the same sources as the tables)."""


class UnsupportedArch(RuntimeError):
    """No syscall table for this machine's architecture (bubblewrap then runs without it)."""


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _deny(nr: int, ret: int) -> bytes:
    """`if nr == NR: return ret` (the loaded word must be the syscall number)."""
    return _ins(_JEQ_K, nr, 0, 1) + _ins(_RET_K, ret)


def _families(nr: int, allowed: list[int]) -> list[bytes]:
    """`if nr == NR: allow when args[0] is one of allowed, else EAFNOSUPPORT`; leaves the loaded
    word (the syscall number) untouched when nr is another syscall."""
    n = len(allowed)
    out = [_ins(_JEQ_K, nr, 0, n + 3), _ins(_LD_W_ABS, _OFF_ARG[0])]
    out += [_ins(_JEQ_K, family, n - i, 0) for i, family in enumerate(allowed)]
    return [*out, _ins(_RET_K, _RET_ERRNO | errno.EAFNOSUPPORT), _ins(_RET_K, _RET_ALLOW)]


def program(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes for `machine` (default: this one's
    `platform.machine()`). Raises UnsupportedArch for an architecture without a table."""
    arch = (machine or platform.machine()).lower()
    table = _TABLES.get(arch)
    if table is None:
        raise UnsupportedArch(f"no seccomp syscall table for {machine or platform.machine()!r}")
    eperm = _RET_ERRNO | errno.EPERM
    out = [_ins(_LD_W_ABS, _OFF_ARCH), _ins(_JEQ_K, table["arch"], 1, 0), _ins(_RET_K, _RET_KILL_PROCESS),
           _ins(_LD_W_ABS, _OFF_NR)]
    if table["x32"]:
        out += [_ins(_JGE_K, 0x40000000, 0, 1), _ins(_RET_K, eperm)]
    out += [_deny(nr, eperm) for nr in table["eperm"].values()]
    out += [_deny(nr, _RET_ERRNO | errno.ENOSYS) for nr in table["enosys"].values()]
    out.append(_deny(table["flock"], _RET_ERRNO | 0))  # succeeds, takes no lock
    # clone: refuse CLONE_NEWUSER in its flags (args[0] on both architectures)
    out += [_ins(_JEQ_K, table["clone"], 0, 3), _ins(_LD_W_ABS, _OFF_ARG[0]),
            _ins(_JSET_K, CLONE_NEWUSER, 0, 1), _ins(_RET_K, eperm)]
    out.append(_ins(_LD_W_ABS, _OFF_NR))
    # socket families: an allow-list (the number stays loaded for the blocks after)
    socket_nr, socketpair_nr = _SOCKET_CALLS[arch]
    out += _families(socket_nr, list(SOCKET_FAMILIES.values()))
    out += _families(socketpair_nr, list(SOCKETPAIR_FAMILIES.values()))
    # fcntl: the lock-setting commands succeed without locking (args[1] is the command)
    checks = [_ins(_JEQ_K, cmd, len(_LOCK_CMDS) - 1 - i, 0) for i, cmd in enumerate(_LOCK_CMDS)]
    out += [_ins(_JEQ_K, table["fcntl"], 0, 2 + len(checks)), _ins(_LD_W_ABS, _OFF_ARG[1]), *checks[:-1]]
    last_cmd = _LOCK_CMDS[-1]
    out += [_ins(_JEQ_K, last_cmd, 0, 1), _ins(_RET_K, _RET_ERRNO | 0)]
    out.append(_ins(_RET_K, _RET_ALLOW))
    return b"".join(out)


def program_fd(machine: str | None = None) -> int:
    """A memfd holding `program()`, positioned at 0 (for `bwrap --seccomp FD`; the caller
    closes it once bwrap started)."""
    fd = os.memfd_create("harnessrl-seccomp", os.MFD_CLOEXEC)
    data = program(machine)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
