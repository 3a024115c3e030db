"""The Makefile installs the system packages the defaults need, and `.ci/run` installs nothing.

A default that starts needing a Debian package (`sandbox.select.system_packages`) without the
Makefile installing it fails here; so does an install step that creeps back into `.ci/run`.
The Makefile's installer is run for real (`make system`) with packages that are present, and
with a package that is missing where it cannot install: it must stop at once with one line
naming the command to run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.select import system_packages

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = (REPO / "Makefile").read_text()


def _packages(var: str) -> dict[str, str]:
    """The `package:command` pairs of Makefile variable `var`."""
    m = re.search(rf"^{var}\s*:?=\s*(.*)$", MAKEFILE, re.M)
    assert m, f"Makefile has no {var}"
    return dict(pair.split(":", 1) for pair in m.group(1).split())


def _prerequisites(target: str) -> list[str]:
    m = re.search(rf"^{target}:(.*)$", MAKEFILE, re.M)
    assert m, f"Makefile has no target {target}"
    return m.group(1).split()


def test_the_default_train_config_needs_only_what_make_train_installs() -> None:
    needed = system_packages(load_config(None).sandbox, isolation="required")
    assert needed == {"bubblewrap": "bwrap"}
    assert needed.items() <= _packages("TRAIN_PACKAGES").items()
    assert "system" in _prerequisites("setup") and "setup" in _prerequisites("train")


def test_make_test_installs_what_the_required_tests_need() -> None:
    podman = system_packages(PodmanSandboxConfig(), isolation="required")
    assert podman.items() <= _packages("PODMAN_PACKAGES").items()
    assert "debootstrap" in _packages("PODMAN_PACKAGES")  # scripts/podman-image builds the image with it
    assert _packages("BROWSER_PACKAGES") == {"chromium": "chromium"}
    assert {"setup", "agents", "browser", "podman", "vllm"} <= set(_prerequisites("test"))
    assert "scripts/podman-image" in MAKEFILE and "engine install vllm" in MAKEFILE


def test_ci_installs_nothing_of_its_own_and_runs_the_main_job() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    code = "\n".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))
    for step in ("apt-get", "pip install", "pip3", "engine install", "npm", "podman-image", "debootstrap"):
        assert step not in code, f".ci/run runs {step!r} itself; it belongs in the Makefile"
    assert re.search(r"^make test$", code, re.M)
    assert re.search(r"^for job in train-ci train-agent-ci; do", code, re.M) and 'make "$job"' in code
    for job in ("train-ci", "train-agent-ci"):
        _prerequisites(job)  # both short forms are Makefile targets
    for var in ("BWRAP", "CHROMIUM", "PODMAN", "VLLM", "AGENTS"):
        assert f"HARNESSRL_REQUIRE_{var}=1" in code


def _make_system(packages: str, env: dict[str, str], user: int | None = None) -> tuple[subprocess.CompletedProcess, float]:
    argv = ["make", "-s", "-C", str(REPO), "system", f"TRAIN_PACKAGES={packages}"]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


def test_make_system_is_a_no_op_when_every_command_is_present() -> None:
    proc, _ = _make_system("coreutils:ls findutils:find", dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_make_system_without_apt_get_names_the_command_in_one_line(tmp_path: Path) -> None:
    # a PATH with make and the shell's tools but no apt-get: a machine that is not Debian-like
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("make", "sh", "id", "sudo"):
        if path := shutil.which(tool):
            (bindir / tool).symlink_to(path)
    proc, seconds = _make_system("no-such-package-hrl:no-such-command-hrl", {"PATH": str(bindir)})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("make: ***"), proc.stderr  # make's own closing line
    assert "no apt-get here" in lines[0]
    assert "apt-get install -y --no-install-recommends no-such-package-hrl" in lines[0]
    assert seconds < 10


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the installer as an unprivileged user")
def test_make_system_as_a_user_without_sudo_names_the_sudo_command(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    proc, seconds = _make_system("no-such-package-hrl:no-such-command-hrl", env, user=65534)
    assert proc.returncode != 0
    first = proc.stderr.strip().splitlines()[0]
    assert first == ("harnessrl needs the system packages no-such-package-hrl: run  sudo apt-get update && "
                     "sudo apt-get install -y --no-install-recommends no-such-package-hrl"), proc.stderr
    assert seconds < 10


@pytest.mark.parametrize(("reason", "environ", "expected"), [
    ("bubblewrap (bwrap) is not installed or cannot run", {"HARNESSRL_REQUIRE_BWRAP": "1"}, "HARNESSRL_REQUIRE_BWRAP"),
    ("no bwrap", {"HARNESSRL_REQUIRE_BWRAP": "1"}, "HARNESSRL_REQUIRE_BWRAP"),
    ("no bwrap", {}, None),  # a user's machine: the skip stays a skip
    ("without bubblewrap only the pids cgroup catches a daemon that left every marker",
     {"HARNESSRL_REQUIRE_BWRAP": "1"}, None),  # a skip by design, not a missing install
    ("/usr/bin/chromium is absent (Debian package chromium)", {"HARNESSRL_REQUIRE_CHROMIUM": "1"},
     "HARNESSRL_REQUIRE_CHROMIUM"),
    ("opencode is not installed (harnessrl harness install opencode)", {"HARNESSRL_REQUIRE_AGENTS": "1"},
     "HARNESSRL_REQUIRE_AGENTS"),
    ("opencode is not installed (harnessrl harness install opencode)", {"HARNESSRL_REQUIRE_BWRAP": "1"}, None),
])
def test_a_skip_for_a_required_missing_part_fails_in_ci(reason: str, environ: dict[str, str],
                                                        expected: str | None) -> None:
    from conftest import required_part_missing

    assert required_part_missing(reason, environ) == expected
