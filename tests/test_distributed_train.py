"""`harnessrl train` on 2 gloo ranks under the real launchers (tiny model, white-box harness in
bubblewrap sandboxes): 2 steps end cleanly with rank 0's files only, under `torchrun` (fsdp2) and
`accelerate launch` (ddp); Ctrl-C (SIGINT to torchrun's process group, as a terminal sends it)
leaves no process and no sandbox behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from proc_checks import assert_nothing_left, cmdline, descendants, signal_group

pytestmark = pytest.mark.e2e

PARITY_REWARD = "harnessrl.recipes.shaping:alternating_smoke_reward"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path: Path, strategy: str, steps: int,
           launcher: str = "torchrun") -> tuple[subprocess.Popen[bytes], Path, Path]:
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    sets = [
        "engine.model=tiny-random",
        "harness.kind=white_box",
        "rollout.group_size=4",
        "rollout.agent_timeout_s=120",
        "sampling.max_tokens=16",
        f"train.steps={steps}",
        "train.learning_rate=1e-3",
        f"train.strategy={strategy}",
        "train.max_staleness=0",
        "log.update_norm_every=1",  # param_delta_l2 at every step (a collective under fsdp2)
        f'hooks.rollout_reward_fn="{PARITY_REWARD}"',
        f'sandbox.root_dir="{tmp_path / "sandboxes"}"',
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                  "127.0.0.1", "--master-port", str(_free_port())]
    else:  # accelerate's multi-process launcher (it sets the same environment; gloo on CPU)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(_free_port())]
    argv = [*launch, "-m", "harnessrl.cli", "train", "--out", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir, log


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(("launcher", "strategy"), [("torchrun", "fsdp2"), ("accelerate", "ddp")])
def test_two_rank_train_ends_cleanly(launcher: str, strategy: str, tmp_path: Path) -> None:
    proc, run_dir, log = _start(tmp_path, strategy, steps=2, launcher=launcher)
    seen: dict[int, psutil.Process] = {}
    commands: dict[int, str] = {}
    deadline = time.monotonic() + 420
    while proc.poll() is None and time.monotonic() < deadline:
        for p in descendants(proc.pid):
            seen[p.pid] = p
            commands.setdefault(p.pid, " ".join(cmdline(p)))
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert sum("harnessrl.cli train" in c for c in commands.values()) == 2, "torchrun did not start 2 ranks"
    rows = _metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2]
    assert rows[-1]["policy_version"] == 2
    for m in rows:
        assert m["tokens_trained"] > 0 and m["param_delta_l2"] > 0
        assert m["invariant/untraceable_trained_tokens"] == 0
        assert m["sync/canary_abs_dev"] < 1e-3, "the canary after each sync (a collective forward under fsdp2)"
    assert rows[0]["step0/ratio_abs_dev"] < 1e-3, "trainer ranks and engine disagree at step 0"
    assert (run_dir / "checkpoints" / "step-2" / "model.safetensors").exists()
    state = json.loads((run_dir / "checkpoints" / "step-2" / "state.json").read_text())
    assert state["policy_version"] == 2
    assert f"trainer on 2 ranks ({strategy}, cpu, float32)" in (run_dir / "run.log").read_text()
    assert len((run_dir / "rollouts.jsonl").read_text().splitlines()) == 8
    assert_nothing_left(list(seen.values()), tmp_path / "sandboxes")


def test_sigint_to_torchrun_leaves_nothing_behind(tmp_path: Path) -> None:
    proc, run_dir, log = _start(tmp_path, "ddp", steps=50)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300
    while not _metrics(run_dir) and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        seen.update({p.pid: p for p in descendants(proc.pid)})
        time.sleep(0.3)
    assert _metrics(run_dir), "no step completed:\n" + log.read_text(errors="replace")[-4000:]
    seen.update({p.pid: p for p in descendants(proc.pid)})
    exit_s = signal_group(proc, signal.SIGINT)  # a terminal's Ctrl-C: torchrun forwards it to each rank
    text = (run_dir / "run.log").read_text()
    assert "stopped by SIGINT" in text, text[-3000:]
    assert exit_s < 40, f"{exit_s:.1f} s to exit"
    assert_nothing_left(list(seen.values()), tmp_path / "sandboxes")
    steps = [m["step"] for m in _metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1))
