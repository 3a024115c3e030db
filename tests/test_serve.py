"""`harnessrl serve` by hand: a trained checkpoint served with the run's sampling; the printed
lines (session id, key, trace command) work verbatim."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harnessrl.config import load_config
from harnessrl.serve import proxy_config_for_serve


def test_serve_uses_the_runs_sampling() -> None:
    cfg = load_config(None, ["sampling.temperature=0.7", "sampling.top_k=5", "sampling.max_tokens=64",
                             "engine.model=tiny-random"])
    proxy = proxy_config_for_serve(cfg, host="127.0.0.1", port=0)
    assert (proxy.sampling.temperature, proxy.sampling.top_k, proxy.sampling.max_tokens, proxy.enforce_sampling) == (0.7, 5, 64, True)
    assert proxy.model_name == "tiny-random"


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint as `harnessrl train` writes it (`RUN/checkpoints/step-1`)."""
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.train.policy import load_policy, save_checkpoint

    policy = load_policy(tiny_model_dir, learning_rate=1e-5, weight_decay=0.0, lora_rank=0)
    directory = tmp_path_factory.mktemp("run") / "checkpoints" / "step-1"
    save_checkpoint(policy, load_tokenizer(tiny_model_dir), directory,
                    {"step": 1, "policy_version": 1, "next_group_id": 1})
    return directory


def test_serve_a_checkpoint_and_follow_the_printed_lines(checkpoint: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESSRL_ADMIN_TOKEN": "t" * 32}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harnessrl.cli", "serve", "--model", str(checkpoint), "--port", "0",
         "--admin-port", "0", "--open-session", "--threads", "1",
         "--set", "sampling.temperature=0.5", "--set", "sampling.max_tokens=5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if "/trace" in line:
                break
        text = "\n".join(lines)
        assert proc.poll() is None, text
        assert f"proxy serving {checkpoint}" in text
        assert "sampling (enforced): temperature 0.5, top_p 1.0, top_k 0, max_tokens 5" in text
        session_id = re.search(r"^session (\S+)$", text, re.M).group(1)  # type: ignore[union-attr]
        key = re.search(r"^key: (\S+)$", text, re.M).group(1)  # type: ignore[union-attr]
        base_url = re.search(r"OPENAI_BASE_URL=(\S+)", text).group(1)  # type: ignore[union-attr]
        # the printed trace command, run as printed (the token comes from the environment)
        trace_cmd = next(line for line in lines if line.startswith("curl") and "/trace" in line)
        assert f"/admin/sessions/{session_id}/trace" in trace_cmd

        reply = httpx.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "any", "max_tokens": 50, "temperature": 2.0,
                                 "messages": [{"role": "user", "content": "Say hi"}]}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert 1 <= reply.json()["usage"]["completion_tokens"] <= 5  # the run's cap, not the agent's 50

        if shutil.which("curl"):
            shown = subprocess.run(["bash", "-c", trace_cmd], capture_output=True, text=True, env=env, timeout=30)
            assert shown.returncode == 0, shown.stderr
            trace = json.loads(shown.stdout)
        else:  # the same call without curl: the URL and header as printed
            url = trace_cmd.split()[-1]
            trace = httpx.get(url, headers={"Authorization": f"Bearer {env['HARNESSRL_ADMIN_TOKEN']}"}, timeout=30).json()
        assert trace["session_id"] == session_id and len(trace["turns"]) == 1
        sampling = trace["turns"][0]["sampling"]
        assert (sampling["temperature"], sampling["max_tokens"]) == (0.5, 5)  # enforced over the agent's 2.0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, "\n".join(lines)
