"""The TCP-to-Unix forwarder that gives a bubblewrap sandbox its one way out: the proxy.

Responsibility: inside a sandbox's own network namespace (only `lo`, nothing routed), listen
on `127.0.0.1:<port>` and relay every connection to the proxy's agent Unix socket, which is
bound into the sandbox (or, SOCKET being `/proc/self/fd/<n>`, reached through descriptor n,
which the relay keeps and the command does not inherit); then exec the sandbox's command. Agents keep an ordinary
`http://127.0.0.1:<port>/v1` base URL, and the only address they can reach is the proxy's
agent listener (not its admin listener, not other host ports, not DNS, not the internet).

Run as a script, stdlib only (`python3 -I -S forward.py PORT SOCKET -- ARGV...`): the port is
bound before ARGV is exec'd, so the command's first connection is queued, never refused. The
relay is a forked child; it lives in the command's PID namespace and so ends with it (and it
also asks the kernel for SIGKILL when the command exits, so it never outlives it anywhere). It
needs no privilege, uses one thread per direction of each connection, and closes its
stdio so that `exec` output pipes reach EOF with the command. A failed exec of ARGV prints
the error and exits 127, like a shell.

What it deliberately does not do: inspect, buffer or limit the bytes it relays (the proxy
does that), or reconnect.
"""

from __future__ import annotations

import os
import sys

_CHUNK = 1 << 16
FD_PREFIX = "/proc/self/fd/"
# `socket` and `threading` are imported by the relay child only, after the fork: the command
# starts after a bare interpreter start plus the builtin `_socket` (about 10 ms, not 25).


def _pump(src: socket.socket, dst: socket.socket, done: threading.Semaphore) -> None:
    import socket  # lazy: the relay child's, after the fork

    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    done.release()


def _relay(client: socket.socket, unix_path: str) -> None:
    import socket  # lazy: the relay child's, after the fork
    import threading  # lazy: the relay child's, after the fork

    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(unix_path)
    except OSError:
        client.close()
        upstream.close()
        return
    done = threading.Semaphore(0)
    threading.Thread(target=_pump, args=(upstream, client, done), daemon=True).start()
    _pump(client, upstream, done)
    done.acquire()
    done.acquire()
    client.close()
    upstream.close()


def _die_with(parent: int) -> None:
    """SIGKILL this process when `parent` (the exec'd command) exits, even outside a PID
    namespace (Linux `PR_SET_PDEATHSIG`); exit now if it already did."""
    import ctypes  # lazy: the relay child's, after the fork
    import signal  # lazy: the relay child's, after the fork

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _serve(fileno: int, unix_path: str, parent: int) -> None:
    import socket  # lazy: the relay child's, after the fork
    import threading  # lazy: the relay child's, after the fork

    _die_with(parent)

    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    listener = socket.socket(fileno=fileno)
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            continue
        threading.Thread(target=_relay, args=(client, unix_path), daemon=True).start()


def main(args: list[str]) -> int:
    if len(args) < 4 or args[2] != "--":
        print("usage: forward.py PORT SOCKET -- ARGV...", file=sys.stderr)
        return 2
    import _socket  # lazy: the relay child's, after the fork

    port, unix_path, argv = int(args[0]), args[1], args[3:]
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(512)
    parent = os.getpid()
    if os.fork() == 0:
        try:
            _serve(listener.detach(), unix_path, parent)
        finally:
            os._exit(0)
    listener.close()
    if unix_path.startswith(FD_PREFIX):  # the socket's handle stays the relay's, not the command's
        os.set_inheritable(int(unix_path[len(FD_PREFIX):]), False)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"{argv[0]}: {exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
