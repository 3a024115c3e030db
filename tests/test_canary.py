"""The weight-sync canary (`engine/canary.py`) on the embedded engine: after an in-process sync
the trainer's and the engine's logprobs of the probe agree to float rounding and the report
carries `sync/canary_abs_dev`; a sync that leaves one tensor behind raises `CanaryError` naming
the replica, the version and the deviation; a real `harnessrl train` whose sync is broken stops
at its first step with that error (nothing trained on, no metrics line); `train.sync_canary =
false` turns it off. The vLLM side is `tests/test_vllm_canary.py`."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from harnessrl.config import RunConfig, load_config
from harnessrl.engine.canary import (FP32_BOUND, CanaryError, CanarySync, max_abs_dev, policy_probe, probe_half, probe_ids,
                                     sequence_logprobs)
from harnessrl.engine.config import EmbeddedEngineConfig
from harnessrl.engine.select import make_weight_sync
from harnessrl.engine.weight_sync import InProcessWeightSync, SyncReport
from harnessrl.train.setup import sync_settings
from harnessrl.train.policy import export_weights, load_policy


def _perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _tiny_run(tmp_path: Path, *, steps: int, max_staleness: int) -> RunConfig:
    """A white-box run on the tiny model, 2 rollouts a step, every group trained."""
    return load_config(None, [
        "engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2", "sampling.max_tokens=8",
        f"train.steps={steps}", "train.learning_rate=1e-2", f"train.max_staleness={max_staleness}",
        'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
        f'sandbox.root_dir="{tmp_path / "sandboxes"}"'])


def _leaving_out(suffix: str) -> type[InProcessWeightSync]:
    """The in-process sync, but every tensor whose name ends with `suffix` is left out of the
    copy (a reload that missed a tensor); both `publish` and the deferred canary's
    `start_publish` go through it."""

    class LeftBehind(InProcessWeightSync):
        def start_publish(self, policy, version):  # type: ignore[no-untyped-def]
            weights = {k: v for k, v in export_weights(policy).items() if not k.endswith(suffix)}
            applied = self._engine.submit_weights(weights, version)

            def finish() -> SyncReport:
                applied.result()
                return SyncReport(version=version, seconds=0.0, bytes=0)

            return finish

    return LeftBehind


def test_probe_is_fixed_repeated_and_in_the_frequent_vocabulary() -> None:
    ids = probe_ids(49152)
    assert len(ids) == 64 and ids[:32] == ids[32:] and ids == probe_ids(49152)
    assert all(256 <= i < 4096 for i in ids) and len(set(ids)) > 28
    wide = probe_ids(49152, half=128)
    assert len(wide) == 256 and wide[:128] == wide[128:] and wide[:32] == ids[:32], "one seeded draw"
    assert probe_half("float32", "float32") == 32 and probe_half("float32", "bfloat16") == 128
    assert probe_half("bfloat16", "float32") == 128
    assert all(256 <= i < 1000 for i in probe_ids(1000))
    with pytest.raises(ValueError, match="vocab_size=200"):
        probe_ids(200)


def test_max_abs_dev_counts_nan_as_infinite() -> None:
    assert max_abs_dev([-1.0, -2.0], [-1.5, -2.1]) == (0.5, 0)
    assert max_abs_dev([-1.0, -2.0], [-1.0, float("nan")])[0] == float("inf")
    with pytest.raises(ValueError):
        max_abs_dev([0.0], [0.0, 0.0])


def test_trainer_and_engine_score_the_probe_alike(tiny_model_dir: Path) -> None:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    ids = policy_probe(policy)
    reference = policy.sequence_logprobs(ids)
    assert len(reference) == 63 and all(lp < 0 for lp in reference)
    # the packed training path equals one plain forward
    assert max_abs_dev(reference, sequence_logprobs(policy.model, ids))[0] < 1e-5
    assert policy.model.training, "the trainer's mode is restored"
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        assert max_abs_dev(reference, engine.prompt_logprobs(ids))[0] < 1e-5


def test_canary_passes_a_good_sync_and_stops_one_that_leaves_a_tensor_behind(tiny_model_dir: Path) -> None:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        good = CanarySync(InProcessWeightSync(engine), engine, bound=FP32_BOUND)
        _perturb(policy.model, seed=1)
        report = good.publish(policy, 1)
        assert report.version == 1 and report.canary_abs_dev is not None and report.canary_abs_dev < 1e-5
        metrics = report.as_metrics()
        assert metrics["sync/canary_abs_dev"] == report.canary_abs_dev and metrics["sync/canary_seconds"] > 0

        broken = CanarySync(_leaving_out("model.norm.weight")(engine), engine, bound=FP32_BOUND)
        _perturb(policy.model, seed=2)
        with pytest.raises(CanaryError, match=r"replica embedded .* policy version 2: max \|trainer - engine\| "
                                              r"logprob over 63 positions of the 64-id probe = [0-9.e-]+ nats") as info:
            broken.publish(policy, 2)
        dev = float(str(info.value).split("= ")[1].split(" nats")[0])
        assert dev > FP32_BOUND


def test_a_deferred_canary_returns_before_its_verdict_and_holds_a_failure(tiny_model_dir: Path) -> None:
    """With `defer`, `publish` returns once the engine has the weights and the trainer has scored
    the probe; the verdict arrives in `pending_canary` (the engine scores after the copy, the
    trainer's forward overlapping it), a failed one holds the `CanaryError` and the next publish
    raises it."""
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        scored = engine.prompt_logprobs
        release = threading.Event()

        def slow_scoring(ids, replica=0):  # type: ignore[no-untyped-def]
            release.wait(30)  # the engine's half of the canary is still running when publish returns
            return scored(ids, replica)

        engine.prompt_logprobs = slow_scoring  # type: ignore[method-assign]
        good = CanarySync(InProcessWeightSync(engine), engine, bound=FP32_BOUND, defer=True)
        _perturb(policy.model, seed=1)
        report = good.publish(policy, 1)
        assert report.version == 1 and report.canary_abs_dev is None and report.pending_canary is not None
        assert not report.pending_canary.done(), "publish did not wait for the engine's score"
        assert "sync/canary_abs_dev" not in report.as_metrics()
        release.set()
        dev, seconds = report.pending_canary.result(timeout=60)
        assert dev < 1e-5 and seconds > 0
        assert engine.stats().weight_loads == 1
        good.close()

        broken = CanarySync(_leaving_out("model.norm.weight")(engine), engine, bound=FP32_BOUND, defer=True)
        _perturb(policy.model, seed=2)
        pending = broken.publish(policy, 2).pending_canary
        assert pending is not None
        with pytest.raises(CanaryError, match=r"replica embedded .* policy version 2: max \|trainer - engine\|"):
            pending.result(timeout=60)
        with pytest.raises(CanaryError, match="policy version 2"):
            broken.publish(policy, 3)  # the failed verdict stops the next publish
        broken.close()


def test_make_weight_sync_wraps_the_sync_unless_the_knob_is_off(tiny_model_dir: Path) -> None:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        on = make_weight_sync(EmbeddedEngineConfig(), engine, sync_settings(load_config(None, [])))
        assert isinstance(on, CanarySync) and isinstance(on.inner, InProcessWeightSync)
        assert on.half == 32 and on.bound == FP32_BOUND, "float32 both sides: the 64-id probe"
        low = make_weight_sync(EmbeddedEngineConfig(dtype="bfloat16"), engine, sync_settings(load_config(None, [])))
        assert isinstance(low, CanarySync) and low.half == 128 and low.bound > FP32_BOUND
        off = make_weight_sync(EmbeddedEngineConfig(), engine, sync_settings(load_config(None, ["train.sync_canary=false"])))
        assert isinstance(off, InProcessWeightSync)


@pytest.mark.e2e
def test_a_run_whose_sync_leaves_a_tensor_behind_stops_at_step_1(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 2-step run on the embedded engine whose in-process sync skips a tensor: the first
    publish's verdict raises the canary's error, the run stops, no step's metrics are written."""
    from harnessrl.engine import weight_sync as ws
    from harnessrl.train.run import run as train

    monkeypatch.setattr(ws.InProcessWeightSync, "start_publish",
                        _leaving_out("layers.0.mlp.down_proj.weight").start_publish)
    cfg = _tiny_run(tmp_path, steps=2, max_staleness=0)
    run_dir = tmp_path / "run"
    with pytest.raises(CanaryError, match=r"replica embedded .* policy version 1: .* nats"):
        asyncio.run(train(cfg, run_dir))
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "no step completed"

    # the same run with a working sync logs the canary every step, far below the bound
    monkeypatch.undo()
    history = asyncio.run(train(cfg, tmp_path / "run2"))
    rows = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] == [h["step"] for h in history]
    assert all(r["sync/canary_abs_dev"] < 1e-5 for r in rows if not r.get("skipped")), rows


