"""Ctrl-C mid-run: `harnessrl train` stops dispatch, kills agents, closes sandboxes, writes no
rollout cut by the stop, exits 130 (see test_signals.py for both signals and both commands).

The agent is a real process (a command-harness script) that makes one proxied call and then
sleeps with a background child, so at SIGINT there are live agent trees to kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.sandbox.local import leftover_sandboxes
from harnessrl.sandbox.procs import leftover_processes

AGENT = """
import json, subprocess, sys, time, urllib.request
base_url, key = sys.argv[1], sys.argv[2]
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(base_url + "/chat/completions", data=body,
                             headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=120).read()
subprocess.Popen(["sleep", "1000"])
time.sleep(1000)
"""


def _config(tmp_path: Path, sandboxes: Path) -> Path:
    # The script is written into the sandbox by the harness (the sandbox may not see tmp_path).
    config = tmp_path / "run.toml"
    config.write_text(
        "[engine]\nmodel = \"tiny-random\"\n"
        "[sampling]\nmax_tokens = 8\n"
        "[rollout]\nagent_timeout_s = 600\n"
        f"[sandbox]\nroot_dir = {json.dumps(str(sandboxes))}\n"
        "[harness]\nkind = \"command\"\n"
        "[harness.options]\n"
        "argv = [\"python3\", \"{state_dir}/agent.py\", \"{base_url}\", \"{api_key}\"]\n"
        f"files = {{ \"agent.py\" = {json.dumps(AGENT)} }}\n"
    )
    return config


@pytest.mark.e2e
def test_sigint_mid_run_leaves_nothing(tmp_path: Path) -> None:
    sandboxes = tmp_path / "sandboxes"
    config = _config(tmp_path, sandboxes)
    cmd = [sys.executable, "-m", "harnessrl.cli", "train", "--config", str(config),
           "--out", str(tmp_path / "run"), "--steps", "3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # wait until the agents made their call and sleep inside live sandboxes
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(leftover_processes(sandboxes)) < 8:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.5)
        assert len(leftover_processes(sandboxes)) >= 8, "agents never started"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert exit_s < 15.0, f"took {exit_s:.1f} s to exit"
    assert leftover_processes(sandboxes) == []
    assert leftover_sandboxes(sandboxes) == []
    run_dir = tmp_path / "run"
    # every rollout was cut by the stop: none is recorded, no step completed
    assert (run_dir / "rollouts.jsonl").read_text() == ""
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""
    assert not (run_dir / "checkpoints").exists()
