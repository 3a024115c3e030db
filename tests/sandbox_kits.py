"""The sandbox backends the attack suite runs against, and the podman gate of the container tests.

`KITS` names each backend's way of building a `SandboxBackend` plus the few expectations that
truly differ between them (the agent's uid, how many pids its /proc shows, which mount holds
the read-only system tree). `podman_gate()` skips a podman test where podman cannot run, or
fails it when `HARNESSRL_REQUIRE_PODMAN=1` (`.ci/run` sets it); `assert_no_podman_leftovers()`
checks that no harnessrl container or sandbox cgroup outlived its sandbox.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harnessrl.sandbox import cgroup
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.config import PodmanSandboxConfig, SandboxConfig


@functools.cache
def podman_problem() -> str | None:
    """Why podman sandboxes of the default config cannot run here (None: they can)."""
    from harnessrl.sandbox.podman import podman_problem as problem

    return problem(PodmanSandboxConfig())


def podman_gate() -> None:
    """Skip (or, under `HARNESSRL_REQUIRE_PODMAN=1`, fail) when podman sandboxes cannot run."""
    problem = podman_problem()
    if problem is None:
        return
    if os.environ.get("HARNESSRL_REQUIRE_PODMAN") == "1":
        pytest.fail(f"HARNESSRL_REQUIRE_PODMAN=1 but podman sandboxes cannot run: {problem}")
    pytest.skip(f"podman sandboxes cannot run here: {problem}")


def assert_no_podman_leftovers() -> None:
    """No harnessrl sandbox container of this process (its `harnessrl.owner` label starts with
    this pid; another test run may share the store) and no sandbox cgroup at all is left (the
    cgroups carry no owner: a podman test run at the same time on this host fails this)."""
    from harnessrl.sandbox.podman import CGROUP_PARENT, OWNER_LABEL, podman_argv

    rows = subprocess.run([*podman_argv(PodmanSandboxConfig()), "ps", "-a", "--filter", f"label={OWNER_LABEL}",
                           "--format", f'{{{{.ID}}}} {{{{index .Labels "{OWNER_LABEL}"}}}}'],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    left = [row for row in rows if row.partition(" ")[2].split("-", 1)[0] == str(os.getpid())]
    assert left == [], "containers left after every sandbox closed"
    cgroups = list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/*/"))
    assert cgroups == [], "sandbox cgroups left after every sandbox closed"


@dataclass(frozen=True)
class Kit:
    """One sandbox backend under test.

    Attributes:
        name: "bwrap" (local, bubblewrap), "plain" (local, no bubblewrap) or "podman".
        make: (root_dir, ro_binds, {proxy_port, proxy_socket} or {}, **config) -> a SandboxBackend.
        uid: the uid commands run as (None: any non-root uid).
        max_pids: most pids an attacker's /proc lists (its own command and helpers).
        ro_system: a read-only system mount the attack tries to remount ("/usr" or "/").
        namespaced: every command is its own PID namespace (a daemon dies with its command).
        cgroup_bounded: its process count is bounded (else fork-bomb cases skip).
        disk_overshoot: how many times `disk_bytes` a fast writer may reach before the watchdog's
            kill lands (both backends kill from the host at once: bubblewrap's process groups,
            podman's container cgroups).
    """

    name: str
    make: Callable[..., Any]
    uid: int | None
    max_pids: int
    ro_system: str
    namespaced: bool
    cgroup_bounded: bool
    disk_overshoot: int = 8

    def backend(self, root: Path, proxy: Any = None, ro_binds: tuple[Path, ...] = (), **config: object) -> Any:
        """A backend of this kind under `root`, routed to `proxy` (a ProxyServer) when given."""
        route = {} if proxy is None else {"proxy_port": proxy.port, "proxy_socket": proxy.agent_socket_path}
        return self.make(root, ro_binds, route, **config)


def _local(use_bwrap: bool) -> Callable[..., Any]:
    def make(root: Path, ro_binds: tuple[Path, ...], route: dict[str, Any], **config: object) -> Any:
        from harnessrl.sandbox.local import LocalSandboxBackend

        cfg = SandboxConfig(root_dir=root, use_bwrap=use_bwrap, **config)  # type: ignore[arg-type]
        return LocalSandboxBackend(cfg, ro_binds=ro_binds, **route)

    return make


def _podman(root: Path, ro_binds: tuple[Path, ...], route: dict[str, Any], **config: object) -> Any:
    from harnessrl.sandbox.podman import PodmanSandboxBackend

    cfg = PodmanSandboxConfig(root_dir=root, **config)  # type: ignore[arg-type]
    return PodmanSandboxBackend(cfg, ro_binds=ro_binds, **route)


KITS = {
    "bwrap": Kit("bwrap", _local(True), uid=None, max_pids=4, ro_system="/usr", namespaced=True,
                 cgroup_bounded=cgroup.available() is not None),
    "plain": Kit("plain", _local(False), uid=None, max_pids=1 << 30, ro_system="/usr", namespaced=False,
                 cgroup_bounded=cgroup.available() is not None),
    "podman": Kit("podman", _podman, uid=None, max_pids=2, ro_system="/", namespaced=True, cgroup_bounded=True),
}


def kit_available(name: str) -> None:
    """Skip (or fail, for podman under `HARNESSRL_REQUIRE_PODMAN=1`) when kit `name` cannot run."""
    if name == "bwrap" and bwrap_path() is None:
        pytest.skip("bubblewrap (bwrap) is not installed or cannot run")
    if name == "podman":
        podman_gate()
