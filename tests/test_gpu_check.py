"""`bench/gpu_check.py --device cpu`: the CUDA check's own run on the CPU (gloo instead of NCCL,
float32 where bfloat16 is not native, a 2-layer Qwen2): every part runs and its figures hold
(greedy ids equal to HF `generate`'s, the step-0 checks <= 1e-3, FSDP2 on a 1-rank process
group under torchrun, a 3-step white-box run); and what its kit for the GPU machine holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kit_holds_the_dependency_closure_without_torch() -> None:
    reqs = dict(r.split("==") for r in _module().kit_requirements())
    assert {"transformers", "tokenizers", "matplotlib", "pillow", "pydantic", "uvicorn", "gguf"} <= set(reqs)
    assert not {"torch", "numpy", "filelock", "typing-extensions", "hf-xet", "kernels", "harnessrl"} & set(reqs)
    from importlib import metadata

    assert reqs["transformers"] == metadata.version("transformers")  # pinned to what is installed


def test_kit_tokenizer_is_unpacked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lzma

    mod = _module()
    kit = tmp_path / "kit"
    (kit / "tokenizer").mkdir(parents=True)
    (kit / "tokenizer" / "tokenizer.json.xz").write_bytes(lzma.compress(b'{"version": "1.0"}'))
    (kit / "tokenizer" / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(mod, "HERE", kit)
    got = mod.tokenizer_dir(tmp_path / "out")
    assert got == tmp_path / "out" and (got / "tokenizer.json").read_bytes() == b'{"version": "1.0"}'
    assert (got / "tokenizer_config.json").read_text() == "{}" and not (got / "tokenizer.json.xz").exists()


@pytest.mark.e2e
def test_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["failed"] == [] and figures["shape"] == "tiny" and figures["env"]["device"] == "cpu"

    engine = figures["engine"]
    assert engine["prompts"] == 8 and engine["greedy_equal"] == 8 and engine["greedy_prefix_frac"] == 1.0
    assert sorted(engine["tokens_per_s"], key=int) == ["1", "8", "32"]
    assert all(v > 0 for v in engine["tokens_per_s"].values()) and engine["generate_tokens_per_s"] > 0

    trainer = figures["trainer"]
    assert trainer["step0_ok"] and 0 <= trainer["step0_ratio_abs_dev"] <= 1e-3
    assert trainer["tokens_trained"] > 0 and len(trainer["step_s"]) == 3

    fsdp2 = figures["fsdp2"]
    assert fsdp2["returncode"] == 0 and fsdp2["process_group"] and fsdp2["backend"] == "gloo"
    assert [s["step"] for s in fsdp2["steps"]] == [1] and fsdp2["step0_ratio_abs_dev"] <= 1e-3

    train = figures["train"]
    assert [s["step"] for s in train["steps"]] == [1, 2, 3] and train["step0_ratio_abs_dev"] <= 1e-3
    assert train["curve_png"] and all(s["tokens_trained"] > 0 for s in train["steps"])
