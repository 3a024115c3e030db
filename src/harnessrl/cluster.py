"""A simulated cluster on one machine: hosts as network namespaces joined by a private bridge.

Responsibility: rehearse a multi-host run (trainer, vLLM server, Ray nodes on separate hosts)
on one Linux machine, faithfully where the network is concerned. `SimCluster.up()` makes

* a bridge `<prefix>-br` with NO address of its own: the machine's own namespace has no route
  into the subnet and the hosts none out of it (no default route, no NAT), so traffic flows
  only between the hosts;
* one network namespace `<prefix>-<host>` per host, joined to the bridge by a veth pair
  (`<prefix>-v<i>` on the bridge, `eth0` inside), with the address `<subnet>.<i + 1>/24` and
  its own loopback up. A service a host binds on its address is reachable from the other
  hosts; one bound on a host's `127.0.0.1` (or anything of the machine's own namespace) is not.

`run(host, argv)` starts a process inside a host (`ip netns exec`), `down()` ends every process
left in the hosts (SIGTERM, then SIGKILL), deletes the namespaces, veth pairs and bridge; it
runs on exit, on SIGTERM and on Ctrl-C (`harnessrl cluster up`), and `up()` first removes what a
dead run of the same prefix left (`sweep`). The filesystem, process table and users are the
machine's: a host is a network view, not a container (the sandboxes isolate the rest).

Needs root (CAP_NET_ADMIN in the machine's network namespace) and `ip` (iproute2): creating a
bridge in the machine's namespace is what an unprivileged user namespace cannot do.
`ClusterError` names what is missing.

What it does not do: start the services (the caller runs `vllm serve`, `ray start`,
`harnessrl train` inside the hosts) or shape traffic (no latency or loss is added).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from harnessrl.errors import HarnessRLError

_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_HOST = re.compile(r"^[a-z][a-z0-9_]{0,15}$")
STOP_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL of the processes left in a host at `down()`."""


