"""The launcher without vLLM: the command line and environment of CPU, GPU and LoRA servers; core
slices of replicas; and real processes of a stub server (started the way vLLM is, `PYTHON -m
vllm.entrypoints... --port P`): two replicas health-waited and served through one `VllmEngine`
with session-affine routing, logs in the log directory, the whole process group (a grandchild
included) gone after `close()`; a server that exits while starting raises with its log tail and
leaves nothing; a health-wait past its timeout stops the server; a server whose port was taken
between `free_port` and its bind starts again on another."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest
from test_vllm_engine import group_pids

from harnessrl.engine.config import VllmEngineConfig
from harnessrl.engine.vllm.client import VllmEngine
from harnessrl.engine.vllm.server import (SERVER_MODULE, cpu_slice, launch_servers, launch_servers_async,
                                          server_command, server_env, start_servers)
from harnessrl.errors import EngineError
from harnessrl.types import Sampling

TESTS = Path(__file__).parent

STUB = f"""#!/bin/sh
# stands in for the vLLM venv's python: `-m {SERVER_MODULE} ... --port P` serves the fake vLLM
# of tests/test_vllm_upstream.py on P, with a grandchild that must die with the group
sleep 600 &
exec {sys.executable} -c '
import sys, threading
from http.server import ThreadingHTTPServer
sys.path.insert(0, "{TESTS}")
from test_vllm_upstream import FakeVllm
args = sys.argv[1:]
if "--fail" in args:
    print("stub: cannot load the model", flush=True); sys.exit(3)
