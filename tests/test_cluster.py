"""The simulated cluster (`harnessrl.cluster`): hosts reach each other on their bridge addresses
and nothing else, and teardown leaves no namespace, link or process. Needs root: without it the
tests fail with the `ClusterError` naming what is missing (the machine cannot run the cluster)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.cluster import ClusterError, SimCluster, check_can_make_namespaces, links, namespaces

PREFIX = f"hrlt{os.getpid() % 10000}"
SUBNET = f"10.79.{os.getpid() % 200}.0/24"

SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello from " + sys.argv[1].encode())
    c.close()
"""

DIAL = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
        print("got", s.recv(100).decode())
except OSError as exc:
    print("error", type(exc).__name__, exc.errno)
"""


def _dial(cluster: SimCluster, host: str, address: str, port: int) -> str:
    out = subprocess.run(cluster.command(host, [sys.executable, "-c", DIAL, address, str(port)]),
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


def _serve(cluster: SimCluster, host: str, address: str, port: int) -> subprocess.Popen[bytes]:
    proc = cluster.run(host, [sys.executable, "-c", SERVE, address, str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"listening"
    return proc


def _machine_address() -> str | None:
    """A non-loopback IPv4 address of the machine's own namespace, if it has one."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not addr.startswith("127.") and not addr.startswith("10.79."):
            return addr
    return None


def test_hosts_reach_each_other_on_their_addresses_and_nothing_of_the_machine() -> None:
    check_can_make_namespaces()
    machine = socket.socket()
    machine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    machine.bind(("0.0.0.0", 0))  # every address of the machine's namespace, loopback included
    machine.listen()
    mport = machine.getsockname()[1]
    try:
        with SimCluster(["trainer", "node1"], prefix=PREFIX, subnet=SUBNET) as cluster:
            a, b = cluster.host("trainer"), cluster.host("node1")
            assert a.address.endswith(".1") and b.address.endswith(".2")
            _serve(cluster, "node1", b.address, 7101)
            assert _dial(cluster, "trainer", b.address, 7101) == f"got hello from {b.address}"
            # not a loopback shortcut: the same port on the dialler's own loopback is closed
            assert _dial(cluster, "trainer", "127.0.0.1", 7101).startswith("error ConnectionRefusedError")
            # a service on a host's loopback is that host's alone
            _serve(cluster, "node1", "127.0.0.1", 7102)
            assert _dial(cluster, "node1", "127.0.0.1", 7102) == "got hello from 127.0.0.1"
            assert _dial(cluster, "trainer", b.address, 7102).startswith("error ConnectionRefusedError")
            # the machine's own listener is out of reach: its loopback is not the hosts', and
            # no route leaves the bridge's subnet
            assert _dial(cluster, "trainer", "127.0.0.1", mport).startswith("error ConnectionRefusedError")
            addr = _machine_address()
            if addr is not None:
                assert _dial(cluster, "node1", addr, mport).startswith("error "), addr
            route = subprocess.run(cluster.command("trainer", ["ip", "route"]), capture_output=True, text=True,
                                   check=True).stdout
            assert "default" not in route and route.count("\n") == 1, route
    finally:
        machine.close()
    assert [n for n in namespaces() if n.startswith(f"{PREFIX}-")] == []
    assert links(PREFIX) == []


def test_down_ends_the_hosts_processes_and_removes_every_link() -> None:
    check_can_make_namespaces()
    cluster = SimCluster(["a", "b", "c"], prefix=PREFIX, subnet=SUBNET).up()
    try:
        assert sorted(n for n in namespaces() if n.startswith(f"{PREFIX}-")) == [f"{PREFIX}-a", f"{PREFIX}-b",
                                                                                 f"{PREFIX}-c"]
        assert sorted(links(PREFIX)) == [f"{PREFIX}-br", f"{PREFIX}-v0", f"{PREFIX}-v1", f"{PREFIX}-v2"]
        sleeper = cluster.run("b", ["sleep", "300"])
        time.sleep(0.3)
    finally:
        removed = cluster.down()
    assert f"netns {PREFIX}-b" in removed
    assert sleeper.wait(10) == -9 or sleeper.returncode == -15
    assert [n for n in namespaces() if n.startswith(f"{PREFIX}-")] == []
    assert links(PREFIX) == []


def test_a_dead_runs_leftovers_are_swept_at_the_next_start() -> None:
    check_can_make_namespaces()
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-stale"], check=True)
    subprocess.run(["ip", "link", "add", f"{PREFIX}-br", "type", "bridge"], check=True)
    with SimCluster(["a"], prefix=PREFIX, subnet=SUBNET):
        assert f"{PREFIX}-stale" not in namespaces()
        assert f"{PREFIX}-a" in namespaces()
    assert links(PREFIX) == [] and f"{PREFIX}-stale" not in namespaces()


def test_a_live_cluster_of_the_same_prefix_is_not_torn_down() -> None:
    check_can_make_namespaces()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        from harnessrl.cluster import _owner_file

        _owner_file(PREFIX).write_text(f"{holder.pid}\n")
        with pytest.raises(ClusterError, match=f"owned by live pid {holder.pid}"):
            SimCluster(["a"], prefix=PREFIX, subnet=SUBNET).up()
    finally:
        holder.kill()
        holder.wait()
    with SimCluster(["a"], prefix=PREFIX, subnet=SUBNET):  # its owner is dead now: taken over
        assert f"{PREFIX}-a" in namespaces()


def test_without_root_the_error_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root .CAP_NET_ADMIN.*uid 1000"):
        SimCluster(["a", "b"], prefix=PREFIX).up()


@pytest.mark.parametrize(("hosts", "prefix", "subnet", "match"), [
    (["a", "a"], "hrl", "10.77.0.0/24", "given twice"),
    (["A"], "hrl", "10.77.0.0/24", "bad: \\['A'\\]"),
    ([], "hrl", "10.77.0.0/24", "at least one"),
    (["a"], "toolongprefix", "10.77.0.0/24", "cluster prefix"),
    (["a"], "hrl", "10.0.0.0/16", "IPv4 /24"),
])
def test_bad_arguments_are_named(hosts: list[str], prefix: str, subnet: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimCluster(hosts, prefix=prefix, subnet=subnet)


def test_an_unknown_host_is_named() -> None:
    with pytest.raises(ClusterError, match="no host 'x' in the cluster .hosts: a, b"):
        SimCluster(["a", "b"]).host("x")


def test_cluster_up_holds_the_hosts_until_sigterm_then_removes_them() -> None:
    check_can_make_namespaces()
    import signal

    harnessrl = str(Path(sys.executable).with_name("harnessrl"))
    proc = subprocess.Popen([harnessrl, "cluster", "up", "--hosts", "a,b", "--prefix", PREFIX, "--subnet", SUBNET],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].split("\t")[:2] == ["a", SUBNET.replace("0/24", "1")], lines
        assert lines[1].split("\t")[2].strip() == f"ip netns exec {PREFIX}-b COMMAND"
        assert {f"{PREFIX}-a", f"{PREFIX}-b"} <= set(namespaces())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [n for n in namespaces() if n.startswith(f"{PREFIX}-")] == [] and links(PREFIX) == []