@pytest.mark.e2e
def test_a_run_records_each_step_with_its_deferred_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 3-step run whose engine takes 1.5 s to score the canary's probe: each step's publish
    returns before the engine's score (`time/sync_s` below it), every step is recorded with its
    own verdict (`sync/canary_seconds` includes the 1.5 s), and the run trains all 3 steps."""
    import time as _time

    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.train.run import run as train

    scored = EmbeddedEngine.prompt_logprobs

    def slow(self, ids, replica=0):  # type: ignore[no-untyped-def]
        _time.sleep(1.5)
        return scored(self, ids, replica)

    monkeypatch.setattr(EmbeddedEngine, "prompt_logprobs", slow)
    cfg = _tiny_run(tmp_path, steps=3, max_staleness=1)
    history = asyncio.run(train(cfg, tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] == [h["step"] for h in history]
    assert [r["policy_version"] for r in rows] == [1, 2, 3], "every step trained"
    for r in rows:
        assert r["sync/canary_abs_dev"] < 1e-5 and r["sync/canary_seconds"] >= 1.5, r
        assert r["time/sync_s"] < 1.5, "publish waited for the engine's score"


@pytest.mark.e2e
def test_a_run_stopped_while_a_step_waits_for_its_verdict_still_records_that_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled (as a signal cancels it) while step 2 trains and step 1's verdict is still on its
    way: step 1 completed, so it is written once the verdict arrives; step 2 is not."""
    import time as _time

    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.train.run import run as train
    from harnessrl.train.trainer_group import TrainerGroup

    scored, trainer_step = EmbeddedEngine.prompt_logprobs, TrainerGroup.step
    second = threading.Event()

    def slow(self, ids, replica=0):  # type: ignore[no-untyped-def]
        _time.sleep(2.0)
        return scored(self, ids, replica)

    def step(self, rows, step=None, before_update=None, policy_version=None):  # type: ignore[no-untyped-def]
        if step == 2:
            second.set()
        return trainer_step(self, rows, step, before_update, policy_version)

    monkeypatch.setattr(EmbeddedEngine, "prompt_logprobs", slow)
    monkeypatch.setattr(TrainerGroup, "step", step)
    cfg = _tiny_run(tmp_path, steps=3, max_staleness=1)

    async def main() -> None:
        task = asyncio.ensure_future(train(cfg, tmp_path / "run"))
        while not second.is_set():
            assert not task.done(), task
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1], rows
    assert rows[0]["sync/canary_abs_dev"] < 1e-5 and rows[0]["sync/canary_seconds"] >= 2.0
    written = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(written) == 2, "step 1's group, once"
