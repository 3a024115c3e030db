"""Model store: names resolve offline, cached copies are reused, the SmolLM2 copy is a plain fp32 model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harnessrl.engine import model_store
from harnessrl.engine.model_store import TINY_MODEL, load_causal_lm, load_tokenizer, resolve_model
from harnessrl.errors import ModelLoadError


def _no_rebuild(out: Path) -> None:
    raise AssertionError(f"cache was rebuilt into {out}")


def test_second_resolve_reuses_the_cache(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tiny_model_dir / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    monkeypatch.setattr(model_store, "_build_tiny", _no_rebuild)
    monkeypatch.setattr(model_store, "_build_smollm2", _no_rebuild)
    assert resolve_model(TINY_MODEL) == tiny_model_dir
    assert resolve_model("smollm2-135m").name == "smollm2-135m"
    assert weights.stat().st_mtime_ns == mtime_ns


def test_cached_builds_once_and_leaves_no_temp_dirs(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    target = tmp_path / "models" / "m"
    assert model_store._cached(target, build) == target
    assert model_store._cached(target, build) == target
    assert len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "partial.bin").write_bytes(b"x")
        raise ModelLoadError("boom")

    with pytest.raises(ModelLoadError, match="boom"):
        model_store._cached(tmp_path / "models" / "m", build)
    assert list((tmp_path / "models").iterdir()) == []


def test_bad_names_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="'no-such/model-xyz'"):
        resolve_model("no-such/model-xyz")


def test_local_directory_resolves_to_itself(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


def test_smollm2_copy_is_plain_fp32_with_end_of_turn_eos() -> None:
    model_dir = resolve_model("smollm2-135m")
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    tokenizer = load_tokenizer(model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos])
    model = load_causal_lm(model_dir)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6, n_params
    assert {p.dtype for p in model.parameters()} == {torch.float32}