class ClusterError(HarnessRLError):
    """The simulated cluster cannot be made (not root, no `ip`) or a host is unknown."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_can_make_namespaces() -> None:
    """Raise `ClusterError` naming what is missing when this process cannot make the cluster."""
    if shutil.which("ip") is None:
        raise ClusterError("the simulated cluster needs `ip` (iproute2) on PATH: apt-get install iproute2")
    if os.geteuid() != 0:
        raise ClusterError(
            "the simulated cluster needs root (CAP_NET_ADMIN in the machine's network namespace) to make "
            f"a bridge and network namespaces; this process runs as uid {os.geteuid()}: run it with sudo, "
            "or in a container started with --cap-add NET_ADMIN")


def namespaces() -> list[str]:
    """Names of the network namespaces of this machine (`ip netns list`)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links(prefix: str) -> list[str]:
    """Interfaces of the machine's namespace whose name starts with `<prefix>-`."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(f"{prefix}-")]


def namespace_pids(ns: str) -> list[int]:
    """Processes whose network namespace is `ns` (`ip netns pids`)."""
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _end_processes(ns: str) -> None:
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pids:
            return


def sweep(prefix: str) -> list[str]:
    """Remove the namespaces `<prefix>-*` (ending their processes), their veth pairs and the
    bridge `<prefix>-br` a run of `prefix` left; returns what was removed."""
    removed = []
    for ns in namespaces():
        if ns.startswith(f"{prefix}-"):
            _end_processes(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(f"netns {ns}")
    for link in links(prefix):  # veth ends went with their namespaces; the bridge stays
        if _ip("link", "del", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    return removed


def _owner_file(prefix: str) -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/run") / f"harnessrl-cluster-{prefix}.pid"


def _claim(prefix: str) -> None:
    """Record this process as the owner of `prefix`'s cluster.

    Raises:
        ClusterError: a live process owns it (its cluster is up; two runs of one prefix would
            tear down each other's hosts).
    """
    owner = _owner_file(prefix)
    try:
        pid = int(owner.read_text().strip())
    except (OSError, ValueError):
        pid = 0
    if pid and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass  # a dead run's: swept next
        else:
            raise ClusterError(f"a simulated cluster of prefix {prefix!r} is up, owned by live pid {pid} "
                               f"({owner}): stop it, or give another prefix")
    owner.write_text(f"{os.getpid()}\n")


@dataclass(frozen=True, slots=True)
class Host:
    """One host of the cluster."""

    name: str
    namespace: str
    """Its network namespace (`ip netns exec <namespace> ...`)."""
    address: str
    """Its address on the bridge (IPv4, no prefix length)."""


@dataclass
class SimCluster:
    """Hosts as network namespaces on a private bridge (module docstring). Use as a context
    manager, or `up()` / `down()`.

    Args:
        hosts: host names (lowercase letters, digits, `_`; at most 16 characters), in order:
            host i gets `<subnet>.<i + 1>`.
        prefix: names of the bridge, namespaces and veth ends start with `<prefix>-`
            (lowercase letter then letters or digits, at most 8 characters: Linux interface
            names hold 15).
        subnet: an IPv4 /24 network (`10.77.0.0/24`); its addresses exist only on the bridge.

    Raises:
        ValueError: a bad host name, prefix or subnet, or a repeated host name.
    """

    hosts: Sequence[str]
    prefix: str = "hrl"
    subnet: str = "10.77.0.0/24"
    _up: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.prefix):
            raise ValueError(f"cluster prefix {self.prefix!r}: a lowercase letter then up to 7 letters or digits")
        bad = [h for h in self.hosts if not _HOST.match(h)]
        if bad or not self.hosts:
            raise ValueError(f"cluster hosts {list(self.hosts)!r}: give at least one name of lowercase letters, "
                             f"digits or _ (a letter first, 16 characters at most); bad: {bad}")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"cluster hosts {list(self.hosts)!r}: a name given twice")
        net = ipaddress.ip_network(self.subnet, strict=True)
        if net.version != 4 or net.prefixlen != 24:
            raise ValueError(f"cluster subnet {self.subnet!r}: an IPv4 /24 network, e.g. 10.77.0.0/24")
        if len(self.hosts) > 250:
            raise ValueError(f"cluster hosts: {len(self.hosts)} do not fit a /24")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def host(self, name: str) -> Host:
        """The host `name`.

        Raises:
            ClusterError: no host of that name.
        """
        try:
            i = list(self.hosts).index(name)
        except ValueError:
            raise ClusterError(f"no host {name!r} in the cluster (hosts: {', '.join(self.hosts)})") from None
        net = ipaddress.ip_network(self.subnet)
        return Host(name=name, namespace=f"{self.prefix}-{name}", address=str(net.network_address + i + 1))

    def up(self) -> SimCluster:
        """Make the bridge, the namespaces and their links (sweeping a dead run's first).

        Raises:
            ClusterError: not root, no `ip`, or an `ip` command failed (what was made is removed).
        """
        check_can_make_namespaces()
        _claim(self.prefix)
        sweep(self.prefix)
        self._up = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.hosts):
                h = self.host(name)
                veth = f"{self.prefix}-v{i}"
                _ip("netns", "add", h.namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{self.prefix}-p{i}")
                _ip("link", "set", f"{self.prefix}-p{i}", "netns", h.namespace)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", h.namespace, "link", "set", f"{self.prefix}-p{i}", "name", "eth0")
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.namespace, "link", "set", "eth0", "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """End every process left in the hosts, delete namespaces, veth pairs and the bridge;
        idempotent. Returns what was removed."""
        self._up = False
        removed = sweep(self.prefix)
        _owner_file(self.prefix).unlink(missing_ok=True)
        return removed

    def __enter__(self) -> SimCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside `host` (`ip netns exec <namespace> ...`)."""
        return ["ip", "netns", "exec", self.host(host).namespace, *argv]

    def run(self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
            stdout: int | IO[bytes] | None = None, stderr: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host` in its own session (so its group can be signalled);
        `down()` ends it if the caller did not."""
        return subprocess.Popen(self.command(host, argv), env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, start_new_session=True)

    def kill_host(self, host: str) -> int:
        """SIGKILL every process of `host` (a node lost at once); returns how many there were.
        The namespace and its address stay (the host is down, the network is not)."""
        ns = self.host(host).namespace
        pids = namespace_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return len(pids)

    def addresses(self) -> dict[str, str]:
        """`{host: address}` of every host."""
        return {h: self.host(h).address for h in self.hosts}


def hold(cluster: SimCluster, echo: Callable[[str], None]) -> int:
    """`harnessrl cluster up`: make `cluster`, print its hosts, wait for SIGTERM or Ctrl-C, tear
    it down; returns the exit code (0 after a signal; the cluster is down either way)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.up()
        for name in cluster.hosts:
            h = cluster.host(name)
            echo(f"{name}\t{h.address}\tip netns exec {h.namespace} COMMAND")
        echo(f"bridge {cluster.bridge}, subnet {cluster.subnet}: up until SIGTERM or Ctrl-C")
        while not stop.wait(0.5):
            pass
    finally:
        removed = cluster.down()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    echo(f"down: removed {len(removed)} namespaces and links")
    return 0