port = int(args[args.index("--port") + 1])
print("stub serving on", port, "with", " ".join(args), flush=True)
handler = type("H", (FakeVllm,), {{"calls": []}})
ThreadingHTTPServer(("127.0.0.1", port), handler).serve_forever()
' "$@"
"""


@pytest.fixture
def stub_python(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text(STUB)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_cpu_gpu_and_lora_command_lines() -> None:
    cfg = VllmEngineConfig(dtype="float32", max_context_tokens=2048)
    argv = server_command(cfg, Path("/v/bin/python"), Path("/m"), 8123, gpu=False, served_model="base")
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    joined = " ".join(argv)
    for flag in ("--model /m", "--served-model-name base", "--host 127.0.0.1", "--port 8123", "--dtype float32",
                 "--max-model-len 2048", "--logprobs-mode processed_logprobs", "--enforce-eager"):
        assert flag in joined
    assert "--enable-lora" not in joined and "--gpu-memory-utilization" not in joined
    env = server_env(cfg, 0, gpu=False, base={})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_HOST_IP"] == env["VLLM_LOOPBACK_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" in env
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env

    lora = VllmEngineConfig(weight_sync="lora", max_lora_rank=8, enforce_eager=False, threads="0-1")
    gpu_argv = " ".join(server_command(lora, Path("p"), Path("/m"), 1, gpu=True, served_model="b"))
    assert "--enable-lora --max-lora-rank 8 --max-loras 3 --max-cpu-loras 3" in gpu_argv and "--gpu-memory-utilization 0.85" in gpu_argv
    assert "--enforce-eager" not in gpu_argv  # CUDA graphs allowed when asked for
    cpu_argv = " ".join(server_command(lora, Path("p"), Path("/m"), 1, gpu=False, served_model="b"))
    assert "--enforce-eager" in cpu_argv  # always on CPU
    gpu_env = server_env(lora, 1, gpu=True, base={})
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == "1" and gpu_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not any(k.startswith("VLLM_CPU_") for k in gpu_env)
    assert server_env(lora, 0, gpu=False, base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_replicas_split_the_cores() -> None:
    assert [cpu_slice(i, 2, cores=16) for i in range(2)] == ["0-7", "8-15"]
    assert [cpu_slice(i, 3, cores=2) for i in range(3)] == ["0", "1", "1"]
    assert cpu_slice(0, 1, cores=2) == "0-1"


def test_two_launched_replicas_serve_route_and_stop(stub_python: Path, tmp_path: Path, tokenizer) -> None:
    cfg = VllmEngineConfig(replicas=2, startup_timeout_s=60)
    servers = launch_servers(cfg, Path("/m"), tmp_path / "logs", python=stub_python, served_model="base")
    engine = VllmEngine([s.url for s in servers], served_model="base", servers=servers)
    try:
        assert [s.log_path.name for s in servers] == ["vllm-0.log", "vllm-1.log"]
        assert all(len(group_pids(s.pid)) >= 2 for s in servers)  # the server and its grandchild
        assert "--logprobs-mode processed_logprobs" in servers[0].log_path.read_text()

        async def rollouts() -> list[int | None]:
            for turn in range(2):
                for key in ("a", "b", "c", "d"):
                    c = await engine.generate([1, 2, 3], Sampling(max_tokens=8), affinity=key)
                    assert c.completion_ids == (504, 3458, 0, 2)
            return [engine.replica_of(k) for k in ("a", "b", "c", "d")]

        assert sorted(asyncio.run(rollouts())) == [0, 0, 1, 1]
        freed = [engine.replica_of("a"), engine.replica_of("c")]
        assert freed[0] == freed[1]  # a and c share a replica, b and d the other
        engine.forget("a")
        engine.forget("c")
        assert engine.replica_of("a") is None
        # the next two rollouts fill the replica freed by the ended ones
        assert asyncio.run(_two(engine)) == freed
    finally:
        engine.close()
    for s in servers:
        assert not s.running and group_pids(s.pid) == []


async def _two(engine: VllmEngine) -> list[int | None]:
    for key in ("e", "f"):
        await engine.generate([1, 2, 3], Sampling(max_tokens=8), affinity=key)
    return [engine.replica_of(k) for k in ("e", "f")]


def _launch(launcher: str, *args: object, **kwargs: object) -> list:
    """`launch_servers` ("sync") or `launch_servers_async` run to completion ("async")."""
    if launcher == "sync":
        return launch_servers(*args, **kwargs)  # type: ignore[arg-type]
    return asyncio.run(launch_servers_async(*args, **kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("launcher", ["sync", "async"])
def test_a_server_that_exits_while_starting_raises_with_its_log(launcher: str, stub_python: Path,
                                                                tmp_path: Path) -> None:
    cfg = VllmEngineConfig(replicas=2, extra_args=["--fail"], startup_timeout_s=60)
    with pytest.raises(EngineError, match=r"exited with code 3 while starting; log .*vllm-0.log:\n.*cannot load"):
        _launch(launcher, cfg, Path("/m"), tmp_path, python=stub_python)
    # both replicas were started; neither leaves a process
    assert [p for p in os.listdir("/proc") if p.isdigit() and _cmd_has(p, str(stub_python))] == []


def test_a_health_wait_past_its_timeout_stops_the_server(tmp_path: Path) -> None:
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")
    sleeper.chmod(0o755)
    cfg = VllmEngineConfig(startup_timeout_s=1.0)
    (server,) = start_servers(cfg, Path("/m"), tmp_path, python=sleeper)
    with pytest.raises(EngineError, match=r"not healthy after 1 s \(engine.startup_timeout_s\)"):
        try:
            server.wait_healthy(cfg.startup_timeout_s)
        finally:
            server.stop()
    assert group_pids(server.pid) == []
    with pytest.raises(EngineError, match="not healthy"):
        launch_servers(cfg, Path("/m"), tmp_path, python=sleeper)
    assert [p for p in os.listdir("/proc") if p.isdigit() and _cmd_has(p, str(sleeper))] == []


@pytest.mark.parametrize("launcher", ["sync", "async"])
def test_a_server_whose_port_was_taken_starts_again_on_another(launcher: str, stub_python: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from harnessrl.engine.vllm import server as vllm_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        offered = iter([busy])
        real_free_port = vllm_server.free_port
        monkeypatch.setattr(vllm_server, "free_port", lambda: next(offered, None) or real_free_port())
        (server,) = _launch(launcher, VllmEngineConfig(startup_timeout_s=60), Path("/m"), tmp_path,
                            python=stub_python, served_model="base")
    try:
        assert server.port != busy and server.running
        assert "address already in use" in server.log_path.read_text().lower()  # the first start, logged
    finally:
        server.stop()


def _cmd_has(pid: str, needle: str) -> bool:
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
