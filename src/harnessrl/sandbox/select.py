"""Choosing the sandbox backend of a run from `[sandbox]` (`sandbox.kind`).

Responsibility: one place that maps a validated sandbox config to its backend class, so the
runtime never names a backend. `local` is the default; `podman` is imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from harnessrl.sandbox.config import PodmanSandboxConfig, SandboxConfig
from harnessrl.sandbox.local import LocalSandboxBackend
from harnessrl.sandbox.podman import PodmanSandboxBackend

if TYPE_CHECKING:
    from harnessrl.sandbox.local import LocalSandboxBackend
    from harnessrl.sandbox.podman import PodmanSandboxBackend


def make_backend(config: SandboxConfig | PodmanSandboxConfig, ro_binds: Sequence[Path] = (),
                 proxy_port: int | None = None, proxy_socket: Path | None = None
                 ) -> LocalSandboxBackend | PodmanSandboxBackend:
    """The backend of `config.kind`, given the agents' read-only install trees and the proxy's
    agent port and socket (both or neither). Raises `SandboxError` as the backend does."""
    if isinstance(config, PodmanSandboxConfig):
        return PodmanSandboxBackend(config, ro_binds=ro_binds, proxy_port=proxy_port, proxy_socket=proxy_socket)

    return LocalSandboxBackend(config, ro_binds=ro_binds, proxy_port=proxy_port, proxy_socket=proxy_socket)


def system_packages(config: SandboxConfig | PodmanSandboxConfig,
                    isolation: Literal["required", "best_effort"] = "best_effort") -> dict[str, str]:
    """The Debian packages a run with sandbox `config` needs on this machine, each mapped to the
    command that shows it is installed: podman needs `podman` and `runc`; a local sandbox needs
    bubblewrap when `use_bwrap` is True or its isolation (`config.isolation`, else the command's
    default `isolation`: "required" for `harnessrl train`) is "required". The Makefile installs
    these (`TRAIN_PACKAGES`, `PODMAN_PACKAGES`); `tests/test_system_packages.py` keeps the two
    in step."""
    if isinstance(config, PodmanSandboxConfig):
        return {"podman": "podman", "runc": "runc"}
    if config.use_bwrap or (config.use_bwrap is None and (config.isolation or isolation) == "required"):
        return {"bubblewrap": "bwrap"}
    return {}
