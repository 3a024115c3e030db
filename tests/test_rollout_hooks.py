"""`harnessrl rollout` and `harnessrl train` read `[hooks]` the same way: the rollout summary's
training reward is the hook's (as the trainer's advantages are); its verifier reward and pass
rate are the verifier's, as in rollouts.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rollout_summary_uses_the_reward_hook(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.cli", "rollout", "--config", "examples/byo/letters.toml",
         "--set", "engine.model=tiny-random", "--set", "sampling.max_tokens=4", "--set", "rollout.group_size=2",
         # the reference recipe's shaping: no bash call -> -0.1 (a single-turn chat never calls one)
         "--set", 'hooks.rollout_reward_fn="harnessrl.recipes.shaping:opencode_tool_use_reward"',
         "--limit", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scored"] == 2
    assert abs(summary["reward/train_mean"] - (-0.1)) < 1e-9
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rollouts] == [r["reward_parts"]["correct"] for r in rollouts]
    # the verifier's reward is reported apart from the shaped one, and pass rate counts it
    verifier = [r["reward"] for r in rollouts]
    assert summary["reward/verifier_mean"] == sum(verifier) / len(verifier)
    assert summary["pass_rate"] == sum(v >= 1.0 for v in verifier) / len(verifier)
    assert 'rollout_reward_fn = "harnessrl.recipes.shaping:opencode_tool_use_reward"' in (out / "config.toml").read_text()
